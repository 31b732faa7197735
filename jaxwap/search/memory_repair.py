"""Making a layout fit the memory budget: the repair that moves parameters to layouts
holding less at the peak, the lower bound on what any layout of a mesh can reach (which
spares the search meshes that cannot fit), and that bound for a step split into
micro-batches (which spares the planner traces of counts that cannot fit)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxwap.analysis.graph import NUM_CLASSES, WHOLE, Graph
from jaxwap.core.records import Strategy
from jaxwap.cost.layout_memory import divisor_rows, memory_weights, peak_memory
from jaxwap.cost.mesh_cost import MeshCosts
from jaxwap.hardware.cluster import Cluster
from jaxwap.search.constraints import LayoutRules
from jaxwap.search.meshes import mesh_shapes
from jaxwap.search.strategies import param_strategies, pins_hold, shard_replicas

#: peak points whose move tables `repair` keeps (the 70B's repair visits up to 562, and
#: each table is 3 x parameters x strategies values: 64 keep the cost of a revisit down)
KEPT_PEAKS = 64


def repair(graph: Graph, cluster: Cluster, mc: MeshCosts, choice: list[int],
            budget: float) -> list[int]:
    """Move parameters to variants that free memory at the peak until the candidate fits
    (or no move frees anything): each time the move with the most bytes freed per second
    of step time added. A tensor-parallel parameter keeps its kind (its neighbours' costs
    depend on it); a replicated one may become tensor-parallel."""
    d, m, r = mc.d, mc.m, mc.r
    P = len(choice)
    if peak_memory(graph, d, m, [mc.strategies[j][s] for j, s in enumerate(choice)], r)[0] \
            <= budget:
        return list(choice)
    S = max(len(st) for st in mc.strategies)
    inv = np.zeros((P, S, NUM_CLASSES))          # 1 / divisor per class (0: not on device)
    cost = np.full((P, S), np.inf)               # time the strategy costs the step
    kind = np.full((P, S), -1, dtype=np.int64)   # tensor-parallel kind: 0 none, 1 col, 2 row
    codes = {"none": 0, "col": 1, "row": 2}
    for j, rows in enumerate(_inverse_rows(mc.strategies, d // r, m)):
        inv[j, :len(rows)] = rows
    for j, strats in enumerate(mc.strategies):
        for s, st in enumerate(strats):
            host = 2 * mc.host[j][s]
            cost[j, s] = mc.param_time[j][s] + mc.grad_comm[j][s][0] + host
            kind[j, s] = codes[st.tp]
    choice = list(choice)
    idx = np.arange(P)
    finite = np.isfinite(cost)
    # per-point live bytes per device, kept up to date as parameters move: a move changes
    # one parameter's classes only, so the update is one [points, classes] product
    live = graph.live
    weights = memory_weights(graph, d, [mc.strategies[j][s] for j, s in enumerate(choice)], m,
                             r)
    per_point = graph.live_at(weights)
    # each peak point's move tables, and the moves made since they were last brought up to
    # date (the peak often returns to a point: only the parameters moved meanwhile have new
    # rows there)
    tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, int]] = {}
    history: list[int] = []

    def row(j: int, at_peak: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Parameter j's moves from its current strategy: bytes freed at the peak, time
        added, and which are allowed (a tensor-parallel kind is kept)."""
        c = choice[j]
        sv = (at_peak[j][None, :] * (inv[j, c][None, :] - inv[j])).sum(-1)
        return sv, cost[j] - cost[j, c], (sv > 0) & finite[j] & (
            (kind[j, c] == 0) | (kind[j] == kind[j, c]))

    for _ in range(NUM_CLASSES * P + 1):
        k = int(np.argmax(per_point))
        if per_point[k] <= budget:
            # confirm on a fresh sum (the running one carries rounding)
            strats = [mc.strategies[j][s] for j, s in enumerate(choice)]
            per_point = graph.live_at(memory_weights(graph, d, strats, m, r))
            k = int(np.argmax(per_point))
            if per_point[k] <= budget:
                break
        at_peak = live[k, 2:2 + P * NUM_CLASSES].reshape(NUM_CLASSES, P).T  # [P, classes]
        if k not in tables:
            # a new peak point: every parameter's moves afresh
            cur = np.asarray(choice)
            saved = (at_peak[:, None, :] * (inv[idx, cur][:, None, :] - inv)).sum(-1)
            added = cost - cost[idx, cur][:, None]
            cur_kind = kind[idx, cur][:, None]
            ok = (saved > 0) & finite & ((cur_kind == 0) | (kind == cur_kind))
        else:
            # a point seen before: only the parameters moved since have new moves
            saved, added, ok, seen = tables.pop(k)
            for j in dict.fromkeys(history[seen:]):
                saved[j], added[j], ok[j] = row(j, at_peak)
        tables[k] = (saved, added, ok, len(history))
        if len(tables) > KEPT_PEAKS:   # the least recently used point's tables go
            del tables[next(iter(tables))]
        if not ok.any():
            break
        free = ok & (added <= 0)
        if free.any():
            # moves that cost nothing: the one that saves the most time, then memory
            most = np.where(free, -added, -np.inf)
            rank = np.where(most >= most.max() * (1 - 1e-9), saved, -np.inf)
        else:
            rank = np.where(ok, saved / np.maximum(added, 1e-12), -np.inf)
        j, s = (int(x) for x in np.unravel_index(int(np.argmax(rank)), rank.shape))
        if kind[j, s] == kind[j, choice[j]]:
            per_point += np.cumsum(graph.param_changes(j) @ (inv[j, s] - inv[j, choice[j]]))
            choice[j] = s
        else:   # a new tensor-parallel kind also splits activations: sum afresh
            choice[j] = s
            per_point = graph.live_at(memory_weights(
                graph, d, [mc.strategies[i][c] for i, c in enumerate(choice)], m, r))
        history.append(j)
    return choice


