"""Which elementwise results XLA keeps in a buffer of their own.

The memory model fuses elementwise chains (`liveness`): a result that only elementwise
ops read is recomputed inside each reader's fusion, and what it was computed from stays
live instead. XLA fuses a producer into its consumers that way only where duplicating it
into every one of them costs nothing worth avoiding (`InstructionFusion`'s rules, which
XLA:CPU and XLA:GPU share):

- an *expensive* producer (a float divide, exp, log, tanh, logistic, rsqrt, pow: jax's
  names in `EXPENSIVE`) is not duplicated: read by more than one op, it is computed once
  and kept;
- a producer that reads more than one full-size operand (the residual stream's
  `x + attention(x)`, a gated MLP's `silu(a) * b`) is not duplicated either, since every
  copy would read all of them again (`EffectivelyAtMostUnary` and the operand-bytes test
  of `ComputeGloballyUnfusible`), unless every reader can fuse it, which a reader in the
  backward pass, far from the forward one, does not;
- and what a differentiated `jax.checkpoint` reads from outside it (a checkpointed
  layer's saved input) passes through the optimization barrier jax puts on it, which no
  fusion crosses, on every backend.

Without this, the model kept a deep unrolled model's residual stream as the union of
every earlier layer's outputs (each a root of the next layer's input): under full
per-layer remat it held 2.3x a layer's input for each layer where XLA keeps one, and as
written it missed the softmax's and the gate's values the backward pass reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxwap.analysis.flatten import FlatProgram
from jaxwap.analysis.primitives import ELEMENTWISE

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
    full-size operands that together outweigh the result; or read inside a
    differentiated checkpoint (`FlatOp.region`) from outside it."""
    nv = len(prog.nbytes)
    readers = np.zeros(nv, dtype=np.int64)
    made_by = [""] * nv
    made_in = [-1] * nv
    kept = np.zeros(nv, dtype=bool)
    for op in prog.ops:
        for i in set(op.ins):
            readers[i] += 1
            if op.region >= 0 and made_in[i] != op.region:
                kept[i] = True
        for o in op.outs:
            made_by[o] = op.prim
            made_in[o] = op.region
    size, nbytes = prog.size, prog.nbytes
    for op, kind in zip(prog.ops, kinds, strict=True):
        if kind != ELEMENTWISE or not op.outs:
            continue
        shared = [o for o in op.outs if readers[o] > 1]
        if not shared:
            continue
        if op.prim in EXPENSIVE and not _cheap_divide(op.prim, op.ins, size, made_by):
            kept[shared] = True
            continue
        full = [i for i in set(op.ins) if size[i] >= size[op.outs[0]] and size[i] > 1
                and made_by[i] not in _SPREAD]
        if len(full) > 1 and sum(nbytes[i] for i in full) > nbytes[op.outs[0]]:
            kept[shared] = True
    return kept


def _cheap_divide(prim: str, ins: Sequence[int], size: np.ndarray,
                  made_by: Sequence[str]) -> bool:
    """A divide by a scalar or a broadcast scalar, which XLA's simplifier turns into a
    multiply by its reciprocal (a cheap op) before fusion."""
    return (prim == "div" and len(ins) == 2
            and (size[ins[1]] == 1 or made_by[ins[1]] in _SPREAD))
