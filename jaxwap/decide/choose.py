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

from jaxwap.analysis.roles import ParamInfo
from jaxwap.core.objective import Objective, Ranking
from jaxwap.core.records import (
    COMPILED,
    MEASURED,
    PREDICTED,
    Judged,
    Measurement,
    Prediction,
    StepVariant,
    judge,
)
from jaxwap.core.version import __version__
from jaxwap.cost.prediction import at_power_limit
from jaxwap.decide.attention_advice import planned_advice
from jaxwap.decide.fused_counterfactual import ScoreSites
from jaxwap.decide.verify import Verification
from jaxwap.hardware.cluster import Cluster
from jaxwap.plans.frontier import pareto_front
from jaxwap.plans.plan import Candidate, ParamPlacement, Plan
from jaxwap.search.solve import SearchResult, uses_model_axis


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
    # Python calls a call of the step makes on its pytrees (`host_calls.tree_calls`),
    # counted where the profile prices them; every graph of the plan carries it
    tree_calls: int = 0
    # the step's materialized attention scores and its fused counterfactual
    # (`fused_counterfactual.score_sites`), which the plan's advice prices on its candidate
    attention: ScoreSites | None = field(default=None, compare=False)


@dataclass(frozen=True)
class _Point:
    """One (candidate, power limit) the decision weighs: the search's candidate `base`
    under `predicted.power_limit_w` (None: the board default), with its figures of every
    tier it reached. A power limit is not measured: a capped point has no measurement."""

    base: int
    predicted: Prediction
    verified: Prediction | None
    measured: Measurement | None

    @property
    def judged(self) -> Judged:
        return judge(self.predicted, self.verified, self.measured)


def _points(ctx: PlanContext, search: SearchResult, ver: Verification | None,
            measured: Mapping[int, Measurement]) -> list[_Point]:
    """Every candidate at the board default, then every fitting one under each power
    limit its devices accept (`PowerProfile.limits`) where the limit changes its figures.
    "throughput" never caps: a limit can only slow a step."""
    vpreds = ver.predictions if ver is not None else {}
    points = [_Point(i, r.predicted, vpreds.get(i), measured.get(i))
              for i, r in enumerate(search.results)]
    limits = ctx.cluster.device.power_profile().limits()
    if ctx.objective.kind == "throughput" or not limits:
        return points
    batch = ctx.batch_size or 1
    for i, r in enumerate(search.results):
        if not r.fits:
            continue
        for w in limits:
            pred = at_power_limit(r.predicted, ctx.cluster, batch, w)
            if pred.energy_per_step_j >= r.predicted.energy_per_step_j * (1 - 1e-9):
                continue   # the limit binds on nothing: it saves nothing
            v = vpreds.get(i)
            points.append(_Point(i, pred, None if v is None else at_power_limit(
                v, ctx.cluster, batch, w), None))
    return points


def _tiers(ctx: PlanContext, search: SearchResult, ver: Verification | None,
           points: list[_Point]) -> dict[str, Ranking]:
    """The objective's ranking of the points on each tier's figures: the model's (every
    candidate the search found eligible), the model fed XLA's (those that compiled and fit
    by XLA's analysis), what was measured."""
    kw = {"max_watts": ctx.cluster.device.max_watts,
          "num_devices_available": ctx.cluster.num_devices}
    rank = ctx.objective.rank
    eligible = [search.results[p.base].fits and uses_model_axis(search.results[p.base])
                for p in points]
    got = rank([p.predicted if e else None for p, e in zip(points, eligible, strict=True)],
               **kw)
    # nothing fits: the search's pick (the least memory) stands, to say so
    tiers = {PREDICTED: got if got.best >= 0 else Ranking(
        search.scores + (float("inf"),) * (len(points) - len(search.scores)), search.best)}
    if ver is not None:
        figs = ver.figures
        tiers[COMPILED] = rank([
            judge(p.predicted, p.verified) if p.verified is not None and p.base in figs
            and figs[p.base].memory_bytes <= ctx.budget else None for p in points], **kw)
    if any(p.measured is not None for p in points):
        tiers[MEASURED] = rank([p.judged if p.measured is not None else None
                                for p in points], **kw)
    return tiers


