"""Verification: compile the finalists and believe XLA over the model.

The analytic search ranks every candidate on the model's figures; this stage compiles the
best few (and the best plain data-parallel layout, whatever its rank), reads XLA's own
per-device figures (`xla_figures.compiled_figures`), feeds them back into the cost model in place
of its own guesses (`mesh_prediction.with_compiled`), and ranks the candidates that fit by XLA's
memory analysis with the objective's one ranking. A candidate XLA says does not fit never
becomes the plan.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jaxwap.analysis.fused_attention import compiles_here, uses_fused_attention
from jaxwap.core.objective import Objective, Ranking
from jaxwap.core.records import CompiledFigures, Prediction, judge
from jaxwap.cost.mesh_prediction import with_compiled
from jaxwap.decide.xla_figures import compiled_figures
from jaxwap.hardware.cluster import Cluster
from jaxwap.runtime.compile import CompiledStep, compile_layout, host_resident_bytes
from jaxwap.runtime.train_step import restructured
from jaxwap.search.solve import MeshResult, SearchResult, uses_model_axis

# How a candidate is compiled: (XLA's figures, the compiled step or None). The planner
# compiles for real (`compile_candidate`); benchmarks may replay figures compiled before.
CompileFn = Callable[[MeshResult], tuple[CompiledFigures, CompiledStep | None]]


@dataclass(frozen=True)
class Verification:
    """What compiling the finalists showed. `figures`/`predictions` are keyed by candidate
    index; `failed` holds candidates whose compile raised, with the error; `ranking` is
    the objective's, on the compiled figures of the candidates that fit by XLA."""

    ranking: Ranking
    figures: dict[int, CompiledFigures]
    predictions: dict[int, Prediction]
    failed: dict[int, str]
    compiled_best: CompiledStep | None
    verify_time_s: float

    @property
    def best(self) -> int:
        return self.ranking.best


def compile_candidate(fn: Callable, layout: Any, r: MeshResult, devices: Sequence[Any],
                      cluster: Cluster, *, donate: bool = True,
                      compiler_options: dict[str, Any] | None = None
                      ) -> tuple[CompiledFigures, CompiledStep]:
    """Compile one candidate exactly as `auto_shard` would run it (the same
    `compile_layout`, the candidate's real placements, a pipelined candidate's step
    restructured as it says) and read XLA's figures for it."""
    cs = compile_layout(restructured(fn, r.step), layout, r.d, r.m, r.strategies, devices,
                        donate=donate, compiler_options=compiler_options, r=r.r,
                        stages=r.stages)
    host = host_resident_bytes(layout, r.strategies, r.d, r.m, donate, r.r, r.stages)
    return compiled_figures(cs.compiled, (r.d, r.m), cluster, cs.compile_time_s, host,
                            r.r, r.stages), cs


def unverifiable(closed: Any, devices: Sequence[Any]) -> str | None:
    """Why the step (its traced jaxpr `closed`) cannot be compiled on the present
    `devices` to verify a plan, as the plan's note says it; None if it can. cuDNN's fused
    attention (`jax.nn.dot_product_attention(..., implementation="cudnn")`) has an XLA
    lowering for NVIDIA GPUs only: planned from another host for GPUs, the plan is the
    model's alone."""
    if not uses_fused_attention(closed) or compiles_here(devices):
        return None
    return (f"verification skipped: the step uses cuDNN's fused attention "
            f"(jax.nn.dot_product_attention(..., implementation='cudnn')), which XLA "
            f"compiles for NVIDIA GPUs with cuDNN only, not for the "
            f"{devices[0].platform if devices else 'absent'} devices present; the plan's "
            f"figures are predicted")


def pipelined_with_compiled(pred: Prediction, figs: CompiledFigures) -> Prediction:
    """A pipelined candidate judged on XLA's memory and the model's time. XLA counts a
    loop body's flops once, and the pipeline's loop holds every stage's work behind a
    condition, so its flop count says nothing about the step's time; its memory analysis
    does say what the step holds."""
    return dataclasses.replace(pred, peak_memory_bytes=figs.memory_bytes)


def run_verification(search: SearchResult, k: int, compile_fn: CompileFn, *,
                     cluster: Cluster, objective: Objective, budget: float,
                     batch_size: int) -> Verification:
    """Compile candidates in the order the analytic search ranks them until `k` of them
    fit by XLA's memory analysis (the data-parallel baseline first, whatever its rank);
    rank those on the model fed XLA's figures."""
    t0 = time.perf_counter()
    results = search.results
    order = sorted((i for i, r in enumerate(results)
                    if uses_model_axis(r) and search.scores[i] != float("inf")),
                   key=lambda i: (search.scores[i], results[i].predicted.step_time_s))
    figures: dict[int, CompiledFigures] = {}
    preds: dict[int, Prediction] = {}
    failed: dict[int, str] = {}
    steps: dict[int, CompiledStep | None] = {}
    baseline = search.baseline
    queue = ([baseline] if baseline in order else []) + [i for i in order if i != baseline]
    for i in queue:
        if sum(1 for j in steps if j != baseline) >= k:
            break
        r = results[i]
        try:
            figs, cs = compile_fn(r)
        except Exception as e:  # noqa: BLE001 - XLA refusing a candidate is a verdict on it
            failed[i] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        figures[i] = figs
        preds[i] = (with_compiled(r.predicted, figs, cluster, batch_size, r.d, r.m, r.r)
                    if r.stages == 1 else pipelined_with_compiled(r.predicted, figs))
        if figs.memory_bytes <= budget:
            steps[i] = cs
    ranking = cluster.ranker(objective)(
        [judge(r.predicted, preds[i]) if i in steps else None for i, r in enumerate(results)])
    return Verification(ranking, figures, preds, failed, steps.get(ranking.best),
                        time.perf_counter() - t0)


__all__ = ["CompileFn", "Verification", "compile_candidate", "run_verification",
           "unverifiable"]
