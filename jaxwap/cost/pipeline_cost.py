"""What a pipelined step costs: the stage's own step, stretched by the pipeline's loop.

A pipeline of p stages runs, on each stage's devices, the step of a model with L/p of the
stack's layers: the layers outside the stack (embedding, head, loss, the optimizer update)
run on every stage, replicated over the stage axis, and the stack's own parameters,
gradients and optimizer state are 1/p of the whole. So the planner prices a pipelined
candidate from the *stage graph* (the step traced with L/p layers, `jaxwap.planning` of
the pipeline) solved on the stage's (data, model) mesh like any other step, and this
module adds what pipelining changes:

- **micro-batches**: the stack's ops run m times on 1/m of the rows each (launch overhead
  and the matmul efficiency of smaller operands, as `op_time.op_times` prices them);
- **the bubble**: the loop runs m r + p - 1 steps of one chunk (L / (p r) layers, one
  micro-batch) each, so every stage spends (p - 1) chunk-times forward and as many
  backward on no micro-batch: the stack's loop time x (p - 1) / (m r). A stage in the
  bubble skips its layers (`schedule.pipelined` runs them under `lax.cond`), so its
  devices wait at idle power for the step to move on: part of the step's time, none of
  its busy time (Perseus's energy bloat). GPipe keeping only its loop steps' inputs runs
  its layers there instead (`records.bubble_idles`): the same time, busy, and one chunk
  less memory;
- **the loop's weight gradient**: every loop step's backward pass hands out the chunk's
  weight gradient (zeros in the bubble) and adds it to the loop's running sum, four
  chunk-sized passes over memory a step; and a micro-batch reads the weights (and writes
  their gradient) again, as `Graph.fixed_bytes` prices it;
- **stage-to-stage sends**: one micro-batch's activation per loop step, forward and
  backward (2 (m r + p - 1) sends), on the links the stage axis spans: across nodes as
  soon as the mesh leaves one node, since every step waits for the slowest hop. The loop
  runs a chunk, then sends: the sends block;
- **the layers outside the stack**: the batch is split over the stage axis too, so the
  embedding, head and loss run on 1/(p d) of it: the stage step is traced on batch / p
  rows, which prices them (time and memory) as they run, and the stack's ops are scaled
  back to the micro-batches' rows;
- **the stack's entry and exit**: its input is gathered over the stage axis where the
  pipeline starts and its output summed over it (only the last stage holds it), and in
  the backward pass the input's gradient is reduce-scattered and the output's gathered:
  four collectives of the local batch's activation over the stage axis, which block;
- **memory**: the loop keeps the stack's residuals for every micro-batch (p times what
  the stage step on batch / p rows kept: the difference between that step with 2 L / p
  layers and with L / p; each layer's input, all a checkpointed layer keeps, 1/s of it
  where the loop keeps its activations split s ways over the model axis, as XLA
  propagates that split into the stage's layers: `pipeline_shapes.inputs_split`), and
  for its bubble steps too ((p - 1) / (m r) more), its
  micro-batch buffers (input, round buffer, output, the summed output: four activations
  of the local batch; two for GPipe, which has no round buffer to hold forward and
  backward), one chunk's weight gradient, which the backward `lax.cond` hands
  out in a buffer of its own (compiled on 8 CPU devices, GPipe on 2 stages: +5.2 MB of
  temporaries for 4.2 MB of stage weights), and one chunk's weights, which the
  recomputed forward `lax.cond` hands the backward one as a residual (XLA:CPU's buffer
  assignment of 2 stages x 4 micro-batches, 8 MLP blocks of d 256: the loop's gradient
  sum, the cond's chunk gradient and the cond's chunk weights, 8.4 MB each, make most
  of its 30.4 MB of temporaries);
- **FSDP inside a stage**: a stacked parameter the stage's layouts shard over data stays
  sharded in the loop (`StepVariant.stage_specs`), which gathers each layer where it runs
  it, forward and again backward, and reduce-scatters its gradient: three collectives
  of the chunk's weights per loop step, where the unpipelined step has three per step,
  and the loop waits for them; memory holds the shard, the gathered layer and the
  sharded gradient;
- **tensor parallelism inside a stage** (a model axis): the stage's layouts split its
  layers' matmuls over the model axis as in any step, and the stack's Megatron
  collectives (`collectives.tp_chain_cost`) run once per micro-batch on its activations: the
  bytes of the whole local batch, the latency once per micro-batch; they block;
- **the circular schedule** (r > 1) reads the stack in stage order: `stage_layout.to_stages`
  reorders the stacked parameters with a reshape and a transpose, which XLA compiles to
  one all-to-all over the stage axis (forward) and one for their gradients (backward),
  each moving the chunks that change stage, with the reordered copy held beside the
  original;
- **an uneven stack** (L not a multiple of p: `stage_layout.chunking`) is priced as the stage
  graph of k = ceil(L / p) layers, every stage's loop step waiting for the fullest
  chunk; the user's [L, ...] leaves cannot split their layer dim over p, so they are
  stored split over the stage axis along another dim (`pipeline_shapes.staged_layouts`) and
  laid out by layers inside the step: the same all-to-all forward and backward, and the
  copy, as the circular reorder (the padded slots make the stage graph's own share of
  the stack, state included, k p / L of what is stored: a slight overestimate).

The figures are predicted; `benchmarks/pipelines/pipeline.py` reports them, and verification
compiles the pipelined step for XLA's memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxwap.analysis.graph import Graph
from jaxwap.core.records import Prediction, StepVariant, Strategy
from jaxwap.cost.collectives import all_gather, all_reduce, fsdp_comm, send, tp_chain_cost
from jaxwap.cost.mesh_cost import op_model_split
from jaxwap.cost.op_time import op_parts
from jaxwap.cost.prediction import StepParts, assemble, call_time
from jaxwap.hardware.cluster import Cluster

# loop buffers of one local batch's activation each: the micro-batched input, the round
# buffer, the output, and the output summed over the stage axis
_LOOP_BUFFERS = 4
# of which GPipe (one round) has no round buffer, held forward and as its gradient
# backward: dropping it took two local batches' activations off XLA:CPU's compiled
# temporaries (2 stages x 4 data devices, 8 micro-batches, with and without stage remat)
_ROUND_BUFFERS = 2


def steps_of(variant: StepVariant) -> int:
    """Loop steps of a pipeline: every micro-batch's every round, plus the fill."""
    return variant.micro_batches * variant.repeats + variant.stages - 1


