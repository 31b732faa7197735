"""What each operation of the flat program costs: flops, bytes and kernel launches by
jax's own roofline rules (each equation costed once per primitive, shapes and params, so
the identical blocks of a deep model pay once), the transcendental elements it evaluates,
and which convolutions take the backend's slow generic loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxwap.analysis.flatten import FlatProgram, itemsize_of
from jaxwap.analysis.fused_attention import fused_kind
from jaxwap.analysis.primitives import ELEMENTWISE, FREE, MATMUL, prim_info
from jaxwap.analysis.roofline_adapter import RooflineRules

# elementwise primitives a CPU evaluates as a polynomial or series per element, far
# slower than their bytes (`DeviceSpec.transcendental_s`); sqrt and rsqrt are instructions
TRANSCENDENTAL = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "erf", "erfc", "erf_inv",
    "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh",
    "atanh", "pow", "lgamma", "digamma", "cbrt"})


# reductions: on a CPU a mid-sized one is split over the host's thread pool, and the
# split costs more than it saves (`DeviceSpec.reduction_cost`)
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                        "reduce_and", "reduce_or", "argmax", "argmin"})


# pooling windows, which jax's roofline prices at nothing: each output (of a gradient,
# each source element) visits every tap of its window (`window_taps`)
WINDOW_OPS = frozenset({"reduce_window_max", "reduce_window_min", "reduce_window_sum",
                        "reduce_window"})
WINDOW_GRAD_OPS = frozenset({"select_and_scatter_add", "select_and_scatter",
                             "select_and_gather_add"})
_POOLING = WINDOW_OPS | WINDOW_GRAD_OPS


def window_taps(eqn: Any) -> float:
    """The window taps a pooling op visits: its output's elements (a select-and-scatter:
    its source's, the pooled gradient) times its window's size; 0 for another op."""
    if eqn.primitive.name not in _POOLING:
        return 0.0
    each = eqn.invars[0] if eqn.primitive.name.startswith("select_and_scatter") \
        else eqn.outvars[0]
    return float(np.prod(each.aval.shape) * np.prod(eqn.params["window_dimensions"]))


def expanded_pool_grad(eqn: Any) -> float:
    """Bytes a select-and-scatter moves beyond its operands and result where the backend
    expands it (XLA:GPU): an argmax reduce-window reads the operand and writes, for each
    pooled element, its value (f32) and its position (one s32 per dim); a scatter reads
    the positions back and adds the source into the result, which a copy zeroes first.
    Beyond what the op's own operands and result count: 4 + 8 x rank bytes per pooled
    element, and the result's bytes once more. On an H100 here VGG-16's five took 6.8 ms
    a step, 16.9 GB in XLA's program, where the operands and results alone are 3.5 GB
    (gpu_trace/nvidia-h100-80gb-hbm3.md)."""
    if not eqn.primitive.name.startswith("select_and_scatter"):
        return 0.0
    src, out = eqn.invars[0].aval, eqn.outvars[0].aval
    return float(np.prod(out.shape) * itemsize_of(out.dtype)
                 + np.prod(src.shape) * (4 + 8 * len(out.shape)))


@dataclass(frozen=True)
class OpCosts:
    flops: np.ndarray
    bytes: np.ndarray
    kernels: np.ndarray
    is_matmul: np.ndarray
    low_precision: np.ndarray
    unmodeled: tuple[str, ...]
    transcendentals: np.ndarray
    reduced: np.ndarray
    window_taps: np.ndarray        # pooling's forward ops (`window_taps`)
    window_grad_elems: np.ndarray  # its gradients' results' elements
    window_grad_bytes: np.ndarray  # what expanding a gradient adds (`expanded_pool_grad`)
    attention: np.ndarray          # [ops] int8: cuDNN's fused kind (`fused_attention.fused_kind`)


def op_costs(prog: FlatProgram, kinds: Sequence[str], rules: RooflineRules) -> OpCosts:
    """Flops, memory traffic and kernel launches of every op, for the whole step.

    Free ops cost nothing. A fusion of elementwise ops, and of the reductions they feed,
    moves what XLA's fusions move (`_fused_traffic`); a new fusion (a kernel) starts where
    no input comes from another fusible op. A primitive with a cost rule of its own in the
    primitive table (`PrimInfo.cost`: cuDNN's fused attention) is priced by it, the rest by
    jax's roofline rules. An op without either is priced one flop per output element and
    its operands' and results' bytes, and named in `unmodeled`. A matmul is 16-bit when
    its operands are (fused attention: its query, key and value; the float32 log-sum-exp
    it also reads is not what its tensor cores multiply).

    A rule's figures depend only on the equation's primitive, operand and result avals and
    params, so each distinct equation is priced once (the blocks of a deep model repeat).
    """
    n = len(prog.ops)
    # (python lists: fast to index one by one; the sums add the same float64 values)
    size, nbytes, V = prog.size.tolist(), prog.nbytes.tolist(), prog.vars
    flops, traffic, kernels, trans = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    pool, pool_grad, pool_grad_bytes = np.zeros(n), np.zeros(n), np.zeros(n)
    lowp = np.zeros(n, bool)
    fused = np.array([fused_kind(op.eqn) for op in prog.ops], dtype=np.int8)
    fusible = [False] * len(V)  # made by an elementwise or free op
    priced: dict[Any, tuple[float, float] | None] = {}
    unmodeled: set[str] = set()
    for k, (op, kind) in enumerate(zip(prog.ops, kinds, strict=True)):
        if kind == FREE:  # flops[k], traffic[k], kernels[k] stay 0
            for o in op.outs:
                fusible[o] = True
            continue
        rule = prim_info(op.prim).cost or rules.cost
        key = eqn_key(op.eqn)
        if op.prim == "scan_stack":
            # an iteration's output written in place into the stacked ys XLA's loop
            # carries: the slice's bytes, not the whole stack's (priced per iteration)
            cost: tuple[float, float] | None = (0.0, float(nbytes[op.ins[0]]))
        elif key is None:
            cost = rule(op.eqn)
        else:
            cost = priced.get(key, priced)
            if cost is priced:
                cost = priced[key] = rule(op.eqn)
        out_bytes = float(sum(nbytes[o] for o in op.outs))
        taps = window_taps(op.eqn)
        if taps:   # a compare or add per tap; its operands read, its result written
            if op.prim in WINDOW_OPS:
                pool[k] = taps * op.repeat
            else:
                pool_grad[k] = float(sum(size[o] for o in op.outs)) * op.repeat
                pool_grad_bytes[k] = expanded_pool_grad(op.eqn) * op.repeat
            cost = (taps, float(sum(nbytes[i] for i in op.ins)) + out_bytes)
        if cost is None:
            unmodeled.add(op.prim)
            cost = (float(sum(size[o] for o in op.outs)),
                    float(sum(nbytes[i] for i in op.ins)) + out_bytes)
        flops[k] = cost[0] * op.repeat
        if op.prim in TRANSCENDENTAL:
            trans[k] = float(sum(size[o] for o in op.outs)) * op.repeat
        if kind == ELEMENTWISE:   # its traffic is its fusion's share (`_fused_traffic`)
            kernels[k] = 0.0 if any(fusible[i] for i in op.ins) else float(op.repeat)
            for o in op.outs:
                fusible[o] = True
        else:
            traffic[k] = cost[1] * op.repeat
            kernels[k] = float(op.repeat)
            if kind == MATMUL:
                multiplied = op.ins[:3] if fused[k] else op.ins
                lowp[k] = all(itemsize_of(V[i].dtype) <= 2 for i in multiplied)
    is_matmul = np.array([kind == MATMUL for kind in kinds], dtype=bool)
    reductions = np.array([op.prim in REDUCTIONS for op in prog.ops], dtype=bool)
    # what a reduction reads, wherever its input was made: a fusion that ends in a
    # reduction still walks every element it reduces (`DeviceSpec.reduction_cost`)
    reduced = np.array([float(sum(nbytes[i] for i in op.ins)) * op.repeat if red else 0.0
                        for op, red in zip(prog.ops, reductions, strict=True)])
    traffic = _fused_traffic(prog, kinds, traffic, reductions)
    return OpCosts(flops, traffic, kernels, is_matmul, lowp, tuple(sorted(unmodeled)), trans,
                   reduced, pool, pool_grad, pool_grad_bytes, fused)


def _fused_traffic(prog: FlatProgram, kinds: Sequence[str], traffic: np.ndarray,
                   reductions: np.ndarray) -> np.ndarray:
    """The bytes each elementwise op and reduction moves as a member of a fusion: it reads
    the inputs no fusible op made (from memory; a value an elementwise op or a free op of
    such made is in registers) and writes the results something outside a fusion reads
    (a matmul, any other heavy op, the step's outputs; through free ops), and a
    reduction always writes its result. XLA fuses elementwise producers into the
    reduction that reads them; writing every elementwise result and reading it back
    (this model's rule before) counted GPT-2's softmax and cross-entropy at 114 GB a step
    on an H200 where its kernels other than matmuls ran 13 ms (`gpu_sweep.py --trace`,
    2026-11-26): 57 GB by this rule."""
    nb, n = prog.nbytes.tolist(), len(prog.vars)
    fused = [kind == ELEMENTWISE or bool(red) for kind, red in zip(kinds, reductions,
                                                                    strict=True)]
    written = [False] * n   # read from memory by something outside a fusion
    for o in prog.out_ids:
        written[o] = True
    for op, kind, f in zip(reversed(prog.ops), reversed(kinds), reversed(fused), strict=True):
        if kind == FREE:
            if any(written[o] for o in op.outs):
                for i in op.ins:
                    written[i] = True
        elif not f:
            for i in op.ins:
                written[i] = True
    in_registers = [False] * n
    out = traffic.copy()
    for k, (op, kind, f) in enumerate(zip(prog.ops, kinds, fused, strict=True)):
        if kind == FREE:
            made = bool(op.ins) and all(in_registers[i] for i in op.ins)
            for o in op.outs:
                in_registers[o] = made
            continue
        if not f:
            continue
        reads = sum(nb[i] for i in set(op.ins) if not in_registers[i])
        writes = sum(nb[o] for o in op.outs if written[o] or reductions[k])
        out[k] = (reads + writes) * op.repeat
        for o in op.outs:
            in_registers[o] = not reductions[k]
    return out


def eqn_key(eqn: Any) -> Any:
    """What a roofline rule's figures depend on (primitive, avals, params), hashable, or
    None: a synthetic equation, or params that cannot be hashed."""
    try:
        key = (eqn.primitive, tuple(a.aval for a in eqn.invars),
               tuple(v.aval for v in eqn.outvars), tuple(sorted(eqn.params.items())))
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


def unbatched_bytes(prog: FlatProgram, kinds: Sequence[str], traffic: np.ndarray,
                    batched_values: np.ndarray) -> np.ndarray:
    """[ops] the part of each op's traffic that does not shrink when the batch is split:
    the unbatched operands a batched kernel reads (a weight under a matmul) and the
    unbatched results it writes (a weight's gradient), at most its traffic. Every device
    of a data axis moves these whole, and a micro-batched loop once per micro-batch.
    Elementwise ops are priced by their (batched) result alone, and an op touching no
    batched value splits however its parameter does: neither has any."""
    fixed = np.zeros(len(prog.ops))
    nbytes, batched = prog.nbytes.tolist(), batched_values.tolist()
    for k, (op, kind) in enumerate(zip(prog.ops, kinds, strict=True)):
        if kind in (FREE, ELEMENTWISE) or not traffic[k]:
            continue
        vals = (*op.ins, *op.outs)
        if not any(batched[v] for v in vals):
            continue
        fixed[k] = min(traffic[k], op.repeat * sum(nbytes[v] for v in vals if not batched[v]))
    return fixed


#: fewer input channels than this make a convolution narrow (`conv_kind` 3): the width of
#: a tensor-core kernel's channel vector (8 bf16 values, 16 bytes)
NARROW_CHANNELS = 8


def conv_kind(eqn: Any) -> int:
    """0: not a convolution; 1: a convolution; 2: one whose (dilated) window is larger
    than its (dilated, unpadded) input in some spatial dim: a forward or input-gradient
    3x3 convolution over a 1x1 or 2x2 map; 3: a narrow one, over fewer than
    NARROW_CHANNELS input channels (a CNN's first layer over RGB: its forward pass has them
    as its lhs features, its kernel gradient as its lhs batch), or per group for a grouped
    or depthwise one (a ResNeXt's 32 groups of 4), which cuDNN runs at a few percent of its
    rate (`DeviceSpec.narrow_conv_efficiency`): too few to fill a tensor-core tile."""
    if eqn.primitive.name != "conv_general_dilated":
        return 0
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    dn = eqn.params["dimension_numbers"]
    lhs_sp, rhs_sp = dn.lhs_spec[2:], dn.rhs_spec[2:]
    lhs_dil = eqn.params.get("lhs_dilation") or (1,) * len(lhs_sp)
    rhs_dil = eqn.params.get("rhs_dilation") or (1,) * len(rhs_sp)
    for a, b, dl, dr in zip(lhs_sp, rhs_sp, lhs_dil, rhs_dil, strict=True):
        if (rhs[b] - 1) * dr + 1 > (lhs[a] - 1) * dl + 1:
            return 2
    # per group: a grouped (ResNeXt) or depthwise convolution is that many narrow ones
    # side by side (its kernel gradient groups the lhs batch, which then holds channels)
    batch = lhs[dn.lhs_spec[0]] // max(int(eqn.params.get("batch_group_count", 1)), 1)
    feats = lhs[dn.lhs_spec[1]] // max(int(eqn.params.get("feature_group_count", 1)), 1)
    return 3 if min(batch, feats) < NARROW_CHANNELS else 1


def transposed_matmul(eqn: Any) -> bool:
    """Whether a dot_general contracts both operands over a dim that is not their last
    (a dense layer's kernel gradient, x^T dy; attention's scores transposed against the
    values), which no swap of the operands makes a plain matmul: XLA:CPU runs it on its
    generic dot rather than its matmul library (`DeviceSpec.transposed_matmul_efficiency`;
    2026-11-26, XLA:CPU of jax 0.10.2, 1024x256 by 1024x64 over the 1024: 38-58 Gflop/s
    on 2 cores where the same work as x @ w ran 110-165)."""
    if eqn.primitive.name != "dot_general":
        return False
    (lc, rc), _ = eqn.params["dimension_numbers"]
    ls, rs = (len(v.aval.shape) for v in eqn.invars[:2])
    return bool(lc) and ls - 1 not in lc and rs - 1 not in rc


def conv_width(eqn: Any) -> int:
    """The input feature count of a convolution (its lhs feature dim), 0 for another op:
    a generic convolution loop's rate depends on it (how its rows sit in cache)."""
    if eqn.primitive.name != "conv_general_dilated":
        return 0
    lhs = eqn.invars[0].aval.shape
    return int(lhs[eqn.params["dimension_numbers"].lhs_spec[1]])


def conv_out_width(eqn: Any) -> int:
    """The output feature count of a convolution (its kernel's output feature dim), 0 for
    another op: with `conv_width`, the kernel's two feature counts."""
    if eqn.primitive.name != "conv_general_dilated":
        return 0
    rhs = eqn.invars[1].aval.shape
    return int(rhs[eqn.params["dimension_numbers"].rhs_spec[0]])


__all__ = ["NARROW_CHANNELS", "REDUCTIONS", "TRANSCENDENTAL", "OpCosts", "conv_kind",
           "conv_out_width", "conv_width", "eqn_key", "op_costs", "unbatched_bytes"]
