"""Which elementwise results XLA keeps in a buffer of their own.

The memory model fuses elementwise chains (`liveness`): a result that only elementwise
ops read is recomputed inside each reader's fusion, and what it was computed from stays
live instead. XLA's `InstructionFusion` (the pass XLA:CPU runs) duplicates a producer
into its readers that way only where that costs nothing worth avoiding:

- an *expensive* producer (a float divide, exp, log, tanh, logistic, rsqrt, pow: jax's
  names in `EXPENSIVE`) read by more than one op is computed once and kept
  (`ShouldFuse`: "expensive producer would be duplicated");
- a producer that reads more than one operand of its size (the residual stream's
  `x + attention(x)`, a gated MLP's `silu(a) * b`) is not duplicated either, since every
  copy would read them all again (`EffectivelyAtMostUnary` and the operand-size test of
  `ComputeGloballyUnfusible`), unless every reader can fuse it, which the backward
  pass's readers, matmuls among them, do not;
- and what a differentiated `jax.checkpoint` reads from outside it (a checkpointed
  layer's saved input) passes through the optimization barrier jax puts on it, which no
  fusion crosses on any backend.

XLA:GPU's priority fusion fuses a producer into all its readers or none, weighing the
duplication with its cost model; these rules are checked against XLA:CPU only
(`tests/test_fused_values.py`). Without them the model held a deep unrolled model's
residual stream as the union of every earlier layer's outputs (each a root of the next
layer's input): under full per-layer remat 2.3x a layer's input for each layer where XLA
keeps one; and as written it under-counted an unrolled decoder by a third against XLA:CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxwap.analysis.flatten import FlatProgram
from jaxwap.analysis.primitives import ELEMENTWISE, FREE

# jax's names of the elementwise primitives XLA prices as expensive (`IsExpensive`): it
# does not duplicate them into several consumers. (A float divide by a constant is
# rewritten as a multiply first: `_cheap_divide`.)
EXPENSIVE = frozenset({
    "div", "rem", "exp", "exp2", "expm1", "log", "log1p", "logistic", "pow", "rsqrt",
    "sqrt", "cbrt", "tan", "tanh", "atan2", "erf", "erfc", "erf_inv", "lgamma", "digamma",
    "igamma", "igammac", "bessel_i0e", "bessel_i1e", "asin", "acos", "atan", "sinh",
    "cosh", "asinh", "acosh", "atanh"})
# producers whose result XLA reads as a broadcast or an iota: not a full operand
_SPREAD = frozenset({"broadcast_in_dim", "iota"})


def kept_whole(prog: FlatProgram, kinds: Sequence[str]) -> np.ndarray:
    """[values] bool: results XLA does not fuse into all their readers, so they are
    materialized where the model would otherwise recompute them from their roots:
    read by two or more ops, and computed by an expensive op or from two or more
    operands of its size (not broadcasts, iotas or scalars); or read inside a
    differentiated checkpoint (`FlatOp.region`) from outside it."""
    nv = len(prog.nbytes)
    readers = np.zeros(nv, dtype=np.int64)
    made_by = [""] * nv
    made_in = [-1] * nv
    kept = np.zeros(nv, dtype=bool)
    alias = list(range(nv))     # a layout-only op's result: the value it is a view of
    for op, kind in zip(prog.ops, kinds, strict=True):
        if kind == FREE and op.ins:
            for o in op.outs:
                alias[o] = alias[op.ins[0]]
        else:
            for i in {alias[i] for i in op.ins}:
                readers[i] += 1     # (through any views: each reader is one)
        for i in op.ins:
            if op.region >= 0 and made_in[i] != op.region:
                kept[alias[i]] = True
        for o in op.outs:
            made_by[o] = op.prim
            made_in[o] = op.region
    size = prog.size
    for op, kind in zip(prog.ops, kinds, strict=True):
        if kind != ELEMENTWISE or not op.outs:
            continue
        shared = [o for o in op.outs if readers[o] > 1]
        if not shared:
            continue
        if op.prim in EXPENSIVE and not _cheap_divide(op.prim, op.ins, size, made_by):
            kept[shared] = True
            continue
        # (two operands of the result's size outweigh it: XLA's operand-size test holds)
        full = [i for i in {alias[i] for i in op.ins} if size[i] >= size[op.outs[0]]
                and size[i] > 1 and made_by[i] not in _SPREAD]
        if len(full) > 1:
            kept[shared] = True
    return kept


def _cheap_divide(prim: str, ins: Sequence[int], size: np.ndarray,
                  made_by: Sequence[str]) -> bool:
    """A divide by a scalar or a broadcast scalar, which XLA's simplifier turns into a
    multiply by its reciprocal (a cheap op) before fusion."""
    return (prim == "div" and len(ins) == 2
            and (size[ins[1]] == 1 or made_by[ins[1]] in _SPREAD))