def chosen_result(plan: Plan) -> int:
    """The index in the search's results of the candidate the plan runs (a power-limited
    point runs the layout of the candidate it caps)."""
    i = next(i for i, c in enumerate(plan.candidates) if c.chosen)
    return plan.candidates[i].of if plan.candidates[i].of is not None else i


def build_plan(ctx: PlanContext, search: SearchResult, ver: Verification | None = None,
               measured: Mapping[int, Measurement] | None = None) -> Plan:
    """The Plan: the best (candidate, power limit) of the highest tier reached (measured,
    else compiled, else predicted), every candidate with its figures, score and verdict,
    and the power-limited points on the time/energy frontier."""
    measured = dict(measured or {})
    points = _points(ctx, search, ver, measured)
    tiers = _tiers(ctx, search, ver, points)
    top = next(t for t in (MEASURED, COMPILED, PREDICTED) if t in tiers)
    chosen = tiers[top].best
    figs = ver.figures if ver is not None else {}
    best = search.results[points[chosen].base]
    decision = _Decision(search, ver, tiers, top, chosen, ctx.budget, points[chosen].judged)
    n = len(search.results)
    # the capped points kept: those on the frontier of every eligible point, capped or not
    fitting = [k for k, p in enumerate(points)
               if tiers[p.judged.basis].scores[k] != float("inf")]
    front = {fitting[i] for i in pareto_front([
        (points[k].judged.step_time_s, points[k].judged.energy_per_step_j) for k in fitting])}
    cands = []
    for k, p in enumerate(points):
        if k >= n and k != chosen and k not in front:
            continue   # a capped point another point beats on both time and energy
        r = search.results[p.base]
        j = p.judged
        score = tiers[j.basis].scores[k]
        fits = r.fits and (p.base not in figs or figs[p.base].memory_bytes <= ctx.budget)
        counts = Counter(s.name for s in r.strategies)
        cands.append(Candidate(
            r.mesh, p.predicted, float(score), fits, k == chosen,
            decision.verdict(k, p.base, j, score), tuple(sorted(counts.items())),
            compiled=figs.get(p.base), verified=p.verified, variant=r.variant,
            measured=p.measured, of=p.base if k >= n else None))
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
    if top == MEASURED and len(points) > n:
        notes.append("power limits are not measured: the measured choice is at the board's "
                     "default limit")
    pick = points[chosen]
    advice, why = planned_advice(ctx.attention, best, ctx.cluster, pick.predicted,
                                 (best.step or ctx.step).describe())
    notes += [why] if why else []
    return Plan(
        mesh_shape=dict(best.mesh),
        device_ids=_device_ids(ctx, best.num_devices),
        params=placements, objective=ctx.objective, predicted=pick.predicted,
        candidates=tuple(cands), compiled=figs.get(pick.base), verified=pick.verified,
        measured=pick.measured, hardware=ctx.cluster, batch_size=ctx.batch_size,
        memory_budget_bytes=ctx.budget, planning_time_s=dict(ctx.timing),
        notes=tuple(notes), version=__version__, step=best.step or ctx.step,
        attention=advice,
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
    chosen: int              # of the points
    budget: float
    ref: Judged              # the chosen point's figures

    def verdict(self, k: int, i: int, j: Judged, score: float) -> str:
        """Why point k, of the search's candidate i (judged `j`, scored `score` in its own
        tier), is not the plan."""
        r = self.search.results[i]
        ver, budget = self.ver, self.budget
        figs = ver.figures if ver is not None else {}
        if k == self.chosen:
            return "chosen"
        if ver is not None and i in ver.failed:
            return f"did not compile: {ver.failed[i]}"
        if i in figs and figs[i].memory_bytes > budget:
            return f"over memory budget by XLA's analysis ({figs[i].memory_bytes / budget:.2f}x)"
        if not r.fits:
            return f"over memory budget ({j.peak_memory_bytes / budget:.2f}x)"
        if not uses_model_axis(r):
            return "no layout splits a parameter over the model axis: it would only duplicate work"
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


__all__ = ["PlanContext", "build_plan", "chosen_result"]
