"""The cost model: time, memory, communication and energy of one candidate plan.

A candidate is a mesh (data x model) and a sharding strategy per parameter. Its step
time is compute + blocking tensor-parallel communication + the part of the gradient
reduction that backward compute cannot hide:

- compute: every op runs on its share of the work (batched ops over the data axis, a
  tensor-parallel weight's matmuls also over the model axis, a parameter's own ops
  such as the optimizer update over however the parameter is sharded); each op costs
  its kernel launches plus a roofline `max(flops / (peak * eff), bytes / bandwidth)`,
  where matmul efficiency (the calibrated curve `DeviceSpec.matmul_efficiency`, else
  `w / (w + w_half)`) falls as the per-device work `w` shrinks.
  That fall, with the fixed launch cost, is what makes a small workload slower on
  many devices.
- communication: ring collectives (`cost/collectives.py`); the gradient reduction overlaps the
  backward pass except its tail (`exposed_comm`, the one exposure rule).
- energy: each used device draws each phase's power for that phase's time
  (`power_model.step_energy`), under the board's default power limit or a chosen one.

Everything here is a prediction; the verification stage compares it with XLA's own
analysis of the compiled step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxwap.analysis.graph import GRAD, OPT, Graph
from jaxwap.analysis.op_splits import Layer
from jaxwap.analysis.tp_activations import TP_KINDS
from jaxwap.core.records import DATA, MODEL, CompiledFigures, Prediction, Strategy
from jaxwap.cost.collectives import (
    all_reduce_latency,
    batch_reduce_comm,
    collective_cost,
    fsdp_comm,
    fsdp_moves,
    grad_reduce_comm,
    hsdp_comm,
    moved_in,
    tp_chain_cost,
)
from jaxwap.cost.layout_memory import peak_memory
from jaxwap.cost.op_time import op_parts, relayout_times
from jaxwap.cost.prediction import StepParts, assemble, call_time
from jaxwap.hardware.cluster import Cluster


# --------------------------------------------------------------------------- compute
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
    # (`grad_comms`) takes each layer's as its chosen neighbours make it: gathered, or
    # moved (None: it cannot move)
    gathered_comm: tuple[tuple[tuple[float, float], ...], ...] = ()
    moved_comm: tuple[tuple[tuple[float, float] | None, ...], ...] = ()
    base_relayout: float = 0.0   # of `base`: layout changes


def rides(kernel: Strategy, bias: Strategy) -> bool:
    """Whether a bias in this layout rides with its kernel's moved activations: both
    FSDP, the kernel not tensor-parallel. XLA then adds the feature-split bias to the
    feature-split output and reduces its gradient where it is, with no collective of its
    own (AlexNet-small: 18 collectives compiled for 16 FSDP parameters)."""
    return kernel.data_sharded and kernel.tp == "none" and bias.data_sharded


def grad_comms(mc: MeshCosts, choice: Sequence[int],
               layers: Sequence[Layer]) -> list[tuple[float, float]]:
    """Per parameter, the (seconds, bytes) of its data-axis communication in this
    choice: its own price, moved or gathered as the choice's `layers` make it
    (`collectives.moved_in`), none for a bias that rides with its moved kernel (`rides`)."""
    moved = {j for j in moved_in(layers, [mc.strategies[j][s] for j, s in enumerate(choice)])
             if mc.moved_comm[j][choice[j]] is not None}
    out = [(mc.moved_comm if j in moved else mc.gathered_comm)[j][s]
           for j, s in enumerate(choice)]
    for L in layers:
        if L.bias >= 0 and L.param in moved and rides(mc.strategies[L.param][choice[L.param]],
                                                      mc.strategies[L.bias][choice[L.bias]]):
            out[L.bias] = (0.0, 0.0)
    return out


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
    inner = cluster.devices_in_node(d, m)   # of the data axis: the model axis is innermost
    per_split: dict[int, tuple[np.ndarray, ...]] = {}

    def at(split: int) -> tuple[np.ndarray, ...]:
        """Per-op (seconds, busy seconds, flops, compute-bound seconds, their work, of the
        seconds layout changes) with the work divided `split` ways."""
        if split not in per_split:
            # every batched op's split includes the data axis; the rest move no fixed bytes
            t, bound, work = op_parts(graph, cluster, float(split), speed, data=float(d))
            per_split[split] = (t, t - graph.kernels * dev.kernel_overhead_s,
                                graph.flops / split, bound, work,
                                relayout_times(graph, cluster, float(split), speed))
        return per_split[split]

    batched, owner, tp = graph.batched, graph.owner, graph.tp_param
    tp_op, tp_kind = graph.tp_op_param, graph.tp_op_kind
    fixed_b = batched & (tp < 0) & (tp_op < 0)
    fixed_o = ~batched & (owner < 0)
    at_d, at_1 = at(d), at(1)
    base, base_busy, base_flops, base_bound, base_work, base_relayout = (
        float(x_d[fixed_b].sum() + x_1[fixed_o].sum()) for x_d, x_1 in zip(at_d, at_1, strict=True))
    base_batched = float(at_d[0][fixed_b].sum())

    P = len(graph.params)
    opt_op = np.isin(graph.op_class, (GRAD, OPT))
    resident = graph.resident_bytes
    # per-parameter sums at each split, by group: its tensor-parallel matmuls, its own
    # weight/gradient ops, its optimizer ops (one bincount per split, not per strategy:
    # this loop runs for every mesh of every planning)
    groups = {"tp": (batched & (tp >= 0), tp), "w": (~batched & (owner >= 0) & ~opt_op, owner),
              "s": (~batched & (owner >= 0) & opt_op, owner)}
    for k, name in enumerate(TP_KINDS):
        groups[name] = (batched & (tp < 0) & (tp_kind == k), tp_op)
    sums: dict[tuple[str, int], np.ndarray] = {}

    def summed(group: str, split: int) -> np.ndarray:
        """[6, P]: per parameter, the group's `at` sums at this split."""
        if (group, split) not in sums:
            mask, who = groups[group]
            sums[group, split] = np.stack([np.bincount(who[mask], x[mask], minlength=P)
                                           for x in at(split)])
        return sums[group, split]

    reps = graph.grad_repeat
    # loop iterations a parameter's own ops run in (micro-batches): FSDP gathers per pass
    passes = np.ones(len(graph.params))
    np.maximum.at(passes, graph.owner[graph.owner >= 0], graph.repeat[graph.owner >= 0])
    # a stacked parameter's ops repeat once per layer of its scan, each gathering one
    # layer's slice: the whole stack is gathered once per pass of the loops around it
    # ... and its collectives run in each layer iteration, a slice each
    layers = np.ones(len(graph.params))
    for j in np.flatnonzero(graph.stacked_dim >= 0):
        layers[j] = graph.params[j].shape[graph.stacked_dim[j]]
        passes[j] = max(1.0, passes[j] / layers[j])
    # every (parameter, strategy) pair at once: the splits its three groups of ops take
    pairs = [(j, st) for j, strats in enumerate(strategies) for st in strats]
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
    # seconds, busy, flops, bound, work, batched seconds, of the seconds layout changes
    vals = np.zeros((len(pairs), 7))
    for g, group in enumerate(("tp", "w", "s", *TP_KINDS)):
        col = splits[:, g]
        for split in np.unique(col):
            sel = col == split
            got = summed(group, int(split))[:, J[sel]].T
            vals[sel, :5] += got[:, :5]
            vals[sel, 6] += got[:, 5]
            if group not in ("w", "s"):
                vals[sel, 5] += got[:, 0]
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
    # where XLA would move activations rather than gather weights, were every layer FSDP
    # (the search's estimate; `grad_comms` prices each layout as its layers make it)
    fsdp_dim = {j: st.spec.index(DATA) for j, strats in enumerate(strategies)
                for st in strats if st.name == "fsdp" and DATA in st.spec}
    moves = fsdp_moves(graph.layers, fsdp_dim)
    if dev.small_input_conv_rates and (graph.conv == 2).any():
        _feature_split_convs(graph, cluster, pairs, splits[:, 0], vals, d, m, moves, speed)
    comm_of: dict[tuple[float, bool, bool, float, float, bool, float, float],
                  tuple[float, float]] = {}
    g_comm, gathered, moved_c = [], [], []
    host: list[tuple[float, ...]] = []
    riders = tuple((L.bias, L.param) for L in graph.layers
                   if L.bias >= 0 and L.param in moves and r == 1)

    def price(j: int, st: Strategy, local: float, moved: bool) -> tuple[float, float]:
        # the blocks of a deep model repeat the same few shapes: price each once
        uses = float(graph.fsdp_gathers[j])
        key = (local, st.data_sharded, st.state_spec is not None, float(reps[j]),
               float(passes[j]), moved, float(layers[j]), uses)
        if key not in comm_of:
            if st.data_sharded and r > 1:
                comm_of[key] = hsdp_comm(local, d, r, cluster, reps[j], passes[j], uses)
            elif st.data_sharded:
                # gathered where the batch meets it, each pass (a scan's backward loop
                # gathers it again), each partial gradient reduced
                comm_of[key] = fsdp_comm(local, d, cluster, reps[j], passes[j], inner,
                                         moved, layers[j], uses)
            else:
                comm_of[key] = grad_reduce_comm(local, d, cluster, reps[j],
                                                zero1=st.state_spec is not None,
                                                inner=inner, iterations=layers[j])
        return comm_of[key]

    for j, strats in enumerate(strategies):
        row_g, row_m, row_h = [], [], []
        for st in strats:
            local = graph.params[j].nbytes / (m if st.tp != "none" else 1)
            # under tensor parallelism too (the model axis splits the rest); not under
            # HSDP, whose replicas still all-reduce the weight's gradient shard
            act = graph.layer_of[j].act_in_bytes if j in graph.layer_of else np.inf
            row_g.append(price(j, st, local, False))
            row_m.append(price(j, st, act, True)
                         if st.data_sharded and r == 1 and act < local else None)
            row_h.append(float(resident[j]) / split_of[id(st)][2]
                         / dev.host_bandwidth if st.offload else 0.0)
        g_comm.append(tuple(mv if mv is not None and j in moves else g
                            for g, mv in zip(row_g, row_m, strict=True)))
        gathered.append(tuple(row_g))
        moved_c.append(tuple(row_m))
        host.append(tuple(row_h))
    starts = np.cumsum([0] + [len(st) for st in strategies])

    def table(k: int) -> tuple[tuple[float, ...], ...]:
        col = vals[:, k].tolist()
        return tuple(tuple(col[starts[j]:starts[j + 1]]) for j in range(len(strategies)))

    return MeshCosts(d, m, base, base_busy, base_flops, base_batched,
                     tuple(tuple(s) for s in strategies), table(0), table(1), table(2),
                     table(5), tuple(g_comm), tuple(host), r, base_bound, base_work,
                     table(3), table(4), riders, table(6), tuple(gathered), tuple(moved_c),
                     base_relayout)


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