def _inverse_rows(strategies: Sequence[Sequence[Strategy]], d: int, m: int
                  ) -> list[np.ndarray]:
    """Per parameter, [its layouts, classes] of 1 / `Strategy.divisors` (0: not on the
    device), each layout object's computed once (`layout_memory.divisor_rows`)."""
    if not strategies:
        return []
    inv = 1.0 / divisor_rows([st for strats in strategies for st in strats], d, m)
    ends = np.cumsum([len(strats) for strats in strategies])
    return np.split(inv, ends[:-1])


def _floor_curves(graph: Graph, strategies: Sequence[Sequence[Strategy]], d: int, m: int,
                 r: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`memory_floor`'s bound by class at every point, in two parts, (the rest, the
    batched values at the full batch), each parameter's inverse rows (`_inverse_rows`,
    [P, layouts, classes], a parameter with fewer layouts padded with copies of its
    first) and its smallest share by class ([P, classes], what the rest holds it at):
    the bytes are linear in the weights, so the bound with the batched values at a share
    s is `rest + s * batched`, for any number of micro-batches at once."""
    P = len(graph.params)
    invs = _inverse_rows(strategies, d // r, m)
    most = max((len(inv) for inv in invs), default=1)
    rows = np.stack([np.concatenate([inv, np.repeat(inv[:1], most - len(inv), axis=0)])
                     for inv in invs]) if invs else np.zeros((0, most, NUM_CLASSES))
    floor = rows.min(axis=1)                                            # [P, classes]
    if r == 1:   # a layer XLA moves keeps nothing whole, by the others' choices (`_floor_at`)
        floor[:, WHOLE] = 0.0
    weights = memory_weights(graph, d, [strategies[j][0] for j in range(P)], m, r)
    batched = np.zeros_like(weights)
    # batched values: 1/d, and those a tensor-parallel layout may split, 1/(d*m) at best
    batched[0] = 1.0 / d
    batched[2 + P * NUM_CLASSES:] = 1.0 / (d * m)
    weights[0] = 0.0
    weights[2 + P * NUM_CLASSES:] = 0.0
    weights[2:2 + P * NUM_CLASSES] = floor.T.reshape(-1)
    return graph.live_at(weights), graph.live_at(batched), rows, floor


def memory_floor(graph: Graph, strategies: Sequence[Sequence[Strategy]], d: int,
                  m: int, activation_share: float = 1.0, r: int = 1
                  ) -> tuple[float, list[int]]:
    """A lower bound on the peak memory any layout on this mesh can reach, and a layout
    close to it: per parameter, the one least at that bound's peak. The bound holds
    every class of every parameter at its smallest share at once (which no single
    layout may reach), tightened at its peak point to each parameter's least bytes
    there of any one of its layouts (`_floor_at`). `activation_share` scales the
    batched values (1/k: k micro-batches, estimated from the step as written). With r
    replicas (HSDP) parameters shard d/r ways."""
    rest, batched, rows, floor = _floor_curves(graph, strategies, d, m, r)
    return _floor_at(graph, rest + activation_share * batched, rows, floor, r)


def _floor_at(graph: Graph, per_point: np.ndarray, rows: np.ndarray, floor: np.ndarray,
              r: int) -> tuple[float, list[int]]:
    """The bound `per_point` (`_floor_curves`' at some share) at its peak, tightened there,
    and per parameter the layout least at that point. Each class at its smallest share
    mixes layouts: an FSDP layout's weight share with a replicated one's nothing gathered
    whole. Any one layout holds at that point at least, per parameter, the least any of
    its layouts holds there, so the bound is raised to that sum where it is higher
    (a 310 B model at 9 micro-batches on 240 x 8 devices, 15 replicas: 71 GB by
    class, 149 GB by layout, where the search's best layout needs 183 GB). Without
    replicas a layer whose activations XLA moves keeps nothing whole, by what the other
    layers chose (`collectives.moved_in`): there what is gathered whole counts as
    nothing, in both bounds (`_floor_curves`)."""
    P = len(graph.params)
    k = int(np.argmax(per_point))
    at_peak = np.asarray(graph.live[k, 2:2 + P * NUM_CLASSES], float).reshape(NUM_CLASSES, P).T
    held = np.einsum("psc,pc->ps", rows, at_peak)      # [P, layouts] at the peak
    if r == 1:   # what is gathered whole counted as nothing (`floor` holds none either)
        least = held - rows[:, :, WHOLE] * at_peak[:, WHOLE, None]
    else:
        least = held
    by_class = float(np.sum(floor * at_peak))
    by_layout = float(least.min(axis=1).sum())
    return (float(per_point[k]) + max(by_layout - by_class, 0.0),
            [int(c) for c in held.argmin(axis=1)])


def micro_batch_floor(graph: Graph, cluster: Cluster, num_devices: int, micro_batches: int,
                      offload: bool = True, allowed: LayoutRules | None = None,
                      num_devices_exact: int | None = None,
                      mesh: tuple[int, int] | None = None) -> float:
    """An estimate, from the step as written, of the least peak memory per device the
    step split into `micro_batches` could reach on any mesh: the activations held at once
    shrink with the micro-batch. The planner uses it to skip tracing counts that cannot
    fit, asking it of one graph for count after count: each mesh's bound is kept with
    the graph in `_floor_curves`' two parts, which any count then scales."""
    node = cluster.mesh_node_size
    shapes, _ = mesh_shapes(num_devices, graph.batch_size, graph, num_devices_exact,
                            micro_batches, mesh, node)
    bounds = []
    for d, m in shapes:
        if pins_hold(graph, allowed, d, m, offload) is not None:
            continue
        # as the search tries it: over the whole data axis, and hybrid-sharded where the
        # axis divides too few of the weights (`shard_replicas`)
        for r in {1, shard_replicas(graph, d, m, allowed)}:
            rest, batched, rows, floor = _mesh_floor(graph, d, m, r, offload, allowed)
            per_point = rest + batched / micro_batches
            bounds.append((float(np.max(per_point)), per_point, rows, floor, r))
    # tightened from the least by class up: a mesh whose bound by class is over the
    # least tightened one cannot be less once tightened
    best = float("inf")
    for by_class, per_point, rows, floor, r in sorted(bounds, key=lambda b: b[0]):
        if by_class >= best:
            break
        best = min(best, _floor_at(graph, per_point, rows, floor, r)[0])
    return best


def _mesh_floor(graph: Graph, d: int, m: int, r: int, offload: bool,
                allowed: LayoutRules | None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`_floor_curves` on one mesh, over the layouts the search would weigh there, kept
    with the graph (`Graph.memoized`)."""
    def build() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        strategies = [param_strategies(graph, j, d // r, m, offload, allowed)
                      for j in range(len(graph.params))]
        return _floor_curves(graph, strategies, d, m, r)
    return graph.memoized(("mesh floor", d, m, r, offload, allowed), build)


__all__ = ["memory_floor", "micro_batch_floor", "repair"]
