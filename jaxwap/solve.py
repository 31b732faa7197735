"""The search: every mesh, the best strategy per parameter on each, then the objective.

Per mesh the layer weights form a chain (forward order), and the communication a
tensor-parallel layer costs depends only on its neighbour's choice (column-then-row
pairs need no gather in between), so a dynamic program along the chain finds the
per-parameter strategies that minimise modelled step time. Gradient reduction overlaps
backward compute, which makes its cost non-additive; the DP is run with the reduction
weighted 1, 1/2 and 0 and each result is priced exactly. Non-layer parameters (biases,
norms, embeddings) choose independently.

A candidate over the memory budget is repaired before it is declared not to fit: one
parameter at a time, the move that frees the most memory at the peak per second it adds
(so the cheapest first: optimizer state sharded over the data axis (ZeRO-1) costs almost
nothing, the weight and gradient too (FSDP) costs gathers, optimizer state in host memory
costs PCIe transfers). What a step cannot free this way (activations) is left to the
planner's step variants: rematerialization and micro-batches.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .comm import tp_final_cost, tp_pair_cost
from .cost import MeshCosts, memory_weights, mesh_costs, peak_memory, predict
from .graph import NUM_CLASSES, Graph
from .hardware import Cluster
from .objective import Objective
from .records import Prediction, Strategy

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


def param_strategies(graph: Graph, j: int, d: int, m: int, offload: bool = True,
                     allowed: frozenset[str] | None = None,
                     layers: Mapping[int, Any] | None = None) -> tuple[Strategy, ...]:
    """Replicate; column / row over model; each also with its optimizer state sharded over
    data (ZeRO-1) or everything sharded over data (FSDP); and, for a parameter with
    optimizer state, each of those with the state kept in host memory. `allowed` keeps
    only the layouts whose families it holds (see `restrict`). `layers` maps parameter
    index to its layer, when the caller has it at hand."""
    layer = layers.get(j) if layers is not None else \
        next((L for L in graph.layers if L.param == j), None)
    dims = None if layer is None else (tuple(layer.out_dims), tuple(layer.in_dims))
    return _strategies_for(tuple(graph.params[j].shape), dims,
                           bool(graph.resident_bytes[j] > 0), d, m, offload, allowed,
                           int(graph.stacked_dim[j]))


@functools.lru_cache(maxsize=4096)
def _strategies_for(shape: tuple[int, ...], layer_dims: tuple[tuple[int, ...], ...] | None,
                    has_state: bool, d: int, m: int, offload: bool,
                    allowed: frozenset[str] | None, stacked: int = -1
                    ) -> tuple[Strategy, ...]:
    """`param_strategies` for a parameter of this shape (the blocks of a deep model share
    a few shapes, so each is worked out once). The dim a scan iterates over (`stacked`)
    is never split: each iteration slices one layer out of it, and a split stack would be
    gathered whole."""
    nd = len(shape)
    all_dims = [i for i in range(nd) if i != stacked]
    bases: list[tuple[str, str, int | None]] = [("replicate", "none", None)]
    if m > 1 and layer_dims is not None:
        for kind, dims in (("col", layer_dims[0]), ("row", layer_dims[1])):
            tdim = _largest_dim(shape, [i for i in dims if i != stacked], m)
            if tdim is not None:
                bases.append((f"tp-{kind}", kind, tdim))
    out = []
    for name, tp, tdim in bases:
        spec = _spec(nd, model=tdim)
        out.append(Strategy(name, spec, tp=tp))
        f = _largest_dim(shape, all_dims, d, exclude=tdim) if d > 1 else None
        if f is None:
            continue
        sharded = _spec(nd, model=tdim, data=f)
        prefix = "" if tp == "none" else name + "+"
        if has_state:
            out.append(Strategy(prefix + "zero1", spec, tp=tp, state_spec=sharded))
        out.append(Strategy(prefix + "fsdp", sharded, tp=tp, data_sharded=True))
    if has_state and offload:
        out += [dataclasses.replace(s, name=s.name + "+offload", offload=True) for s in out]
    return restrict(out, allowed)


def restrict(options: Sequence[Strategy], allowed: frozenset[str] | None
             ) -> tuple[Strategy, ...]:
    """The layouts every family of which is allowed; replicated when none is (a parameter
    no axis divides cannot take the split asked for). `options[0]` is the replicated one."""
    if allowed is None:
        return tuple(options)
    return tuple(s for s in options if s.families <= allowed) or (options[0],)


@dataclass(frozen=True)
class _Flat:
    """A mesh's per-(parameter, strategy) costs as flat arrays, built once per mesh for
    the dynamic program's several weightings: `J` the parameter, `S` the strategy's index
    within it, `kind` its tensor-parallel kind's rank of first appearance within the
    parameter's strategies (0, 1, 2: the order the DP visits kinds in), and the parts of
    its own cost."""

    J: np.ndarray
    S: np.ndarray
    kind: np.ndarray
    kind_name: tuple[str, ...]
    time: np.ndarray
    grad: np.ndarray
    host: np.ndarray


def _flat(mc: MeshCosts) -> _Flat:
    sizes = [len(st) for st in mc.strategies]
    J = np.repeat(np.arange(len(sizes)), sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    names: list[str] = []
    kind = []
    for strats in mc.strategies:
        seen: dict[str, int] = {}
        for st in strats:
            seen.setdefault(st.tp, len(seen))
            kind.append(seen[st.tp])
        names.append(",".join(seen))
    return _Flat(J, np.arange(len(J)) - starts[J], np.asarray(kind, np.int64), tuple(names),
                 np.concatenate([np.asarray(x, np.float64) for x in mc.param_time]),
                 np.concatenate([np.asarray([g[0] for g in row], np.float64)
                                 for row in mc.grad_comm]),
                 np.concatenate([np.asarray(x, np.float64) for x in mc.host]))


def _dp(graph: Graph, cluster: Cluster, mc: MeshCosts, weight: float,
        flat: _Flat | None = None) -> list[int]:
    """Strategy indices minimising compute + weight*grad comm + TP chain communication.

    The chain's communication depends on the layers' kinds only (col, row, none), so per
    layer and kind the cheapest strategy of that kind is taken first (the first of equals),
    and the dynamic program runs over kinds: a few transitions per layer, however many
    strategies."""
    f = flat or _flat(mc)
    d, m = mc.d, mc.m
    own = f.time + weight * f.grad + 2 * f.host
    # per (parameter, kind): its cheapest strategy, the first of equals
    order = np.lexsort((f.S, own, f.kind, f.J))
    first = np.ones(len(order), bool)
    first[1:] = (f.J[order][1:] != f.J[order][:-1]) | (f.kind[order][1:] != f.kind[order][:-1])
    pick = order[first]
    per_param: dict[int, list[tuple[int, int, float]]] = {}
    for i in pick.tolist():
        per_param.setdefault(int(f.J[i]), []).append((int(f.kind[i]), int(f.S[i]),
                                                      float(own[i])))
    choice = [min(v, key=lambda t: (t[2], t[1]))[1] for _, v in sorted(per_param.items())]
    if not graph.layers:
        return choice
    # the pair cost of a layer depends on its activation sizes and the two kinds: the
    # blocks of a deep model repeat a few of those, so each is priced once
    pair_of: dict[tuple[float, float, bool, str, str, float], float] = {}

    def pair(L: Any, prev: str, kind: str) -> float:
        rep = float(graph.repeat[L.op_index])
        key = (L.act_in_bytes, L.act_out_bytes, bool(L.needs_input_grad), prev, kind, rep)
        if key not in pair_of:
            pair_of[key] = tp_pair_cost(L, prev, kind, d, m, cluster, rep)[0]
        return pair_of[key]

    # states: kind of the previous layer -> its cost so far, in the order kinds appear
    states: dict[str, float] = {"none": 0.0}
    back: list[dict[str, tuple[str, int]]] = []   # per layer: kind -> (prev kind, strategy)
    for L in graph.layers:
        names = f.kind_name[L.param].split(",")
        nxt: dict[str, float] = {}
        ptr: dict[str, tuple[str, int]] = {}
        for ki, s, o in per_param[L.param]:      # in kind order: `pick` is sorted so
            k = names[ki]
            for prev, c in states.items():
                cost = c + o + pair(L, prev, k)
                if k not in nxt or cost < nxt[k]:
                    nxt[k], ptr[k] = cost, (prev, s)
        states = nxt
        back.append(ptr)
    last = graph.layers[-1]
    rep = float(graph.repeat[last.op_index])
    k = min(states, key=lambda k: states[k] + tp_final_cost(last, k, d, m, cluster, rep)[0])
    for L, ptr in zip(reversed(graph.layers), reversed(back), strict=True):
        k, s = ptr[k]
        choice[L.param] = s
    return choice


def _repair(graph: Graph, cluster: Cluster, mc: MeshCosts, choice: list[int],
            budget: float) -> list[int]:
    """Move parameters to variants that free memory at the peak until the candidate fits
    (or no move frees anything): each time the move with the most bytes freed per second
    of step time added. A tensor-parallel parameter keeps its kind (its neighbours' costs
    depend on it); a replicated one may become tensor-parallel."""
    d, m = mc.d, mc.m
    P = len(choice)
    if peak_memory(graph, d, m, [mc.strategies[j][s] for j, s in enumerate(choice)])[0] \
            <= budget:
        return list(choice)
    S = max(len(st) for st in mc.strategies)
    inv = np.zeros((P, S, NUM_CLASSES))          # 1 / divisor per class (0: not on device)
    cost = np.full((P, S), np.inf)               # time the strategy costs the step
    kind = np.full((P, S), -1, dtype=np.int64)   # tensor-parallel kind: 0 none, 1 col, 2 row
    codes = {"none": 0, "col": 1, "row": 2}
    for j, strats in enumerate(mc.strategies):
        for s, st in enumerate(strats):
            inv[j, s] = 1.0 / np.asarray(st.divisors(d, m))
            host = 2 * mc.host[j][s]
            cost[j, s] = mc.param_time[j][s] + mc.grad_comm[j][s][0] + host
            kind[j, s] = codes[st.tp]
    choice = list(choice)
    idx = np.arange(P)
    finite = np.isfinite(cost)
    # per-point live bytes per device, kept up to date as parameters move: a move changes
    # one parameter's classes only, so the update is one [points, classes] product
    live = graph.live
    weights = memory_weights(graph, d, [mc.strategies[j][s] for j, s in enumerate(choice)], m)
    per_point = live @ weights
    cols = 2 + np.arange(NUM_CLASSES)[None, :] * P + idx[:, None]      # [P, classes]
    at_k = -1          # the peak point the move tables below were made for
    saved = added = ok = np.empty(0)
    moved = -1

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
            per_point = live @ memory_weights(graph, d, strats, m)
            k = int(np.argmax(per_point))
            if per_point[k] <= budget:
                break
        at_peak = live[k, 2:2 + P * NUM_CLASSES].reshape(NUM_CLASSES, P).T  # [P, classes]
        if k != at_k:
            # a new peak point: every parameter's moves afresh
            cur = np.asarray(choice)
            saved = (at_peak[:, None, :] * (inv[idx, cur][:, None, :] - inv)).sum(-1)
            added = cost - cost[idx, cur][:, None]
            cur_kind = kind[idx, cur][:, None]
            ok = (saved > 0) & finite & ((cur_kind == 0) | (kind == cur_kind))
            at_k = k
        elif moved >= 0:
            # the same peak: only the parameter just moved has new moves
            saved[moved], added[moved], ok[moved] = row(moved, at_peak)
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
            per_point += live[:, cols[j]] @ (inv[j, s] - inv[j, choice[j]])
            choice[j] = s
        else:   # a new tensor-parallel kind also splits activations: sum afresh
            choice[j] = s
            per_point = live @ memory_weights(
                graph, d, [mc.strategies[i][c] for i, c in enumerate(choice)], m)
        moved = j
    return choice


def _memory_floor(graph: Graph, strategies: Sequence[Sequence[Strategy]], d: int,
                  m: int, activation_share: float = 1.0) -> tuple[float, list[int]]:
    """A lower bound on the peak memory any layout on this mesh can reach (every class
    of every parameter at its smallest share at once, which no single layout may reach),
    and a layout close to it: per parameter, the one least at that bound's peak.
    `activation_share` scales the batched values (1/k: k micro-batches, estimated from
    the step as written)."""
    P = len(graph.params)
    inv_of: dict[int, np.ndarray] = {}      # by identity: the strategies are shared objects
    for strats in strategies:
        for st in strats:
            if id(st) not in inv_of:
                inv_of[id(st)] = 1.0 / np.asarray(st.divisors(d, m))
    invs = [np.array([inv_of[id(st)] for st in strats]) for strats in strategies]
    floor = np.stack([inv.min(axis=0) for inv in invs])                 # [P, classes]
    weights = memory_weights(graph, d, [strategies[j][0] for j in range(P)], m)
    # batched values: 1/d, and those a tensor-parallel layout may split, 1/(d*m) at best
    weights[0] = activation_share / d
    weights[2 + P * NUM_CLASSES:] = activation_share / (d * m)
    weights[2:2 + P * NUM_CLASSES] = floor.T.reshape(-1)
    per_point = graph.live @ weights
    k = int(np.argmax(per_point))
    at_peak = graph.live[k, 2:2 + P * NUM_CLASSES].reshape(NUM_CLASSES, P).T
    choice = [int(np.argmin(inv @ at_peak[j])) for j, inv in enumerate(invs)]
    return float(per_point[k]), choice


def micro_batch_floor(graph: Graph, cluster: Cluster, num_devices: int, micro_batches: int,
                      offload: bool = True, allowed: frozenset[str] | None = None,
                      num_devices_exact: int | None = None,
                      mesh: tuple[int, int] | None = None) -> float:
    """An estimate, from the step as written, of the least peak memory per device the
    step split into `micro_batches` could reach on any mesh: the activations held at once
    shrink with the micro-batch. The planner uses it to skip tracing counts that cannot
    fit."""
    node = cluster.node_size if cluster.num_nodes > 1 else None
    shapes, _ = mesh_shapes(num_devices, graph.batch_size, graph, num_devices_exact,
                            micro_batches, mesh, node)
    layers = {L.param: L for L in graph.layers}
    best = float("inf")
    for d, m in shapes:
        strategies = [param_strategies(graph, j, d, m, offload, allowed, layers)
                      for j in range(len(graph.params))]
        best = min(best, _memory_floor(graph, strategies, d, m, 1.0 / micro_batches)[0])
    return best


def solve_mesh(graph: Graph, cluster: Cluster, d: int, m: int, budget: float,
               offload: bool = True, allowed: frozenset[str] | None = None) -> MeshResult:
    layers = {L.param: L for L in graph.layers}
    strategies = [param_strategies(graph, j, d, m, offload, allowed, layers)
                  for j in range(len(graph.params))]
    floor, low = _memory_floor(graph, strategies, d, m)
    if floor > budget:
        # no layout fits: skip the search and the repairs, report the least memory (and
        # price only that layout)
        picked = [(strategies[j][s],) for j, s in enumerate(low)]
        mc = mesh_costs(graph, cluster, d, m, picked)
        return MeshResult(d, m, tuple(p[0] for p in picked),
                          predict(graph, cluster, mc, [0] * len(picked)), False)
    mc = mesh_costs(graph, cluster, d, m, strategies)
    tried: dict[tuple[int, ...], Prediction] = {}
    flat = _flat(mc)
    repaired: dict[tuple[int, ...], list[int]] = {}   # the weightings often agree
    for w in _OVERLAP_WEIGHTS:
        choice = _dp(graph, cluster, mc, w, flat)
        if tuple(choice) not in repaired:
            repaired[tuple(choice)] = _repair(graph, cluster, mc, choice, budget)
        for c in (choice, repaired[tuple(choice)]):
            key = tuple(c)
            if key not in tried:
                tried[key] = predict(graph, cluster, mc, c)
    fitting = {k: p for k, p in tried.items() if p.peak_memory_bytes <= budget}
    pool = fitting or tried
    key = min(pool, key=lambda k: (pool[k].step_time_s if fitting
                                   else pool[k].peak_memory_bytes))
    return MeshResult(d, m, tuple(mc.strategies[j][s] for j, s in enumerate(key)),
                      tried[key], bool(fitting))


# Clusters up to this many devices try every device count; larger ones powers of two
# (and the whole cluster), which is where the meshes that can win are (see device_counts).
EXHAUSTIVE_DEVICES = 64


def device_counts(num_devices: int, node_size: int | None = None) -> list[int]:
    """The device counts worth a mesh: every count up to `EXHAUSTIVE_DEVICES`; beyond,
    powers of two and the whole cluster (a count between two powers of two splits a
    power-of-two batch and model unevenly, and costs more than either neighbour in energy
    or time). With nodes (`node_size` devices each), a mesh larger than a node takes whole
    nodes: part of a node left idle is neither faster nor cheaper than the node's own
    counts."""
    n_max = num_devices
    if n_max <= EXHAUSTIVE_DEVICES:
        counts = set(range(1, n_max + 1))
    else:
        counts = {1 << k for k in range(n_max.bit_length()) if 1 << k <= n_max} | {n_max}
    if node_size is not None and node_size < n_max:
        counts = {n for n in counts if n <= node_size or n % node_size == 0}
        counts |= {node_size * (1 << k) for k in range(n_max.bit_length())
                   if node_size * (1 << k) <= n_max}
    return sorted(counts)


def mesh_shapes(num_devices: int, batch_size: int | None, graph: Graph,
                num_devices_exact: int | None = None, micro_batches: int = 1,
                mesh: tuple[int, int] | None = None, node_size: int | None = None
                ) -> tuple[list[tuple[int, int]], list[str]]:
    """Every (data, model) factorisation of n <= num_devices devices worth trying (with
    micro-batches, each micro-batch must split evenly over the data axis); only `mesh`
    when the caller fixes it. With nodes of `node_size` devices, the model axis stays
    inside a node (its size divides the node's), so tensor parallelism never crosses the
    network; the data axis spans the nodes."""
    shapes, skipped = [], []
    ns = [num_devices_exact] if num_devices_exact else device_counts(num_devices, node_size)
    if mesh is not None:
        ns = [mesh[0] * mesh[1]]
    for n in ns:
        for d in range(1, n + 1):
            if n % d or (mesh is not None and d != mesh[0]):
                continue
            m = n // d
            if node_size is not None and (m > node_size or node_size % m):
                skipped.append(f"{d}x{m}: the model axis of {m} would cross nodes of "
                               f"{node_size} devices")
                continue
            if batch_size is None and d > 1:
                skipped.append(f"{d}x{m}: the step has no batch dimension to split")
                continue
            if batch_size is not None and batch_size % (d * micro_batches):
                what = f"batch {batch_size}" if micro_batches == 1 else \
                    f"micro-batch {batch_size // micro_batches}"
                skipped.append(f"{d}x{m}: {what} is not divisible by data={d}")
                continue
            if m > 1 and not any(
                    any(graph.params[L.param].shape[i] % m == 0 for i in L.in_dims + L.out_dims)
                    for L in graph.layers):
                skipped.append(f"{d}x{m}: no layer weight has a dim divisible by model={m}")
                continue
            shapes.append((d, m))
    return shapes, skipped


def search(graph: Graph, cluster: Cluster, objective: Objective, num_devices: int,
           budget: float, num_devices_exact: int | None = None,
           micro_batches: int = 1, offload: bool = True, mesh: tuple[int, int] | None = None,
           allowed: frozenset[str] | None = None) -> SearchResult:
    """Every mesh worth trying (or only `mesh`), each with its best layout of the `allowed`
    strategy families, ranked by the objective."""
    node = cluster.node_size if cluster.num_nodes > 1 else None
    shapes, skipped = mesh_shapes(num_devices, graph.batch_size, graph, num_devices_exact,
                                  micro_batches, mesh, node)
    if not shapes:
        if mesh is not None:
            raise ValueError(f"mesh_shape {mesh[0]}x{mesh[1]} cannot be used: "
                             f"{'; '.join(s.split(': ', 1)[1] for s in skipped)}")
        raise ValueError(_no_mesh_message(graph, num_devices, num_devices_exact, skipped))
    results = _solve_meshes(graph, cluster, objective, shapes, budget, offload, allowed,
                            skipped, prune=num_devices > EXHAUSTIVE_DEVICES)
    if allowed is not None and "replicate" not in allowed:
        # a forced split must happen: a mesh where it cannot is no candidate
        kept = [r for r in results if any(s.families <= allowed for s in r.strategies)]
        skipped += [f"{r.d}x{r.m}: no parameter can take the strategies "
                    f"{', '.join(sorted(allowed))} on it" for r in results if r not in kept]
        if not kept:
            raise ValueError(f"no mesh lets any parameter use the strategies "
                             f"{', '.join(sorted(allowed))} ({'; '.join(skipped[-6:])})")
        results = kept
    rank = functools.partial(objective.rank, max_watts=cluster.device.max_watts,
                             num_devices_available=cluster.num_devices)
    # Plain data parallelism (every parameter replicated) is what a user would write by
    # hand; its best mesh is kept as a candidate of its own so verification can always
    # weigh the plan against it on XLA's figures (unless the strategies forbid it).
    replicate_ok = allowed is None or "replicate" in allowed
    dp = [data_parallel(graph, cluster, d, budget) for d, m in shapes
          if m == 1 and replicate_ok]
    dp = [r for r in dp if r.fits]
    baseline = -1
    if dp:
        b = dp[rank([r.predicted for r in dp]).best]
        same = next((i for i, r in enumerate(results)
                     if (r.d, r.m) == (b.d, 1) and r.strategies == b.strategies), None)
        if same is None:
            results.append(b)
            baseline = len(results) - 1
        else:
            baseline = same
    if not any(r.fits for r in results):
        best = min(range(len(results)), key=lambda i: results[i].predicted.peak_memory_bytes)
        return SearchResult(tuple(results), (float("inf"),) * len(results), best,
                            tuple(skipped), baseline)
    # the objective ranks fitting candidates only; within max_slowdown the "fastest"
    # is the fastest that fits
    ranking = rank([r.predicted if r.fits and uses_model_axis(r) else None for r in results])
    if ranking.best < 0:
        shown = ", ".join(f"{r.d}x{r.m}" for r in results)
        if mesh is not None:
            raise ValueError(
                f"mesh_shape {mesh[0]}x{mesh[1]}: no parameter gains from being split over "
                f"its model axis of {mesh[1]}, so its devices would only duplicate work. "
                f"Force tensor parallelism with strategies=('tp', ...) or use a model axis "
                f"of 1.")
        raise ValueError(
            f"every usable mesh ({shown}) needs a model axis (batch "
            f"{graph.batch_size} cannot be split {num_devices_exact or num_devices} ways "
            f"over data), but no parameter gains from being split over it: the devices "
            f"would only duplicate work. Use fewer devices (num_devices=) or a batch "
            f"size divisible by the device count.")
    return SearchResult(tuple(results), ranking.scores, ranking.best, tuple(skipped), baseline)


@dataclass(frozen=True)
class _Bound:
    """The best figures a mesh could reach, for the objective's score: all its flops at
    the device's peak rate, perfectly split, and every device drawing at least idle power
    for that long."""

    step_time_s: float
    energy_per_step_j: float
    num_devices: int


def _solve_meshes(graph: Graph, cluster: Cluster, objective: Objective,
                  shapes: Sequence[tuple[int, int]], budget: float, offload: bool,
                  allowed: frozenset[str] | None, skipped: list[str], prune: bool
                  ) -> list[MeshResult]:
    """`solve_mesh` on every shape, in the shapes' order. With `prune` (a large cluster),
    branch and bound: meshes are solved from the most promising bound, and one whose best
    possible score cannot beat a fitting candidate already found is skipped (and said so
    in `skipped`). Those are meshes that cannot win, so only the candidate list (and the
    frontier drawn from it) is shorter."""
    if not prune or objective.kind not in ("throughput", "energy", "balanced"):
        return [solve_mesh(graph, cluster, d, m, budget, offload, allowed) for d, m in shapes]
    dev = cluster.device
    bounds = []
    for d, m in shapes:
        n, speed = d * m, cluster.speedup_when_using(d * m)
        t = graph.total_flops / (n * dev.peak_flops * speed)
        bounds.append(_Bound(t, n * dev.idle_watts * speed * t, n))
    kw = {"max_watts": dev.max_watts, "num_devices_available": cluster.num_devices}
    lower = objective.scores(bounds, **kw)
    solved: dict[int, MeshResult] = {}
    best = float("inf")
    for i in sorted(range(len(shapes)), key=lambda i: lower[i]):
        d, m = shapes[i]
        if lower[i] > best:
            skipped.append(f"{d}x{m}: cannot beat the best found (its flops at peak on "
                           f"{d * m} devices already score {lower[i] / best:.2f}x)")
            continue
        r = solve_mesh(graph, cluster, d, m, budget, offload, allowed)
        solved[i] = r
        if r.fits and uses_model_axis(r) and (
                allowed is None or "replicate" in allowed
                or any(s.families <= allowed for s in r.strategies)):
            best = min(best, objective.scores([r.predicted], **kw)[0])
    return [solved[i] for i in sorted(solved)]


def data_parallel(graph: Graph, cluster: Cluster, d: int, budget: float) -> MeshResult:
    """Every parameter replicated over a (d, 1) mesh, the batch split d ways."""
    layers = {L.param: L for L in graph.layers}
    strategies = [param_strategies(graph, j, d, 1, layers=layers)[:1]
                  for j in range(len(graph.params))]
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


__all__ = ["MeshResult", "SearchResult", "data_parallel", "micro_batch_floor",
           "param_strategies", "search",
           "uses_model_axis"]
