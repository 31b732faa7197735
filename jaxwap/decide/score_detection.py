"""Finding attention that materializes its scores in a step's flat program.

Computed the unfused way (`jax.nn.dot_product_attention` with `implementation=None` or
`"xla"`, or `softmax(q @ k^T) @ v` written out), each attention layer writes its
B x heads x T x S scores to memory, and so do the softmax, its gradient and the matmuls
that read them: time and memory that grow with the square of the sequence.

`attention_sites` finds such attention whatever wrote it: a `dot_general` of two
activations (neither a parameter) whose result, through size-preserving ops, reaches an
`exp` (the softmax) over its last two dims (T queries, S keys) and is contracted with a
third activation (the values). `score_values` grows the *scores* from those products:
every value of the program, forward and backward, with those T and S dims and a multiple
of that many elements that such ops make or read (probabilities, their gradients, a
residual saved for the backward pass); `score_ops` names the ops that make or read them,
with the transposes around their matmuls. Only finding lives here: what the fused kernel
would make of these ops is `decide.fused_counterfactual`, its price
`decide.attention_advice`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxwap.analysis.dataflow import Dataflow
from jaxwap.analysis.flatten import FlatProgram
from jaxwap.analysis.fused_attention import fused_flops, kept_pairs

#: How many size-preserving ops after a score product the softmax's `exp` and the values'
#: matmul may be (casts, the scale, a mask, the max subtracted, the normalization).
_CHAIN = 12
_EXP = ("exp", "exp2")
_MASKING = ("select_n", "add")   # where(mask, scores, -inf); scores + a -inf bias


@dataclass(frozen=True)
class AttentionSite:
    """One attention's forward score product: op `op` makes `pairs` T x S score
    matrices per iteration; `value` is the op contracting them with the values."""

    op: int
    value: int
    q_len: int
    kv_len: int
    pairs: int
    qk_dim: int
    v_dim: int
    masked: bool
    dtype: str
    q_bytes: float
    k_bytes: float
    v_bytes: float
    o_bytes: float
    shape: tuple[int, ...]   # the scores as the softmax takes them

    @property
    def key(self) -> tuple[int, int, int]:
        return self.q_len, self.kv_len, self.pairs

    @property
    def size(self) -> int:
        return self.pairs * self.q_len * self.kv_len

    def fused(self, backward: bool) -> tuple[float, float]:
        """(flops, bytes) of cuDNN's kernel for this attention (`fused_attention.fused_flops`;
        causal where the scores are masked by a static mask), the traffic as the real
        kernel's rule counts it (`fused_attention.fused_cost`)."""
        kept = kept_pairs(self.q_len, self.kv_len, self.masked)
        lse = 4.0 * self.pairs * self.q_len
        io = self.q_bytes + self.k_bytes + self.v_bytes
        traffic = 2 * io + 2 * self.o_bytes + lse if backward else io + self.o_bytes + lse
        return fused_flops(self.pairs, kept, self.qk_dim, self.v_dim, backward), traffic


def attention_sites(prog: FlatProgram, flow: Dataflow, readers: Sequence[list[int]],
                    batch_axis: Sequence[int | None]) -> list[AttentionSite]:
    """Every attention's forward score product in the program, in op order (`_site` on
    each op; `readers`: `readers_of(prog)`, `batch_axis`: where data parallelism splits
    each value, `grad_reductions.batch_split`'s first part)."""
    return [s for k in range(len(prog.ops)) if (s := _site(prog, flow, readers, batch_axis, k))]


def _dep_activation(flow: Dataflow, v: int) -> bool:
    """Whether value v is an activation: computed from the data, and no form of a
    parameter (queries, keys and values are; a weight is not)."""
    return bool(flow.dep[v]) and int(flow.owner[v]) < 0


