"""One step variant's search and its check by XLA: the search bound to the plan's options,
the finalists compiled and ranked on XLA's figures, and the search again with a tightened
budget when XLA needs more memory than the model predicted.

The step variants (`step_variants.search_variants`) and the fused-attention counterfactual
(`fused_counterfactual.ScoreSites.replanned`) are searched with the one searcher
`step_searcher` builds, so a variant and its counterfactual are weighed alike.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from jaxwap.analysis.graph import Graph
from jaxwap.analysis.trace import ArgLayout
from jaxwap.core.units import si
from jaxwap.decide.choose import PlanContext
from jaxwap.decide.verify import Verification, compile_candidate, run_verification
from jaxwap.options import PlanOptions
from jaxwap.search.across_meshes import search
from jaxwap.search.constraints import LayoutRules
from jaxwap.search.solve import SearchResult


def step_searcher(ctx: PlanContext, options: PlanOptions, usable: int,
                  rules: LayoutRules | None, micro_batches: int = 1
                  ) -> Callable[[Graph], SearchResult]:
    """The search a graph of the step gets under these options, the budget bound (a
    caller may pass another `budget=`): the step's variants, and the fused counterfactual
    of its attention (`fused_counterfactual.score_sites`)."""
    return functools.partial(search, cluster=ctx.cluster, objective=ctx.objective,
                             num_devices=usable, budget=ctx.budget,
                             num_devices_exact=options.num_devices,
                             micro_batches=micro_batches, offload=options.offload,
                             mesh=options.mesh, allowed=rules, replicas=options.replicas)


def verify_finalists(fn: Callable, layout: ArgLayout, ctx: PlanContext, options: PlanOptions,
                     result: SearchResult) -> Verification:
    """Compile the search's finalists exactly as they would run, and rank them on XLA's
    figures."""
    compile_fn = functools.partial(compile_candidate, fn, layout, devices=ctx.devices,
                                   cluster=ctx.cluster, donate=options.donate,
                                   compiler_options=options.compiler_options)
    return run_verification(result, options.verify, compile_fn, cluster=ctx.cluster,
                            objective=ctx.objective, budget=ctx.budget,
                            batch_size=ctx.batch_size or 1)


def tighten(result: SearchResult, ver: Verification,
            searcher: Callable[[float], SearchResult],
            verifier: Callable[[SearchResult], Verification], budget: float,
            timing: dict[str, float], notes: list[str], attempts: int = 3
            ) -> tuple[SearchResult, Verification]:
    """When XLA needs more than the model predicted for every compiled candidate, search
    again for a modelled budget shrunk by how far the closest one missed, so the repairs
    (optimizer state sharded or kept in host memory) get their chance before the step is
    restructured. A few rounds: each compile tells how much more to free."""
    modelled = budget
    for _ in range(attempts):
        i = min(ver.figures, key=lambda i: ver.figures[i].memory_bytes)
        need = ver.figures[i].memory_bytes
        if need <= budget:
            break
        modelled = min(modelled, result.results[i].predicted.peak_memory_bytes) \
            * budget / need * 0.98
        t_s = time.perf_counter()
        again = searcher(modelled)
        timing["search"] += time.perf_counter() - t_s
        if not again.results[again.best].fits:
            break
        ver2 = verifier(again)
        timing["verify"] = timing.get("verify", 0.0) + ver2.verify_time_s
        if not ver2.figures:
            break
        result, ver = again, ver2
        if ver.best >= 0:
            notes.append(f"the memory model under-counted XLA's figures: searched again for "
                         f"{si(modelled, 'B')} of modelled memory to fit {si(budget, 'B')}")
            break
    return result, ver


__all__ = ["step_searcher", "tighten", "verify_finalists"]
