"""A layout's prediction on one mesh: time, memory, communication and energy.

Its step time is compute + blocking tensor-parallel communication + the part of the
gradient reduction that backward compute cannot hide. `predict` adds up a choice's
entries of its mesh's table (`mesh_cost.MeshCosts`) and prices what does not add up per
parameter: each parameter's data-axis communication as its neighbours make it
(`grad_comms`: FSDP activations moved or weights gathered, a bias riding with its kernel),
the tensor-parallel chain's blocking communication, the batch's partial sums, one latency
per kind of combined collective, and the peak memory. `prediction.assemble` then applies
the one exposure rule (the gradient reduction overlaps the backward pass except its tail,
`exposed_comm`) and the energy: each used device draws each phase's power for that
phase's time (`power_model.step_energy`), under the board's default power limit or a
chosen one.

Everything here is a prediction; the verification stage compares it with XLA's own
analysis of the compiled step, fed through the same rule (`with_compiled`).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxwap.analysis.graph import Graph
from jaxwap.analysis.op_splits import Layer
from jaxwap.core.records import MODEL, CompiledFigures, Prediction, Strategy
from jaxwap.cost.collectives import (
    all_reduce_latency,
    batch_reduce_comm,
    collective_cost,
    moved_in,
    tp_chain_cost,
)
from jaxwap.cost.layout_memory import peak_memory
from jaxwap.cost.mesh_cost import MeshCosts
from jaxwap.cost.prediction import StepParts, assemble, call_time
from jaxwap.hardware.cluster import Cluster


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
    """The share of the step's flops XLA's cost analysis counts: it counts a loop's body
    once, not once per iteration, so XLA's figure is scaled back by this ratio."""
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


__all__ = ["grad_comms", "loop_flops_ratio", "predict", "rides", "with_compiled"]