def loop_memory(stack_live: float, carry_row_bytes: float, batch: int, d: int,
                variant: StepVariant, row_consts_bytes: float = 0.0) -> float:
    """Bytes per device the pipeline's loop holds beyond its stage step (on batch / p
    rows), whatever the layouts: the stack's residuals for the rest of the local batch
    (the stage step kept `stack_live`, all devices' bytes, for 1/p of it) and for the
    bubble steps, and the loop's micro-batch buffers. With `remat="stage"` a loop step
    keeps its input alone (one micro-batch's rows of the carried activation, every step
    of the loop), and the stage's residuals (`stack_live`: what its recomputation holds)
    live for one micro-batch at a time, beyond the stage step's where a micro-batch has
    more rows than it (fewer micro-batches than stages). `row_consts_bytes`: a batch
    row's bytes of what the layers close over with the batch's rows (positions, a mask):
    the loop takes them in cut into micro-batches, the local batch's rows of them, and
    holds them through the forward and the backward loop (each loop step reads its
    micro-batch's; the stage step holds one micro-batch's)."""
    p, mb, rr = variant.stages, variant.micro_batches, variant.repeats
    buffers = (_LOOP_BUFFERS - (_ROUND_BUFFERS if rr == 1 else 0)) * carry_row_bytes * batch / d
    buffers += row_consts_bytes * batch / d
    if variant.remat == "stage":
        inputs = carry_row_bytes * batch / (d * mb) * (mb * rr + p - 1)
        return inputs + stack_live / d * max(0.0, p / mb - 1) + buffers
    residuals = stack_live / d * p
    return residuals * (1 - 1 / p + (p - 1) / (mb * rr)) + buffers


def stack_shares(graph: Graph, strategies: Sequence[Strategy], stacked: Sequence[int],
                 d: int, m: int) -> tuple[float, float]:
    """Bytes per device of a stage's share of the stack (its stacked parameters as the
    stage's layouts split them), and of the stack's weights as the data axis gathers
    them where FSDP inside the stage shards them (split over the model axis still)."""
    share = sum(graph.params[j].nbytes / strategies[j].shard(d, m) for j in stacked)
    gathered = sum(graph.params[j].nbytes / (m if strategies[j].tp != "none" else 1)
                   for j in stacked if strategies[j].data_sharded)
    return share, gathered


