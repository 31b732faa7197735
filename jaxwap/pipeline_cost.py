"""What a pipelined step costs: the stage's own step, stretched by the pipeline's loop.

A pipeline of p stages runs, on each stage's devices, the step of a model with L/p of the
stack's layers: the layers outside the stack (embedding, head, loss, the optimizer update)
run on every stage, replicated over the stage axis, and the stack's own parameters,
gradients and optimizer state are 1/p of the whole. So the planner prices a pipelined
candidate from the *stage graph* (the step traced with L/p layers, `jaxwap.planning` of
the pipeline) solved on the stage's (data, model) mesh like any other step, and this
module adds what pipelining changes:

- **micro-batches**: the stack's ops run m times on 1/m of the rows each (launch overhead
  and the matmul efficiency of smaller operands, as `cost.op_times` prices them);
- **the bubble**: the loop runs m r + p - 1 steps of one chunk (L / (p r) layers, one
  micro-batch) each, so every stage spends (p - 1) chunk-times forward and as many
  backward on no micro-batch: the stack's loop time x (p - 1) / (m r). A stage in the
  bubble computes on padding (`pipeline.pipelined`: skipping it under `lax.cond` made the
  differentiated loop keep the stage's weights once per step), so the bubble draws the
  power of compute, not idle power: Perseus's energy bloat, at its worst;
- **stage-to-stage sends**: one micro-batch's activation per loop step, forward and
  backward (2 (m r + p - 1) sends), on the links the stage axis spans: across nodes as
  soon as the mesh leaves one node, since every step waits for the slowest hop. The loop
  runs a chunk, then sends: the sends block;
- **the layers outside the stack**: the batch is split over the stage axis too, so the
  embedding, head and loss run on 1/(p d) of it (the stage step priced them at 1/d);
- **the stack's entry and exit**: its input is gathered over the stage axis where the
  pipeline starts and its output summed over it (only the last stage holds it), and in
  the backward pass the input's gradient is reduce-scattered and the output's gathered:
  four collectives of the local batch's activation over the stage axis, which block;
- **memory**: the loop differentiated keeps the residuals of its bubble steps too
  ((p - 1) / (m r) more of the stack's activations), its micro-batch buffers (input,
  round buffer, output, the summed output: four activations of the local batch), and a
  stage's stacked parameters sharded over data are gathered whole where the loop reads
  them, their gradient whole too until it is reduced;
- **the circular schedule** (r > 1) reads the stack in stage order: the step permutes the
  stacked parameters over the stage axis, priced as an all-gather of the stage's stacked
  weights over the stage axis (forward) and a reduce-scatter of their gradients
  (backward), what XLA compiles a gather along a sharded dim to, with the gathered stack
  held in memory; and the round's chunk, picked by a traced index, is kept once per loop
  step for the backward pass (compiled on 8 CPU devices: +36 MB for 2 rounds of a 8.4 MB
  stage over 9 steps).

The figures are predicted; `benchmarks/pipeline.py` reports them, and verification
compiles the pipelined step for XLA's memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .comm import all_gather, all_reduce, send
from .cost import StepParts, assemble, op_times
from .graph import Graph
from .hardware import Cluster
from .records import Prediction, StepVariant, Strategy

# loop buffers of one local batch's activation each: the micro-batched input, the round
# buffer, the output, and the output summed over the stage axis
_LOOP_BUFFERS = 4


def stack_ops(graph: Graph, layers_per_stage: int) -> np.ndarray:
    """[ops] bool: the ops of the stage graph's layer stack (repeated once per layer)."""
    return graph.repeat == layers_per_stage


def pipeline_prediction(graph: Graph, cluster: Cluster, stage: Prediction, d: int, m: int,
                        strategies: Sequence[Strategy], stacked: Sequence[int],
                        variant: StepVariant, layers_per_stage: int, carry_row_bytes: float,
                        batch: int) -> Prediction:
    """The pipelined step's prediction on p x d x m devices, from the stage graph's
    (`graph`: the step with `layers_per_stage` layers) prediction `stage` on its (d, m)
    mesh with `strategies`; `stacked` indexes the stacked parameters."""
    p, mb, rr = variant.stages, variant.micro_batches, variant.repeats
    n = p * d * m
    # the stage was priced as if its d*m devices were all the job used
    ratio = cluster.speedup_when_using(d * m) / cluster.speedup_when_using(n)
    speed = cluster.speedup_when_using(n)
    mask = stack_ops(graph, layers_per_stage)
    over = graph.kernels * cluster.device.kernel_overhead_s
    whole = op_times(graph, cluster, float(d), speed)
    split = np.where(graph.batched, float(d * mb), float(d))
    micro = op_times(graph, cluster, split, speed) * mb
    loop = float(micro[mask].sum())                       # the stack, fwd + bwd, per stage
    delta = loop - float(whole[mask].sum())
    delta_busy = float((micro - over * mb)[mask].sum() - (whole - over)[mask].sum())
    bubble = loop * (p - 1) / (mb * rr)
    bubble_busy = float((micro - over * mb)[mask].sum()) * (p - 1) / (mb * rr)
    rest = ~mask & graph.batched
    spread = op_times(graph, cluster, float(d * p), speed)
    delta += float(spread[rest].sum() - whole[rest].sum())
    delta_busy += float((spread - over)[rest].sum() - (whole - over)[rest].sum())

    local_rows = batch / d
    across = cluster.num_nodes > 1 and n > cluster.node_size
    steps = mb * rr + p - 1
    sends = 2 * steps * send(carry_row_bytes * local_rows / mb, cluster, across)
    inner = cluster.devices_in_node(p, d * m)
    act = carry_row_bytes * local_rows
    ar_t, ar_b = all_reduce(act, p, cluster, inner=inner)
    ag_t, ag_b = all_gather(act, p, cluster, inner=inner)
    io_t, io_b = ar_t + 3 * ag_t, ar_b + 3 * ag_b
    blocking = stage.tp_comm_time_s + sends + io_t
    comm_bytes = stage.comm_bytes + io_b + 2 * steps * act / mb

    stage_stack = sum(graph.params[j].nbytes for j in stacked)   # this stage's share
    # gathered whole for the loop, and the gradient whole until it is reduced
    held = 2 * sum(graph.params[j].nbytes * (1 - 1 / strategies[j].shard(d, m))
                   for j in stacked if strategies[j].data_sharded)
    if rr > 1:
        g_t, g_b = all_gather(stage_stack * p, p, cluster, inner=inner)
        blocking += 2 * g_t
        comm_bytes += 2 * g_b
        held += stage_stack * (p - 1) / max(1, d) + steps * stage_stack / rr
    activations = float(graph.live[:, 0].max()) / d if len(graph.live) else 0.0
    memory = (stage.peak_memory_bytes + activations * (p - 1) / (mb * rr)
              + _LOOP_BUFFERS * carry_row_bytes * local_rows + held)
    parts = StepParts(
        compute=stage.compute_time_s * ratio + delta + bubble,
        busy=stage.busy_time_s * ratio + delta_busy + bubble_busy,
        blocking=blocking, grad_comm=stage.grad_comm_time_s,
        tail_comm=stage.tail_comm_time_s, batched_time=stage.batched_time_s * ratio + delta,
        host_one_way=stage.host_transfer_time_s / 2, comm_bytes=comm_bytes, memory=memory,
        flops=stage.flops_per_device, loop_flops_ratio=stage.loop_flops_ratio,
        bubble=bubble, sends=sends + io_t)
    return assemble(cluster, n, batch, parts)


__all__ = ["pipeline_prediction", "stack_ops"]
