"""One mesh's costs, per parameter and per strategy, for the search to add up.

A candidate is a mesh (data x model) and a sharding strategy per parameter. `mesh_costs`
prices, once per mesh, the ops no strategy changes and, for each parameter under each of
its strategies, its ops and its communication (`MeshCosts`), so the search weighs a
layout by adding table entries instead of pricing it whole:

- compute: every op runs on its share of the work (batched ops over the data axis, a
  tensor-parallel weight's matmuls also over the model axis, a parameter's own ops
  such as the optimizer update over however the parameter is sharded); each op costs
  its kernel launches plus a roofline `max(flops / (peak * eff), bytes / bandwidth)`,
  where matmul efficiency (the calibrated curve `DeviceSpec.matmul_efficiency`, else
  `w / (w + w_half)`) falls as the per-device work `w` shrinks.
  That fall, with the fixed launch cost, is what makes a small workload slower on
  many devices. Layout changes XLA inserts are priced beside it.
- communication: each parameter's gradient reduction over the data axis as ring
  collectives (`cost/param_comm.py`): gathered, or with FSDP's activations moved.
- host transfers: an offloaded optimizer state's, one way.

A choice of one strategy per parameter is priced whole, with what does not add up per
parameter, by `cost/mesh_prediction.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxwap.analysis.graph import GRAD, OPT, Graph
from jaxwap.analysis.tp_activations import TP_KINDS
from jaxwap.core.records import DATA, Strategy
from jaxwap.cost.collectives import fsdp_moves
from jaxwap.cost.op_time import op_parts, relayout_times
from jaxwap.cost.param_comm import param_comm_costs
from jaxwap.hardware.cluster import Cluster
from jaxwap.hardware.device import DeviceSpec


def op_model_split(graph: Graph, strategies: Sequence[Strategy], m: int) -> np.ndarray:
    """[ops]: m where the chosen layouts split the op over the model axis (a
    tensor-parallel weight's matmuls, and the ops between a column- and a row-parallel
    layer, as `mesh_costs` splits them), 1 elsewhere."""
    kinds = np.array([s.tp for s in strategies] + ["none"])    # index -1: no parameter
    names = np.array([*TP_KINDS, ""])
    split = graph.batched & (((graph.tp_param >= 0) & (kinds[graph.tp_param] != "none"))
                             | ((graph.tp_param < 0)
                                & (kinds[graph.tp_op_param] == names[graph.tp_op_kind])))
    return np.where(split, float(m), 1.0)


@dataclass(frozen=True)
class MeshCosts:
    """What one mesh's costs decompose into, so the solver can add them per parameter.

    `base` is the time of ops no parameter's strategy changes; `param_time[j][s]` the
    time of param j's ops under its strategy s (`*_busy`: their roofline part, `*_flops`:
    their flops per device, split exactly as their time is; `*_batched`: the part of the
    time spent in batched ops, which hides gradient reduction; `*_bound`: the busy time
    of their compute-bound ops, `*_work` that work at the full rate, `op_parts`);
    `grad_comm[j][s]` the (seconds, bytes) of its gradient reduction over the data axis;
    `host[j][s]` the seconds to move its offloaded optimizer state one way between host
    and device (0 when not offloaded).
    """

    d: int
    m: int
    base: float
    base_busy: float
    base_flops: float
    base_batched: float
    strategies: tuple[tuple[Strategy, ...], ...]
    param_time: tuple[tuple[float, ...], ...]
    param_busy: tuple[tuple[float, ...], ...]
    param_flops: tuple[tuple[float, ...], ...]
    param_batched: tuple[tuple[float, ...], ...]
    grad_comm: tuple[tuple[tuple[float, float], ...], ...]
    host: tuple[tuple[float, ...], ...]
    r: int = 1   # replicas: the data axis's part across nodes (HSDP), 1 for none
    base_bound: float = 0.0
    base_work: float = 0.0
    param_bound: tuple[tuple[float, ...], ...] = ()
    param_work: tuple[tuple[float, ...], ...] = ()
    riders: tuple[tuple[int, int], ...] = ()
    param_relayout: tuple[tuple[float, ...], ...] = ()   # of param_time: layout changes
    # `grad_comm` and `riders` are the search's estimate: a layer's FSDP layout moves
    # activations where it would were every layer FSDP. A layout's own price
    # (`mesh_prediction.grad_comms`) takes each layer's as its chosen neighbours make it:
    # gathered, or moved (None: it cannot move)
    gathered_comm: tuple[tuple[tuple[float, float], ...], ...] = ()
    moved_comm: tuple[tuple[tuple[float, float] | None, ...], ...] = ()
    base_relayout: float = 0.0   # of `base`: layout changes


def mesh_costs(graph: Graph, cluster: Cluster, d: int, m: int,
               strategies: Sequence[Sequence[Strategy]], r: int = 1) -> MeshCosts:
    """Decompose the step's compute and gradient communication on a (d, m) mesh.

    Each op's work is divided by one split: a batched op over the data axis (a
    tensor-parallel weight's matmuls also over the model axis, and so are the ops between
    a column- and a row-parallel layer when the parameter that splits them
    (`Graph.tp_op_param`) takes that kind of layout); a parameter's own op over
    however the parameter is sharded, its optimizer work (and the gradient
    post-processing feeding it, such as Adam's g*g) over however its optimizer state is
    sharded; anything else not at all. Time, busy time and flops per device all follow
    these same splits. With r replicas (HSDP) what is sharded over data is sharded over
    the d/r devices of the data axis inside a node, and reduced across the replicas.
    Memory-bound work is priced as the mesh's devices see it running together
    (`Cluster.co_running`: processes of one host sharing its memory).
    """
    cluster = cluster.co_running(d * m)
    dev = cluster.device
    ds = d // r   # how many ways the data axis shards parameters
    speed = cluster.speedup_when_using(d * m)
    figures = _SplitFigures(graph, cluster, d, speed)
    base, base_busy, base_flops, base_bound, base_work, base_relayout, base_batched = (
        _base_costs(graph, figures, d))
    # every (parameter, strategy) pair at once: the splits its groups of ops take
    pairs = [(j, st) for j, strats in enumerate(strategies) for st in strats]
    split_of, J, splits = _pair_splits(pairs, d, m, ds)
    vals = _compute_costs(figures, J, splits)
    _add_layout_changes(graph, dev, d, pairs, J, splits, speed, vals)
    # where XLA would move activations rather than gather weights, were every layer FSDP
    # (the search's estimate; `mesh_prediction.grad_comms` prices each layout as its
    # layers make it)
    fsdp_dim = {j: st.spec.index(DATA) for j, strats in enumerate(strategies)
                for st in strats if st.name == "fsdp" and DATA in st.spec}
    moves = fsdp_moves(graph.layers, fsdp_dim)
    if dev.small_input_conv_rates and (graph.conv == 2).any():
        _feature_split_convs(graph, cluster, pairs, splits[:, 0], vals, d, m, moves, speed)
    g_comm, gathered, moved_c = param_comm_costs(graph, cluster, strategies, d, m, r, moves)
    host = _host_transfers(graph, dev, strategies, split_of)
    riders = tuple((L.bias, L.param) for L in graph.layers
                   if L.bias >= 0 and L.param in moves and r == 1)
    starts = np.cumsum([0] + [len(st) for st in strategies])

    def table(k: int) -> tuple[tuple[float, ...], ...]:
        col = vals[:, k].tolist()
        return tuple(tuple(col[starts[j]:starts[j + 1]]) for j in range(len(strategies)))

    return MeshCosts(d, m, base, base_busy, base_flops, base_batched,
                     tuple(tuple(s) for s in strategies), table(0), table(1), table(2),
                     table(5), g_comm, host, r, base_bound, base_work,
                     table(3), table(4), riders, table(6), gathered, moved_c,
                     base_relayout)


class _SplitFigures:
    """Per-op figures with the work divided some number of ways, and their per-parameter
    sums by group of ops, each computed once per split: a mesh's strategies share few
    splits, and this runs for every mesh of every planning (one bincount per split, not
    per strategy)."""

    def __init__(self, graph: Graph, cluster: Cluster, d: int, speed: float) -> None:
        self.graph, self.cluster, self.d, self.speed = graph, cluster, d, speed
        self.per_split: dict[int, tuple[np.ndarray, ...]] = {}
        self.sums: dict[tuple[str, int], np.ndarray] = {}
        batched, owner, tp = graph.batched, graph.owner, graph.tp_param
        opt_op = np.isin(graph.op_class, (GRAD, OPT))
        # per-parameter sums at each split, by group: its tensor-parallel matmuls, its own
        # weight/gradient ops, its optimizer ops, and per kind the ops between a column-
        # and a row-parallel layer
        self.groups = {"tp": (batched & (tp >= 0), tp),
                       "w": (~batched & (owner >= 0) & ~opt_op, owner),
                       "s": (~batched & (owner >= 0) & opt_op, owner)}
        for k, name in enumerate(TP_KINDS):
            self.groups[name] = (batched & (tp < 0) & (graph.tp_op_kind == k),
                                 graph.tp_op_param)

    def at(self, split: int) -> tuple[np.ndarray, ...]:
        """Per-op (seconds, busy seconds, flops, compute-bound seconds, their work, of the
        seconds layout changes) with the work divided `split` ways."""
        if split not in self.per_split:
            graph, cluster, speed = self.graph, self.cluster, self.speed
            # every batched op's split includes the data axis; the rest move no fixed bytes
            t, bound, work = op_parts(graph, cluster, float(split), speed, data=float(self.d))
            self.per_split[split] = (t, t - graph.kernels * cluster.device.kernel_overhead_s,
                                     graph.flops / split, bound, work,
                                     relayout_times(graph, cluster, float(split), speed))
        return self.per_split[split]

    def summed(self, group: str, split: int) -> np.ndarray:
        """[6, P]: per parameter, the group's `at` sums at this split."""
        if (group, split) not in self.sums:
            mask, who = self.groups[group]
            P = len(self.graph.params)
            self.sums[group, split] = np.stack([np.bincount(who[mask], x[mask], minlength=P)
                                                for x in self.at(split)])
        return self.sums[group, split]


def _base_costs(graph: Graph, figures: _SplitFigures, d: int) -> tuple[float, ...]:
    """The ops no parameter's strategy changes (batched ones tied to no parameter's
    tensor parallelism, split over the data axis; the rest, owned by no parameter, whole):
    their (seconds, busy, flops, bound, work, of the seconds layout changes, batched
    seconds)."""
    batched, tp, tp_op = graph.batched, graph.tp_param, graph.tp_op_param
    fixed_b = batched & (tp < 0) & (tp_op < 0)
    fixed_o = ~batched & (graph.owner < 0)
    at_d, at_1 = figures.at(d), figures.at(1)
    sums = tuple(float(x_d[fixed_b].sum() + x_1[fixed_o].sum())
                 for x_d, x_1 in zip(at_d, at_1, strict=True))
    return (*sums, float(at_d[0][fixed_b].sum()))


def _pair_splits(pairs: Sequence[tuple[int, Strategy]], d: int, m: int, ds: int
                 ) -> tuple[dict[int, tuple[int, int, int]], np.ndarray, np.ndarray]:
    """Per (parameter, strategy) pair, the ways each group of its ops is split: the split
    of each strategy (by identity: shared objects) over its tensor-parallel matmuls, its
    own ops and its optimizer ops; the pairs' parameters `J`; and `splits` [pairs, 3 +
    kinds], the first three those splits, then per tensor-parallel kind the split of the
    ops between a column- and a row-parallel layer (d*m under that kind, d under another).
    """
    split_of: dict[int, tuple[int, int, int]] = {}   # by identity: shared objects
    for _, st in pairs:
        if id(st) not in split_of:
            split_of[id(st)] = (d * m if st.tp != "none" else d, st.shard(ds, m),
                                st.state_shard(ds, m))
    J = np.fromiter((j for j, _ in pairs), np.int64, len(pairs))
    splits = np.array([split_of[id(st)] for _, st in pairs], np.int64).reshape(len(pairs), 3)
    # the ops a layout of one kind splits: over d*m under that kind, over d under another
    splits = np.concatenate([splits, np.array(
        [[d * m if st.tp == name else d for name in TP_KINDS] for _, st in pairs],
        np.int64).reshape(len(pairs), len(TP_KINDS))], axis=1)
    return split_of, J, splits


def _compute_costs(figures: _SplitFigures, J: np.ndarray, splits: np.ndarray) -> np.ndarray:
    """[pairs, 7]: per (parameter, strategy) pair, the seconds, busy, flops, bound, work,
    batched seconds, and of the seconds the layout changes, of the ops its strategy
    splits, each group of ops at its split (`_pair_splits`)."""
    vals = np.zeros((len(J), 7))
    for g, group in enumerate(("tp", "w", "s", *TP_KINDS)):
        col = splits[:, g]
        for split in np.unique(col):
            sel = col == split
            got = figures.summed(group, int(split))[:, J[sel]].T
            vals[sel, :5] += got[:, :5]
            vals[sel, 6] += got[:, 5]
            if group not in ("w", "s"):
                vals[sel, 5] += got[:, 0]
    return vals


def _add_layout_changes(graph: Graph, dev: DeviceSpec, d: int,
                        pairs: Sequence[tuple[int, Strategy]], J: np.ndarray,
                        splits: np.ndarray, speed: float, vals: np.ndarray) -> None:
    """Add to `vals` (`_compute_costs`' columns) the layout changes a pair's strategy
    makes XLA insert around its parameter's convolution and gradient: memory-bound
    copies, as seconds, busy seconds and layout changes."""
    if graph.conv_relayout_moves.any():
        # a convolution kernel moved into the layouts its backward convolution and its
        # update read it in, at its share; one move fewer where the data axis all-reduces
        # its gradient whole
        for i in np.flatnonzero(graph.conv_relayout_moves[J] > 0).tolist():
            j, st = int(J[i]), pairs[i][1]
            moves = graph.conv_relayout_moves[j] - (d > 1 and not st.data_sharded)
            t = moves * dev.layout_change_s(graph.conv_relayout_bytes[j] / splits[i, 1]) / speed
            vals[i, [0, 1, 6]] += t
    if dev.relayouts_conv_grads and graph.conv_grad_bytes.any():
        # a kernel gradient's two batched operands copied into its convolution's layout
        # first (`grad_reductions.conv_grad_relayouts`): layout changes, which XLA's own
        # replace where the model is fed its figures (`with_compiled`)
        grad_ops = np.flatnonzero((graph.conv_grad_bytes > 0) & (graph.tp_param >= 0))
        for i in np.flatnonzero(np.isin(J, graph.tp_param[grad_ops])).tolist():
            for k in grad_ops[graph.tp_param[grad_ops] == J[i]].tolist():
                moved = graph.conv_grad_bytes[k] / splits[i, 0]
                t = (dev.layout_change_s(moved) + moved / dev.memory_bandwidth) / speed
                vals[i, [0, 1, 6]] += t
                vals[i, [0, 6]] += 2.0 * dev.kernel_overhead_s
    if d > 1 and graph.relayout_reads.any():
        # a gradient all-reduced over the data axis, read in the matmul's layout: each
        # read moves its share (the optimizer state's) into the weight's layout
        sharded = np.fromiter((st.data_sharded for _, st in pairs), bool, len(pairs))
        for i in np.flatnonzero((graph.relayout_reads[J] > 0) & ~sharded).tolist():
            j = int(J[i])
            t = graph.relayout_reads[j] * dev.layout_change_s(
                graph.relayout_bytes[j] / splits[i, 2]) / speed
            vals[i, [0, 1, 6]] += t




def _feature_split_convs(graph: Graph, cluster: Cluster, pairs: Sequence[tuple[int, Strategy]],
                         split: np.ndarray, vals: np.ndarray, d: int, m: int,
                         moves: set[int], speed: float) -> None:
    """A generic-loop convolution's rate follows the kernel a device holds
    (`DeviceSpec.small_conv_rate`): where a layout splits its kernel's features rather
    than the batch (tensor parallelism, over the model axis; an FSDP layer whose
    activations XLA moves, `collectives.fsdp_moves`, over the data axis, the batch then whole),
    its time in `vals` (per (parameter, strategy) pair: seconds, busy, bound, batched)
    is priced again with the output features split. VGG-16-small on 2 processes: its
    2x2-map convolutions ran 0.29 of their one-device time in the FSDP program."""
    dev = cluster.device
    slow = np.flatnonzero((graph.conv == 2) & (graph.tp_param >= 0))
    for i, (j, st) in enumerate(pairs):
        ways = m if st.tp != "none" else (d if st.name == "fsdp" and j in moves else 1)
        for k in (slow[graph.tp_param[slow] == j] if ways > 1 else ()):
            width, out = int(graph.conv_width[k]), float(graph.conv_out_width[k])
            work = graph.flops[k] / split[i] / speed
            vals[i, [0, 1, 3, 5]] += work / dev.small_conv_rate(width, out / ways) \
                - work / dev.small_conv_rate(width, out)


def _host_transfers(graph: Graph, dev: DeviceSpec, strategies: Sequence[Sequence[Strategy]],
                    split_of: dict[int, tuple[int, int, int]]
                    ) -> tuple[tuple[float, ...], ...]:
    """Per parameter and strategy, the seconds to move its offloaded optimizer state one
    way between host and device, at its share of the state (0 when not offloaded)."""
    resident = graph.resident_bytes
    return tuple(tuple(float(resident[j]) / split_of[id(st)][2] / dev.host_bandwidth
                       if st.offload else 0.0 for st in strats)
                 for j, strats in enumerate(strategies))


__all__ = ["MeshCosts", "mesh_costs", "op_model_split"]