def predict(graph: Graph, cluster: Cluster, mc: MeshCosts, choice: Sequence[int]) -> Prediction:
    """The full prediction for a mesh's costs and a strategy index per parameter."""
    d, m = mc.d, mc.m
    cluster = cluster.co_running(d * m)   # as `mesh_costs` priced it
    picked = list(enumerate(choice))
    strats = [mc.strategies[j][s] for j, s in picked]
    grads = grad_comms(mc, choice, graph.layers)
    first = graph.layers[0].param if graph.layers else None
    tp_t, tp_b = tp_chain_cost(graph, {j: s.tp for j, s in enumerate(strats)}, d, m, cluster)
    # the loss, metrics and batch statistics are partial sums over the batch too
    red_t, red_b = batch_reduce_comm(graph, d, cluster, cluster.devices_in_node(d, m))
    peak, _, scratch = peak_memory(graph, d, m, strats, mc.r)
    parts = StepParts(
        compute=mc.base + sum(mc.param_time[j][s] for j, s in picked),
        busy=mc.base_busy + sum(mc.param_busy[j][s] for j, s in picked),
        blocking=tp_t,
        grad_comm=sum(g[0] for g in grads) + red_t
        + _combined_latency(strats, d, m, cluster, mc.r),
        tail_comm=grads[first][0] if first is not None else 0.0,
        batched_time=mc.base_batched + sum(mc.param_batched[j][s] for j, s in picked),
        host_one_way=sum(mc.host[j][s] for j, s in picked),
        comm_bytes=sum(g[1] for g in grads) + red_b + tp_b,
        memory=peak,
        flops=mc.base_flops + sum(mc.param_flops[j][s] for j, s in picked),
        loop_flops_ratio=loop_flops_ratio(graph),
        bound=mc.base_bound + sum(mc.param_bound[j][s] for j, s in picked),
        bound_work=mc.base_work + sum(mc.param_work[j][s] for j, s in picked),
        fresh=cluster.device.fresh_memory_s(scratch),
        call=call_time(cluster, graph.buffers, d * m, graph.tree_calls),
        relayout=mc.base_relayout + (sum(mc.param_relayout[j][s] for j, s in picked)
                                     if mc.param_relayout else 0.0))
    return assemble(cluster, d * m, graph.batch_size or 1, parts)


