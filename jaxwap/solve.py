"""The search: every mesh, the best strategy per parameter on each, then the objective.

Per mesh the layer weights form a chain (forward order), and the communication a
tensor-parallel layer costs depends only on its neighbour's choice (column-then-row
pairs need no gather in between), so a dynamic program along the chain finds the
per-parameter strategies that minimise modelled step time. Gradient reduction overlaps
backward compute, which makes its cost non-additive; the DP is run with the reduction
weighted 1, 1/2 and 0 and each result is priced exactly. Non-layer parameters (biases,
norms, embeddings) choose independently. A candidate over the memory budget is repaired
greedily (the FSDP variant that frees the most memory per second added, first) before
it is declared not to fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .cost import (
    DATA,
    MODEL,
    MeshCosts,
    Prediction,
    Strategy,
    mesh_costs,
    peak_memory,
    predict,
    tp_final_cost,
    tp_pair_cost,
)
from .graph import Graph
from .hardware import Cluster
from .objective import Objective

_OVERLAP_WEIGHTS = (1.0, 0.5, 0.0)


@dataclass(frozen=True)
class MeshResult:
    """The best assignment found on one mesh and its prediction."""

    d: int
    m: int
    strategies: tuple[Strategy, ...]
    predicted: Prediction
    fits: bool
    variant: str = "planner"   # or "data-parallel": the baseline every user could write


@dataclass(frozen=True)
class SearchResult:
    """Per-mesh results (and the data-parallel baseline, when it differs), their scores,
    the analytic best, and the index of the best data-parallel baseline (or -1)."""

    results: tuple[MeshResult, ...]
    scores: tuple[float, ...]
    best: int
    skipped: tuple[str, ...]
    baseline: int = -1


def _largest_dim(shape: Sequence[int], dims: Sequence[int], k: int,
                 exclude: int | None = None) -> int | None:
    ok = [i for i in dims if i != exclude and shape[i] % k == 0 and shape[i] >= k]
    return max(ok, key=lambda i: (shape[i], -i)) if ok else None


def _spec(ndim: int, **axes: int | None) -> tuple[str | None, ...]:
    spec: list[str | None] = [None] * ndim
    for name, dim in axes.items():
        if dim is not None:
            spec[dim] = name
    return tuple(spec)


def param_strategies(graph: Graph, j: int, d: int, m: int) -> tuple[Strategy, ...]:
    """Replicate; FSDP over data; column / row over model (each also with FSDP)."""
    shape = graph.params[j].shape
    nd = len(shape)
    out = [Strategy("replicate", _spec(nd))]
    all_dims = range(nd)
    fsdp = _largest_dim(shape, all_dims, d) if d > 1 else None
    if fsdp is not None:
        out.append(Strategy("fsdp", _spec(nd, data=fsdp), data_sharded=True))
    layer = next((L for L in graph.layers if L.param == j), None)
    if m > 1 and layer is not None:
        for kind, dims in (("col", layer.out_dims), ("row", layer.in_dims)):
            tdim = _largest_dim(shape, dims, m)
            if tdim is None:
                continue
            out.append(Strategy(f"tp-{kind}", _spec(nd, model=tdim), tp=kind))
            f2 = _largest_dim(shape, all_dims, d, exclude=tdim) if d > 1 else None
            if f2 is not None:
                out.append(Strategy(f"tp-{kind}+fsdp", _spec(nd, model=tdim, data=f2),
                                    tp=kind, data_sharded=True))
    return tuple(out)


def _dp(graph: Graph, cluster: Cluster, mc: MeshCosts, weight: float) -> list[int]:
    """Strategy indices minimising compute + weight*grad comm + TP chain communication."""
    P = len(graph.params)
    choice = [0] * P
    d, m = mc.d, mc.m

    def own(j: int, s: int) -> float:
        return mc.param_time[j][s] + weight * mc.grad_comm[j][s][0]

    layer_params = {L.param for L in graph.layers}
    for j in range(P):
        if j not in layer_params:
            choice[j] = min(range(len(mc.strategies[j])), key=lambda s, j=j: own(j, s))
    if not graph.layers:
        return choice
    # states: kind of the previous layer -> (cost, back-pointer list)
    states: dict[str, tuple[float, list[int]]] = {"none": (0.0, [])}
    for L in graph.layers:
        j = L.param
        nxt: dict[str, tuple[float, list[int]]] = {}
        for s, strat in enumerate(mc.strategies[j]):
            for prev, (c, picks) in states.items():
                cost = c + own(j, s) + tp_pair_cost(L, prev, strat.tp, d, m, cluster)[0]
                if strat.tp not in nxt or cost < nxt[strat.tp][0]:
                    nxt[strat.tp] = (cost, picks + [s])
        states = nxt
    last = graph.layers[-1]
    _, picks = min(((c + tp_final_cost(last, k, d, m, cluster)[0], p)
                    for k, (c, p) in states.items()), key=lambda t: t[0])
    for L, s in zip(graph.layers, picks, strict=True):
        choice[L.param] = s
    return choice


def _repair(graph: Graph, cluster: Cluster, mc: MeshCosts, choice: list[int],
            budget: float) -> list[int]:
    """Move parameters to data-sharded variants until the candidate fits (or cannot)."""
    d, m = mc.d, mc.m
    choice = list(choice)
    for _ in range(4 * len(choice) + 1):
        shards = [mc.strategies[j][s].shard(d, m) for j, s in enumerate(choice)]
        mem, k = peak_memory(graph, d, m, shards)
        if mem <= budget:
            break
        at_peak = graph.live[k, 2:]
        best, best_gain = None, 0.0
        for j, s in enumerate(choice):
            cur = mc.strategies[j][s]
            for s2, alt in enumerate(mc.strategies[j]):
                new_shard = alt.shard(d, m)
                saved = at_peak[j] * (1.0 / shards[j] - 1.0 / new_shard)
                if saved <= 0 or alt.tp not in (cur.tp, "none") and cur.tp != "none":
                    continue
                added = (mc.param_time[j][s2] + mc.grad_comm[j][s2][0]
                         - mc.param_time[j][s] - mc.grad_comm[j][s][0])
                gain = saved / max(added, 1e-9)
                if gain > best_gain:
                    best, best_gain = (j, s2), gain
        if best is None:
            break
        choice[best[0]] = best[1]
    return choice


def solve_mesh(graph: Graph, cluster: Cluster, d: int, m: int, budget: float) -> MeshResult:
    strategies = [param_strategies(graph, j, d, m) for j in range(len(graph.params))]
    mc = mesh_costs(graph, cluster, d, m, strategies)
    tried: dict[tuple[int, ...], Prediction] = {}
    for w in _OVERLAP_WEIGHTS:
        choice = _dp(graph, cluster, mc, w)
        for c in (choice, _repair(graph, cluster, mc, choice, budget)):
            key = tuple(c)
            if key not in tried:
                tried[key] = predict(graph, cluster, mc, c)
    fitting = {k: p for k, p in tried.items() if p.peak_memory_bytes <= budget}
    pool = fitting or tried
    key = min(pool, key=lambda k: (pool[k].step_time_s if fitting
                                   else pool[k].peak_memory_bytes))
    return MeshResult(d, m, tuple(mc.strategies[j][s] for j, s in enumerate(key)),
                      tried[key], bool(fitting))


def mesh_shapes(num_devices: int, batch_size: int | None, graph: Graph,
                num_devices_exact: int | None = None) -> tuple[list[tuple[int, int]], list[str]]:
    """Every (data, model) factorisation of n <= num_devices devices worth trying."""
    shapes, skipped = [], []
    ns = [num_devices_exact] if num_devices_exact else range(1, num_devices + 1)
    for n in ns:
        for d in range(1, n + 1):
            if n % d:
                continue
            m = n // d
            if batch_size is None and d > 1:
                skipped.append(f"{d}x{m}: the step has no batch dimension to split")
                continue
            if batch_size is not None and batch_size % d:
                skipped.append(f"{d}x{m}: batch {batch_size} is not divisible by data={d}")
                continue
            if m > 1 and not any(
                    any(graph.params[L.param].shape[i] % m == 0 for i in L.in_dims + L.out_dims)
                    for L in graph.layers):
                skipped.append(f"{d}x{m}: no layer weight has a dim divisible by model={m}")
                continue
            shapes.append((d, m))
    return shapes, skipped


def search(graph: Graph, cluster: Cluster, objective: Objective, num_devices: int,
           budget: float, num_devices_exact: int | None = None) -> SearchResult:
    shapes, skipped = mesh_shapes(num_devices, graph.batch_size, graph, num_devices_exact)
    if not shapes:
        raise ValueError(_no_mesh_message(graph, num_devices, num_devices_exact, skipped))
    results = [solve_mesh(graph, cluster, d, m, budget) for d, m in shapes]
    # Plain data parallelism (every parameter replicated) is what a user would write by
    # hand; its best mesh is kept as a candidate of its own so verification can always
    # weigh the plan against it on XLA's figures.
    dp = [data_parallel(graph, cluster, d, budget) for d, m in shapes if m == 1]
    dp = [r for r in dp if r.fits]
    baseline = -1
    if dp:
        dp_scores = objective.scores([r.predicted for r in dp],
                                     max_watts=cluster.device.max_watts,
                                     num_devices_available=cluster.num_devices)
        b = min(range(len(dp)), key=lambda i: (dp_scores[i], dp[i].predicted.step_time_s))
        same = next((i for i, r in enumerate(results)
                     if (r.d, r.m) == (dp[b].d, 1) and r.strategies == dp[b].strategies), None)
        if same is None:
            results.append(dp[b])
            baseline = len(results) - 1
        else:
            baseline = same
    results = tuple(results)
    fitting = [r for r in results if r.fits]
    scores: list[float] = [math.inf] * len(results)
    if not fitting:
        best = min(range(len(results)), key=lambda i: results[i].predicted.peak_memory_bytes)
    else:
        # the objective ranks fitting candidates only; within max_slowdown the "fastest"
        # is the fastest that fits
        fit_idx = [i for i, r in enumerate(results) if r.fits and uses_model_axis(r)]
        if not fit_idx:
            shown = ", ".join(f"{r.d}x{r.m}" for r in results)
            raise ValueError(
                f"every usable mesh ({shown}) needs a model axis (batch "
                f"{graph.batch_size} cannot be split {num_devices_exact or num_devices} ways "
                f"over data), but no parameter gains from being split over it: the devices "
                f"would only duplicate work. Use fewer devices (num_devices=) or a batch "
                f"size divisible by the device count.")
        fit_scores = objective.scores([results[i].predicted for i in fit_idx],
                                      max_watts=cluster.device.max_watts,
                                      num_devices_available=cluster.num_devices)
        for i, s in zip(fit_idx, fit_scores, strict=True):
            scores[i] = s
        best = min(fit_idx, key=lambda i: (scores[i], results[i].predicted.step_time_s,
                                           results[i].d * results[i].m))
    return SearchResult(results, tuple(scores), best, tuple(skipped), baseline)


def data_parallel(graph: Graph, cluster: Cluster, d: int, budget: float) -> MeshResult:
    """Every parameter replicated over a (d, 1) mesh, the batch split d ways."""
    strategies = [param_strategies(graph, j, d, 1)[:1] for j in range(len(graph.params))]
    mc = mesh_costs(graph, cluster, d, 1, strategies)
    pred = predict(graph, cluster, mc, [0] * len(strategies))
    return MeshResult(d, 1, tuple(s[0] for s in strategies), pred,
                      pred.peak_memory_bytes <= budget, "data-parallel")


def uses_model_axis(r: MeshResult) -> bool:
    """A mesh with a model axis that no parameter is sharded over only duplicates work."""
    return r.m == 1 or any(s.tp != "none" for s in r.strategies)


def _no_mesh_message(graph: Graph, n: int, exact: int | None, skipped: Sequence[str]) -> str:
    B = graph.batch_size
    what = f"exactly {exact}" if exact else f"up to {n}"
    return (f"batch size {B} is not divisible by the data-axis size of any usable mesh of "
            f"{what} devices ({'; '.join(skipped[:6])}). Change the batch size or the "
            f"number of devices.")


__all__ = ["DATA", "MODEL", "MeshResult", "SearchResult", "search", "param_strategies"]