def _site(prog: FlatProgram, flow: Dataflow, readers: Sequence[list[int]],
          batch_axis: Sequence[int | None], k: int) -> AttentionSite | None:
    """The attention whose score product op k is, or None: op k is a dot_general of two
    activations (queries and keys, in either order), its result reaching, through ops
    that keep its size, an `exp` (the softmax) whose last two dims are a free dim of each
    operand (T of the queries, S of the keys) and not the batch (`batch_axis`, where data
    parallelism splits each value: a contrastive loss's logits pair samples, not
    positions), and a dot_general with a third activation (the values)."""
    op = prog.ops[k]
    if op.prim != "dot_general" or len(op.ins) < 2 or not op.outs:
        return None
    lhs, rhs, out = op.ins[0], op.ins[1], op.outs[0]
    if not (_dep_activation(flow, lhs) and _dep_activation(flow, rhs)):
        return None
    (lc, rc), (lb, rb) = op.eqn.params["dimension_numbers"]
    ls, rs = prog.vars[lhs].shape, prog.vars[rhs].shape
    lfree = [ls[d] for d in range(len(ls)) if d not in lc and d not in lb]
    rfree = [rs[d] for d in range(len(rs)) if d not in rc and d not in rb]
    if not lfree or not rfree:
        return None
    size = int(prog.size[out])
    chain, frontier = {out}, [out]
    exp_in, values, masks = None, [], []
    for _ in range(_CHAIN):
        nxt = []
        for v in frontier:
            for j in readers[v]:
                r = prog.ops[j]
                if r.prim in _MASKING:   # a mask: not computed from data
                    masks += [prog.vars[i].shape for i in r.ins if not flow.dep[i]]
                if r.prim in _EXP and exp_in is None:
                    exp_in = r.ins[0]
                if r.prim == "dot_general" and j != k:
                    other = [i for i in r.ins[:2] if i != v]
                    if other and _dep_activation(flow, other[0]) and other[0] not in chain:
                        values.append(j)
                for o in r.outs:
                    if int(prog.size[o]) == size and o not in chain and flow.dep[o]:
                        chain.add(o)
                        nxt.append(o)
        frontier = nxt
        if not frontier:
            break
    exp_shape = () if exp_in is None else prog.vars[exp_in].shape
    if not values or len(exp_shape) < 2:
        return None
    a = batch_axis[exp_in]
    if a is not None and a >= len(exp_shape) - 2:
        return None
    T, S = exp_shape[-2], exp_shape[-1]
    if T in lfree and S in rfree:
        q, kk = lhs, rhs
    elif S in lfree and T in rfree:
        q, kk = rhs, lhs
    else:
        return None
    value = min(values)   # the forward one (the backward pass reads the scores later)
    pairs = size // (T * S)
    vop = prog.ops[value]
    vin = next(i for i in vop.ins[:2] if i not in chain)
    vout = vop.outs[0]
    masked = any(len(m) >= 2 and tuple(m[-2:]) == (T, S) for m in masks)
    return AttentionSite(k, value, T, S, pairs, int(math.prod(ls[d] for d in lc)),
                 max(1, int(prog.size[vout]) // (pairs * T)), masked,
                 str(prog.vars[q].dtype), float(prog.nbytes[q]), float(prog.nbytes[kk]),
                 float(prog.nbytes[vin]), float(prog.nbytes[vout]), tuple(exp_shape))


def readers_of(prog: FlatProgram) -> list[list[int]]:
    """value -> the ops that read it (each once, however many operands it is), for walking
    the program forward from a score product."""
    out: list[list[int]] = [[] for _ in prog.vars]
    for k, op in enumerate(prog.ops):
        for i in set(op.ins):
            out[i].append(k)
    return out


def score_values(prog: FlatProgram, flow: Dataflow, sites: Sequence[AttentionSite]
                 ) -> tuple[np.ndarray, dict[int, tuple[int, int, int]]]:
    """(values that are scores, value -> its site's key): values of no parameter with the
    T and S dims of a site, connected to a site's scores through the ops that make or
    read them (forward, the backward pass, a scan's stacked residual), grown to a fixed
    point: activations of a multiple of its elements, and the masks built from positions
    (not from data) of a multiple of T x S elements."""
    keys = {s.key: s for s in sites}
    of: dict[int, tuple[int, int, int]] = {}

    def fits(v: int) -> tuple[int, int, int] | None:
        if int(flow.owner[v]) >= 0:
            return None
        shp, n = Counter(prog.vars[v].shape), int(prog.size[v])
        for key, s in keys.items():
            unit = s.size if flow.dep[v] else s.q_len * s.kv_len
            need = Counter((s.q_len, s.kv_len))
            if n % unit == 0 and all(shp[d] >= c for d, c in need.items()):
                return key
        return None

    for s in sites:
        of[prog.ops[s.op].outs[0]] = s.key
    changed = True
    while changed:
        changed = False
        for op in prog.ops:
            vals = (*op.ins, *op.outs)
            if not any(v in of for v in vals):
                continue
            for v in vals:
                if v not in of and (key := fits(v)) is not None:
                    of[v] = key
                    changed = True
    region = np.zeros(len(prog.vars), bool)
    region[list(of)] = True
    return region, of


def score_ops(prog: FlatProgram, readers: Sequence[list[int]], values: np.ndarray
              ) -> np.ndarray:
    """[ops] the ops that make or read the scores (`values`: `score_values`' first part),
    with the transposes around their matmuls: all that cuDNN's kernel stands in for."""
    region = np.array([any(values[v] for v in (*op.ins, *op.outs)) for op in prog.ops])
    region[_relayouts(prog, readers, region)] = True
    return region


_LAYOUT = ("transpose", "reshape", "convert_element_type", "copy", "copy_p")


def _relayouts(prog: FlatProgram, readers: Sequence[list[int]], region: np.ndarray
               ) -> list[int]:
    """The transposes around the score matmuls: of their operands (queries, keys, values,
    an output gradient, past reshapes and casts) into the layout the matmul reads, and of
    their results into the model's. The fused kernel reads and writes the model's layout
    (BTNH) itself."""
    made = {o: k for k, op in enumerate(prog.ops) for o in op.outs}
    found: set[int] = set()
    for k in np.flatnonzero(region).tolist():
        op = prog.ops[k]
        if op.prim != "dot_general":
            continue
        for v in op.ins[:2]:
            j = made.get(v)
            while j is not None and not region[j] and prog.ops[j].prim in _LAYOUT:
                if prog.ops[j].prim == "transpose":
                    found.add(j)
                j = made.get(prog.ops[j].ins[0]) if prog.ops[j].ins else None
        todo = list(op.outs)
        while todo:
            for j in readers[todo.pop()]:
                if not region[j] and prog.ops[j].prim in _LAYOUT and j not in found:
                    if prog.ops[j].prim == "transpose":
                        found.add(j)
                    todo.extend(prog.ops[j].outs)
    return sorted(found)


__all__ = ["AttentionSite", "attention_sites", "readers_of", "score_ops", "score_values"]