def loop_held(share: float, gathered: float, layers_per_stage: int, variant: StepVariant,
              relaid: bool) -> float:
    """Bytes per device the loop holds of the stack's weights beyond the stage step (a
    stage's `share`, the `gathered` stack of `stack_shares`): one chunk's weight gradient
    out of the backward `lax.cond` and the chunk's weights its recomputed forward cond
    hands the backward one (a slice, made a buffer at the cond's boundary), or, with no
    cond (a bubble not idled), the one chunk a loop step's gradient takes before the
    loop's sum; the layer a sharded share gathers, forward and for the backward pass; and
    with the circular schedule's reorder or an uneven stack laid out by layers
    (`relaid`), the reordered copy of the share."""
    chunks = 2 if variant.bubble_idles else 1
    held = chunks * share / variant.repeats + 2 * gathered / layers_per_stage
    return held + (share if variant.repeats > 1 or relaid else 0.0)


def stack_ops(graph: Graph, layers_per_stage: int) -> np.ndarray:
    """[ops] bool: the ops of the stage graph's layer stack (repeated once per layer)."""
    return graph.repeat == layers_per_stage


def pipeline_prediction(graph: Graph, cluster: Cluster, stage: Prediction, d: int, m: int,
                        strategies: Sequence[Strategy], stacked: Sequence[int],
                        variant: StepVariant, layers_per_stage: int, carry_row_bytes: float,
                        batch: int, stack_live: float, stack_layers: int | None = None,
                        carry_split: int = 1, row_consts_bytes: float = 0.0) -> Prediction:
    """The pipelined step's prediction on p x d x m devices, from the stage graph's
    (`graph`: the step with `layers_per_stage` layers on batch / p rows) prediction
    `stage` on its (d, m) mesh with `strategies`; `stacked` indexes the stacked
    parameters, `stack_live` is what the graph's stack keeps for the backward pass (all
    devices' bytes). `stack_layers`: the stack's layers, where they do not fill the p
    stages' `layers_per_stage` slots (None: they do). `carry_split`: the ways the loop
    keeps its carried activations split over the model axis (`schedule.pipelined`'s
    `carry_axis`; 1: whole). `row_consts_bytes`: `loop_memory`'s."""
    p, mb, rr = variant.stages, variant.micro_batches, variant.repeats
    n = p * d * m
    # the stage was priced as if its d*m devices were all the job used
    ratio = cluster.speedup_when_using(d * m) / cluster.speedup_when_using(n)
    cluster = cluster.co_running(n)   # all n run at once (the stage priced d * m)
    speed = cluster.speedup_when_using(n)
    mask = stack_ops(graph, layers_per_stage)
    over = graph.kernels * cluster.device.kernel_overhead_s
    model = op_model_split(graph, strategies, m)     # a tensor-parallel op's model split
    whole, whole_bound, whole_work = op_parts(graph, cluster, d * model, speed, data=float(d))
    # the graph's batched ops ran on batch / p rows; a micro-batch has batch / (d mb) of
    # them per device, and its weights are read (their gradients written) once each
    split = np.where(graph.batched, d * mb / p, float(d))
    micro, micro_bound, micro_work = (x * mb for x in op_parts(graph, cluster, split * model,
                                                                 speed, data=split))
    loop = float(micro[mask].sum())                       # the stack, fwd + bwd, per stage
    delta = loop - float(whole[mask].sum())
    delta_busy = float((micro - over * mb)[mask].sum() - (whole - over)[mask].sum())
    delta_bound = float(micro_bound[mask].sum() - whole_bound[mask].sum())
    delta_work = float(micro_work[mask].sum() - whole_work[mask].sum())
    bubble = loop * (p - 1) / (mb * rr)           # idle: in the step time, not busy
    if not variant.bubble_idles:
        # the stages run their layers in the bubble too (and drop the result): busy
        share = (p - 1) / (mb * rr)
        delta_busy += float((micro - over * mb)[mask].sum()) * share
        delta_bound += float(micro_bound[mask].sum()) * share
        delta_work += float(micro_work[mask].sum()) * share

    # every loop step, bubble or not, the backward pass hands out the chunk's weight
    # gradient (zeros in the bubble) and adds it to the loop's sum: written, then read
    # twice and written again; a stage's share sharded over data (FSDP inside the
    # stage) is 1/d of it on each device
    stage_stack, whole = stack_shares(graph, strategies, stacked, d, m)
    accumulate = 4 * steps_of(variant) * stage_stack / rr \
        / (cluster.device.memory_bandwidth * speed)
    delta += accumulate
    delta_busy += accumulate

    local_rows = batch / d
    across = cluster.num_nodes > 1 and n > cluster.node_size
    steps = steps_of(variant)
    row = carry_row_bytes / carry_split         # what a device of the model axis holds
    sends = 2 * steps * send(row * local_rows / mb, cluster, across)
    inner = cluster.devices_in_node(p, d * m)
    act = row * local_rows
    ar_t, ar_b = all_reduce(act, p, cluster, inner=inner)
    ag_t, ag_b = all_gather(act, p, cluster, inner=inner)
    io_t, io_b = ar_t + 3 * ag_t, ar_b + 3 * ag_b
    # tensor parallelism inside the stage: the stack's layers run once per micro-batch,
    # each its own collectives over the model axis on one micro-batch's activations
    kinds = {j: s.tp for j, s in enumerate(strategies)}
    tp_t, tp_b = tp_chain_cost(graph, kinds, d, m, cluster,
                               loop=(layers_per_stage, d * mb / p, mb))
    blocking = tp_t + sends + io_t
    comm_bytes = (stage.comm_bytes - tp_chain_cost(graph, kinds, d, m, cluster)[1] + tp_b
                  + io_b + 2 * steps * act / mb)
    if carry_split > 1:
        # a busy loop step's input gathered over the model axis for the stage's layers,
        # forward and again backward (XLA:CPU compiled these beside the layers'
        # all-reduces, half of which it no longer needed; those are not credited)
        sp_t, sp_b = all_gather(carry_row_bytes * local_rows / mb, carry_split, cluster,
                                inner=cluster.devices_in_node(carry_split, 1))
        blocking += 2 * mb * rr * sp_t
        comm_bytes += 2 * mb * rr * sp_b
    grad_comm = stage.grad_comm_time_s

    # FSDP inside the stage (`StepVariant.stage_specs`): every loop step gathers its
    # chunk's layers for the forward pass and again for the backward pass, and
    # reduce-scatters their gradient, the loop waiting for each; the stage step priced
    # one such round, overlapped with its backward pass: that round is replaced
    if whole:
        in_node = cluster.devices_in_node(d, m)
        g_t, g_b = all_gather(whole / rr, d, cluster, inner=in_node)
        blocking += 3 * steps * g_t
        comm_bytes += 3 * steps * g_b
        once_t, once_b = fsdp_comm(whole, d, cluster, inner=in_node)
        grad_comm = max(0.0, grad_comm - once_t)
        comm_bytes = max(0.0, comm_bytes - once_b)

    uneven = stack_layers is not None and stack_layers != p * layers_per_stage
    if rr > 1 or uneven:
        # the reorder into stage order (and an uneven stack, stored split along another
        # dim, laid out by layers): an all-to-all of each device's share, forward and
        # backward (priced as the all-gather of that share, as XLA's all-to-alls are)
        a_t, a_b = all_gather(stage_stack, p, cluster, inner=inner)
        blocking += 2 * a_t
        comm_bytes += 2 * a_b
    memory = (stage.peak_memory_bytes
              + loop_held(stage_stack, whole, layers_per_stage, variant, uneven)
              + loop_memory(stack_live, row, batch, d, variant, row_consts_bytes))
    parts = StepParts(
        compute=stage.compute_time_s * ratio + delta + bubble,
        busy=stage.busy_time_s * ratio + delta_busy,
        blocking=blocking, grad_comm=grad_comm,
        tail_comm=stage.tail_comm_time_s, batched_time=stage.batched_time_s * ratio + delta,
        host_one_way=stage.host_transfer_time_s / 2, comm_bytes=comm_bytes, memory=memory,
        flops=stage.flops_per_device, loop_flops_ratio=stage.loop_flops_ratio,
        bubble=bubble if variant.bubble_idles else 0.0, sends=sends + io_t,
        bound=stage.compute_bound_time_s * ratio + delta_bound,
        bound_work=stage.compute_bound_work_s * ratio + delta_work,
        relayout=stage.layout_change_time_s * ratio, call=call_time(cluster, graph.buffers, n,
                                                                graph.tree_calls))
    return assemble(cluster, n, batch, parts)


__all__ = ["loop_held", "loop_memory", "pipeline_prediction", "stack_ops", "stack_shares",
           "steps_of"]
