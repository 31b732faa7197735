"""What data parallelism reduces per step: each parameter's partial gradient sums (and
how many times a loop makes them), and every other partial sum over the batch (the loss,
metrics, batch-norm statistics), as XLA's SPMD partitioner all-reduces them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxwap.analysis.batch_rules import batch_rule, default_batch
from jaxwap.analysis.flatten import FlatOp, FlatProgram
from jaxwap.analysis.liveness import GRAD
from jaxwap.analysis.primitives import MATMUL, linear_in
from jaxwap.analysis.roles import BATCH, PARAM, LeafRole, ParamInfo


def batch_dims(prog: FlatProgram, batch_inputs: Sequence[int]
               ) -> tuple[list[int | None], np.ndarray]:
    """Where data parallelism splits every value of the flat program, and which ops make
    partial sums of it.

    Batch inputs are split on their leading dim (as `compile_layout` places them); each
    op's batch rule (`batch_rules.register_batch`) says where that dim goes in its results
    and whether the op sums over it (a contraction over the batch, a reduction, a scatter
    of every row into one array). Returns the split dim of every value (None: whole on
    every device) and, per op, whether its results are such partial sums: one all-reduce
    over the data axis each.
    """
    axis: list[int | None] = [None] * len(prog.vars)
    for i in batch_inputs:
        axis[i] = 0 if prog.vars[i].shape else None
    partial = np.zeros(len(prog.ops), dtype=bool)
    for k, op in enumerate(prog.ops):
        ins = [axis[i] for i in op.ins]
        if all(a is None for a in ins):
            continue
        try:
            outs, summed = batch_rule(op.prim)(op.eqn, ins)
        except Exception:  # noqa: BLE001 - an equation its rule does not expect
            outs, summed = default_batch(op.eqn, ins)
        for o, a in zip(op.outs, outs, strict=True):
            axis[o] = a
        partial[k] = summed and all(a is None for a in outs)
    return axis, partial


def batch_split(prog: FlatProgram, in_roles: Sequence[LeafRole]
                ) -> tuple[list[int | None], np.ndarray]:
    """`batch_dims` of the step: where data parallelism splits each value (the batch
    inputs on their leading dim), and which ops make partial sums over the batch."""
    return batch_dims(prog, [i for i, r in zip(prog.in_ids, in_roles, strict=True)
                             if r.kind == BATCH])


def partial_sums(prog: FlatProgram, out_roles: Sequence[LeafRole],
                 split: tuple[Sequence[int | None], np.ndarray]) -> list[tuple[int, int]]:
    """(op, parameter or -1) of every op whose result is a partial sum over the batch
    (`split`, the step's `batch_split`), with the parameter it flows into linearly
    (`data_reductions`)."""
    axis, partial = split
    reach = np.full(len(prog.vars), -1, np.int64)  # the parameter a value flows into
    for o, r in zip(prog.out_ids, out_roles, strict=True):
        if r.kind == PARAM:
            reach[o] = r.param
    for op in reversed(prog.ops):
        to = next((int(reach[o]) for o in op.outs if axis[o] is None and reach[o] >= 0), -1)
        if to >= 0:
            for n, i in enumerate(op.ins):
                if axis[i] is None and reach[i] < 0 and linear_in(op.eqn, op.prim, n):
                    reach[i] = to
    return [(int(k), next((int(reach[o]) for o in prog.ops[k].outs if reach[o] >= 0), -1))
            for k in np.flatnonzero(partial)]


def reduced_copies(prog: FlatProgram, sums: Sequence[tuple[int, int]]
                   ) -> list[tuple[int, int, int, float]]:
    """(first op, last op, parameter, bytes) of the reduced copy of each partial gradient
    sum where XLA's combined all-reduce makes it (the REDUCED class of `liveness`): the
    combiner joins a step's gradient reductions into one all-reduce after the last of them
    is made, and writes its results to buffers of their own, so at that point every
    partial gradient and its sum are live together (AlexNet-small's data-parallel step on
    2 devices: the 64 MiB fc7 partial gradient and its all-reduced copy side by side,
    XLA's memory 432 MB against 354 on one device). Sums inside a loop (a micro-batch
    scan) are reduced each iteration: left out. `sums` is `partial_sums`'s answer."""
    sums = [(k, j) for k, j in sums if j >= 0 and prog.ops[k].repeat == 1]
    if not sums:
        return []
    at = max(k for k, _ in sums)
    return [(at, at, j, float(sum(prog.nbytes[o] for o in prog.ops[k].outs)))
            for k, j in sums]


def data_reductions(prog: FlatProgram, sums: Sequence[tuple[int, int]],
                    params: Sequence[ParamInfo]) -> tuple[np.ndarray, float, float]:
    """What data parallelism all-reduces per step: per parameter, its partial gradient
    sums in units of its whole gradient; and the bytes and the number of every other
    partial sum.

    Each op that sums over the batch (`batch_dims`) is one all-reduce of its result
    (two such ops on one operand are two: XLA's CSE merges the sums, not the all-reduces).
    It is a parameter's when its result flows linearly (a summand, not through a square
    root or the like), through values not split by the batch, into that parameter's new
    value or optimizer state; else it is a loss, metric or statistic (a batch-norm mean
    reaches the scale's gradient only through a reciprocal square root). A gradient is
    priced in its parameter's dtype (XLA:CPU promotes a bf16 all-reduce to f32). A
    parameter with no partial sum found gets 0 (the caller falls back to once a step).
    `sums` is `partial_sums`'s answer: the ops, each with the parameter it reaches.
    """
    elems = np.zeros(len(params))
    other = count = 0.0
    for k, j in sums:
        op = prog.ops[k]
        if j >= 0:
            elems[j] += float(sum(prog.size[o] for o in op.outs)) * op.repeat
        else:
            other += float(sum(prog.nbytes[o] for o in op.outs)) * op.repeat
            count += len(op.outs) * op.repeat
    sizes = np.array([max(p.size, 1) for p in params], dtype=np.float64)
    return elems / sizes, other, count


def grad_repeat(ops: Sequence[FlatOp], op_owner: np.ndarray, op_class: np.ndarray,
                 params: Sequence[ParamInfo], stacked: np.ndarray) -> np.ndarray:
    """How many times each parameter's gradient is produced per step: a gradient made
    inside a scan over micro-batches is reduced over the data axis in every iteration.
    A stacked parameter's gradient is made a slice per iteration of the scan over its
    layers: those iterations make one whole gradient, not one each."""
    out = np.ones(len(params))
    for k, op in enumerate(ops):
        j = int(op_owner[k])
        if j >= 0 and op_class[k] == GRAD and op.repeat > 1:
            layers = params[j].shape[stacked[j]] if stacked[j] >= 0 else 1
            out[j] = max(out[j], op.repeat // max(layers, 1))
    return out


def relayouts(prog: FlatProgram, kinds: Sequence[str], owner: np.ndarray,
              batched: np.ndarray, num_params: int) -> tuple[np.ndarray, np.ndarray]:
    """Per parameter, (bytes, reads per step) of its gradient where a matmul makes it
    transposed (`dW = (dy^T x)^T`, jax's transpose rule for a weight on the right): once
    data parallelism has all-reduced the matmul's result, XLA:CPU keeps the sum in the
    matmul's layout and every op that reads the gradient moves it into the weight's (in
    its fusion, as a strided read: AlexNet's 64 MiB fc7 gradient twice a step, about half
    the 2-process step). On one device the transpose folds into the matmul. 0 where
    none."""
    made: dict[int, int] = {}
    reads = np.zeros(len(prog.vars))
    for k, op in enumerate(prog.ops):
        for i in set(op.ins):
            reads[i] += op.repeat
        for o in op.outs:
            made[o] = k
    nbytes, count = np.zeros(num_params), np.zeros(num_params)
    for op in prog.ops:
        if op.prim != "transpose" or not op.ins or not op.outs:
            continue
        src, out = op.ins[0], op.outs[0]
        j = int(owner[out])
        if j < 0 or batched[out] or src not in made or kinds[made[src]] != MATMUL:
            continue
        nbytes[j] = max(nbytes[j], float(prog.nbytes[out]))
        count[j] += reads[out]
    return nbytes, count


def conv_relayouts(prog: FlatProgram, owner: np.ndarray, batched: np.ndarray,
                   num_params: int) -> tuple[np.ndarray, np.ndarray]:
    """Per parameter, (bytes, moves per step) of a convolution kernel as XLA:CPU's layout
    assignment moves it: one copy into the layout the kernel is read in for the input
    gradient (the kernel jax reverses, `rev`, for that transposed convolution), and two in
    the update, one where the data axis all-reduces the gradient whole (`mesh_cost.mesh_costs`
    takes that one off there). AlexNet-small compiled on one device: 3 moves of each
    kernel, 2 of conv1 (no input gradient), 36 ms of a 145 ms step on one pinned core;
    under data parallelism 2 and 1. 0 where the parameter is no kernel a convolution
    reads against batched data."""
    nbytes, moves = np.zeros(num_params), np.zeros(num_params)
    for op in prog.ops:
        if op.prim == "conv_general_dilated" and len(op.ins) == 2:
            x, w = op.ins
            j = int(owner[w])
            if j >= 0 and batched[x] and moves[j] == 0:
                nbytes[j], moves[j] = float(prog.nbytes[w]), 2.0
    for op in prog.ops:
        if op.prim == "rev" and op.ins:
            j = int(owner[op.ins[0]])
            if j >= 0 and moves[j] > 0:
                moves[j] += 1.0
    return nbytes, moves


def conv_grad_relayouts(prog: FlatProgram, batched: np.ndarray) -> np.ndarray:
    """[ops] the bytes of the batched operands each kernel-gradient convolution reads (a
    convolution of two batched values, the activations and the output's gradient, into
    one that is not, contracting over the batch), 0 for other ops. XLA:CPU's layout
    assignment copies both into the layout its convolution reads them in, the batch as
    the contracted feature (a 3x3 kernel's gradient over f32[16, 8, 8, 32]: f32[32, 8, 8,
    16] and f32[8, 8, 16, 64] copies; ResNet-50-small at batch 64 on one device spent 2.8
    of its 15 ms in them); its dense layers' gradients need no copy."""
    out = np.zeros(len(prog.ops))
    for k, op in enumerate(prog.ops):
        if (op.prim == "conv_general_dilated" and len(op.ins) == 2
                and all(batched[i] for i in op.ins) and not any(batched[o] for o in op.outs)):
            out[k] = float(sum(prog.nbytes[i] for i in op.ins)) * op.repeat
    return out


def dot_relayouts(prog: FlatProgram, batched: np.ndarray) -> np.ndarray:
    """[ops] the bytes XLA:CPU's layout assignment copies into another layout around each
    batched matmul (a `dot_general` with batch dims: attention's heads), 0 for other ops:
    an operand whose batch dims are not its leading dims (`bqhd,bkhd->bhqk` reads both
    operands with the heads behind the sequence), and a transpose of 3 or more dims that
    reorders a batched array a batched matmul makes or reads (the heads split out of q, k
    and v, the attention output merged back), materialized since the matmul is a library
    call. GPT-2-small's one-device step on this CPU: 22 such arrays of the 32 attention
    copies XLA made (1.3 of 2.1 MB); the model had priced none. A dense layer's kernel
    gradient, which contracts the batch, is not one (`DeviceSpec.transposed_matmul_efficiency`
    prices it)."""
    out = np.zeros(len(prog.ops))
    bdot: set[int] = set()   # values a batched matmul makes or reads
    for k, op in enumerate(prog.ops):
        if op.prim != "dot_general":
            continue
        (_, _), (lb, rb) = op.eqn.params["dimension_numbers"]
        if not lb:
            continue
        bdot.update(op.ins)
        bdot.update(op.outs)
        for x, dims in zip(op.ins[:2], (lb, rb), strict=True):
            if tuple(dims) != tuple(range(len(dims))):
                out[k] += float(prog.nbytes[x]) * op.repeat
    for k, op in enumerate(prog.ops):
        if op.prim != "transpose" or not batched[op.outs[0]]:
            continue
        x, shape = op.ins[0], prog.vars[op.ins[0]].shape
        if len(shape) < 3 or not (x in bdot or op.outs[0] in bdot):
            continue
        moved = [p for p in op.eqn.params["permutation"] if shape[p] != 1]
        if moved != sorted(moved):
            out[k] += float(prog.nbytes[x]) * op.repeat
    return out


__all__ = ["batch_dims", "batch_split", "conv_grad_relayouts", "conv_relayouts", "data_reductions",
           "dot_relayouts", "grad_repeat", "partial_sums", "reduced_copies", "relayouts"]