def with_compiled(pred: Prediction, figs: CompiledFigures, cluster: Cluster,
                  batch_size: int, d: int = 1, m: int = 1, r: int = 1) -> Prediction:
    """The same cost model fed XLA's figures: memory is XLA's; compute time scales with
    XLA's flops over the model's (where XLA counts them all: not past library calls),
    plus the layout changes XLA inserted and the scratch memory it allocates
    (`DeviceSpec.layout_change_s`, `fresh_memory_s`); communication
    is priced from the collectives XLA actually inserted (data-axis ones overlap backward
    compute, the rest block); the exposure rule and host transfers are the model's own."""
    cluster = cluster.co_running(d * m)
    counted = pred.flops_as_xla_counts
    # XLA counts no flops for a library call's work (XLA:GPU's cuBLAS and cuDNN): there
    # the model's flops stand
    scale = figs.flops / counted if counted > 0 and figs.flops > 0 \
        and not figs.library_calls else 1.0
    overlappable = blocking = 0.0
    for c in figs.collectives:
        t = collective_cost(c, cluster, d, m, r)[0]
        if c.axes and MODEL not in c.axes:
            overlappable += t
        else:
            blocking += t
    # the stretch of a power limit is re-applied by `assemble`; scratch is XLA's own, and
    # so are the layout changes its layout assignment inserted (memory-bound work), which
    # replace the model's
    relayout = sum(cluster.device.layout_change_s(b) * t for b, t in figs.layout_changes)
    own = pred.power_stretch_s + pred.layout_change_time_s
    parts = StepParts(
        compute=(pred.compute_time_s - own - pred.fresh_memory_time_s) * scale + relayout,
        busy=(pred.busy_time_s - own) * scale + relayout, relayout=relayout,
        blocking=blocking, grad_comm=overlappable, tail_comm=pred.tail_comm_time_s,
        batched_time=pred.batched_time_s * scale, host_one_way=pred.host_transfer_time_s / 2,
        comm_bytes=figs.comm_bytes, memory=figs.memory_bytes,
        flops=figs.flops / pred.loop_flops_ratio, loop_flops_ratio=pred.loop_flops_ratio,
        bound=pred.compute_bound_time_s * scale, bound_work=pred.compute_bound_work_s * scale,
        fresh=cluster.device.fresh_memory_s(figs.temp_bytes), call=pred.call_time_s)
    return assemble(cluster, pred.num_devices, batch_size, parts, pred.power_limit_w)


def loop_flops_ratio(graph: Graph) -> float:
    total = graph.total_flops
    if total <= 0 or (graph.repeat == 1).all():
        return 1.0
    return float((graph.flops / graph.repeat).sum() / total)


def _combined_latency(strats: Sequence[Strategy], d: int, m: int, cluster: Cluster,
                      r: int = 1) -> float:
    """Ring latency of the gradient collectives once each: XLA combines the per-parameter
    all-reduces (and, where the backend combines collectives, the reduce-scatters and
    all-gathers of sharded layouts: `DeviceSpec.combines_collectives`) of a step into few
    large ones. Priced as a zero-byte reduction over the data axis's links (hierarchical
    across nodes)."""
    if d <= 1:
        return 0.0
    sharded = any(s.data_sharded for s in strats)
    kinds = 1 if not cluster.device.combines_collectives else \
        int(any(not s.data_sharded for s in strats)) + int(sharded)
    # HSDP's sharded gradients add the replicas' all-reduce of their shards
    kinds += int(r > 1 and sharded)
    return kinds * all_reduce_latency(d, cluster, cluster.devices_in_node(d, m))


__all__ = ["MeshCosts", "grad_comms", "mesh_costs", "op_model_split", "predict", "rides",
           "with_compiled"]
