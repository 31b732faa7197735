"""The decision: which candidate becomes the plan, and the one place a `Plan` is built.

Candidates are judged in tiers, each on the best figures it has (`records.judge`): the
analytic search ranks every candidate on the model's figures, verification ranks the
compiled finalists on XLA's, measured choice ranks the finalists run on the devices on
what they did. The plan is the best of the highest tier reached; every other candidate
keeps its own figures and says why it lost. Measurements are stored beside the prediction
and the compiled figures, never over them, so a plan re-chosen on measurements is the
same builder run again with one more tier.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .hardware import Cluster
from .objective import Objective, Ranking
from .plan import Candidate, ParamPlacement, Plan
from .records import (
    COMPILED,
    MEASURED,
    PREDICTED,
    Judged,
    Measurement,
    StepVariant,
    judge,
)
from .solve import SearchResult, uses_model_axis
from .state import ParamInfo
from .verify import Verification
from .version import __version__


@dataclass(frozen=True)
class PlanContext:
    """The question a plan answers, besides its candidates: the parameters, the objective,
    the hardware, the devices planning could use, the memory budget, the batch, the step
    variant, the planning time so far and the planner's notes."""

    params: tuple[ParamInfo, ...]
    params_treedef: Any
    objective: Objective
    cluster: Cluster
    devices: tuple[Any, ...]
    budget: float
    batch_size: int | None
    step: StepVariant = field(default_factory=StepVariant)
    timing: Mapping[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def rank_measured(ctx: PlanContext, search: SearchResult, ver: Verification | None,
                  measured: Mapping[int, Measurement]) -> Ranking:
    """The objective's ranking of the measured candidates on what they did."""
    preds = ver.predictions if ver is not None else {}
    return ctx.objective.rank(
        [judge(r.predicted, preds.get(i), measured[i]) if i in measured else None
         for i, r in enumerate(search.results)],
        max_watts=ctx.cluster.device.max_watts, num_devices_available=ctx.cluster.num_devices)


def build_plan(ctx: PlanContext, search: SearchResult, ver: Verification | None = None,
               measured: Mapping[int, Measurement] | None = None) -> Plan:
    """The Plan: the best candidate of the highest tier reached (measured, else compiled,
    else predicted), every candidate with its figures, score and verdict."""
    measured = dict(measured or {})
    tiers: dict[str, Ranking] = {PREDICTED: Ranking(tuple(search.scores), search.best)}
    if ver is not None:
        tiers[COMPILED] = ver.ranking
    if measured:
        tiers[MEASURED] = rank_measured(ctx, search, ver, measured)
    top = next(t for t in (MEASURED, COMPILED, PREDICTED) if t in tiers)
    chosen = tiers[top].best
    figs = ver.figures if ver is not None else {}
    vpreds = ver.predictions if ver is not None else {}
    best = search.results[chosen]
    decision = _Decision(search, ver, tiers, top, chosen, ctx.budget,
                         judge(best.predicted, vpreds.get(chosen), measured.get(chosen)))
    cands = []
    for i, r in enumerate(search.results):
        j = judge(r.predicted, vpreds.get(i), measured.get(i))
        score = tiers[j.basis].scores[i]
        fits = r.fits and (i not in figs or figs[i].memory_bytes <= ctx.budget)
        counts = Counter(s.name for s in r.strategies)
        cands.append(Candidate(
            r.mesh, r.predicted, float(score), fits, i == chosen,
            decision.verdict(i, j, score), tuple(sorted(counts.items())),
            compiled=figs.get(i), verified=vpreds.get(i), variant=r.variant,
            measured=measured.get(i)))
    placements = tuple(
        ParamPlacement(p.path, p.keystr, p.shape, p.dtype, s.spec, s.name, s.state_spec,
                       s.offload)
        for p, s in zip(ctx.params, best.strategies, strict=True))
    notes = list(ctx.notes)
    present = best.num_devices <= len(ctx.devices)
    if any(s.offload for s in best.strategies) and ctx.devices[0].platform == "cpu" \
            and present:
        notes.append("optimizer state planned for host memory: XLA:CPU compiles memory kinds "
                     "to nothing, so the saving is modelled, not verified, on this backend")
    return Plan(
        mesh_shape=dict(best.mesh),
        device_ids=_device_ids(ctx, best.num_devices),
        params=placements, objective=ctx.objective, predicted=best.predicted,
        candidates=tuple(cands), compiled=figs.get(chosen), verified=vpreds.get(chosen),
        measured=measured.get(chosen), hardware=ctx.cluster, batch_size=ctx.batch_size,
        memory_budget_bytes=ctx.budget, planning_time_s=dict(ctx.timing),
        notes=tuple(notes), version=__version__, step=best.step or ctx.step,
        _treedef=ctx.params_treedef)


def _device_ids(ctx: PlanContext, n: int) -> tuple[int, ...]:
    """The ids of the n devices the plan runs on, node by node; for a plan made for a
    described cluster larger than the devices present, its own numbering 0..n-1 (the
    devices of the cluster it will be loaded on, in the same order)."""
    if n > len(ctx.devices):
        return tuple(range(n))
    return tuple(int(d.id) for d in ctx.devices[:n])


_BASIS_WORD = {PREDICTED: "analytic", COMPILED: "compiled", MEASURED: "measured"}
_NOT_REACHED = {COMPILED: "not verified", MEASURED: "not measured"}


@dataclass(frozen=True)
class _Decision:
    """What was decided, and on which tier: enough to say why each candidate lost."""

    search: SearchResult
    ver: Verification | None
    tiers: Mapping[str, Ranking]
    top: str                 # the highest tier reached, which chose
    chosen: int
    budget: float
    ref: Judged              # the chosen candidate's figures

    def verdict(self, i: int, j: Judged, score: float) -> str:
        """Why candidate i (judged `j`, scored `score` in its own tier) is not the plan."""
        r = self.search.results[i]
        ver, budget = self.ver, self.budget
        figs = ver.figures if ver is not None else {}
        if i == self.chosen:
            return "chosen"
        if ver is not None and i in ver.failed:
            return f"did not compile: {ver.failed[i]}"
        if i in figs and figs[i].memory_bytes > budget:
            return f"over memory budget by XLA's analysis ({figs[i].memory_bytes / budget:.2f}x)"
        if not r.fits:
            return f"over memory budget ({j.peak_memory_bytes / budget:.2f}x)"
        if not uses_model_axis(r):
            return "no parameter gains from the model axis: it would only duplicate work"
        if score == float("inf"):
            return "outside the allowed slowdown"
        word = _BASIS_WORD[j.basis]
        if j.basis != self.top:
            own = self.tiers[j.basis]
            return (f"{_NOT_REACHED[self.top]} ({word} score {score / own.scores[own.best]:.2f}x "
                    f"the {word} best)")
        return (f"{word} score {score / self.tiers[self.top].scores[self.chosen]:.2f}x: "
                f"{j.step_time_s / self.ref.step_time_s:.2f}x time, "
                f"{j.energy_per_step_j / self.ref.energy_per_step_j:.2f}x energy")


__all__ = ["PlanContext", "build_plan", "rank_measured"]
