"""Live bytes at every point of the flat program, in buckets a memory plan scales.

A candidate plan shards each bucket differently (batched values over the data axis, a
parameter's values however that parameter is placed), so the walk keeps the live bytes
split into buckets: batched, other, and per parameter one column for each of four value
classes a memory plan can place differently. A candidate's peak memory is then one
matrix-vector product over the rows kept.

It models XLA's fusion: elementwise chains are fused (their intermediates are not
materialised, the chain keeps its inputs alive instead) and layout-only ops are aliases
of their operand.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .flatten import FlatOp
from .primitives import ELEMENTWISE, FREE, HEAVY, MATMUL
from .state import PARAM, LeafRole

# Classes of a parameter's own values (columns of Graph.live after batched and other).
WEIGHT, GRAD, OPT, RESIDENT = range(4)
NUM_CLASSES = 4


def value_classes(ops: Sequence[FlatOp], in_ids: Sequence[int],
                  in_roles: Sequence[LeafRole], out_ids: Sequence[int],
                  out_roles: Sequence[LeafRole], owner: np.ndarray,
                  dep: np.ndarray) -> np.ndarray:
    """The class of every value a parameter owns (WEIGHT, GRAD, OPT, RESIDENT).

    Inputs: the parameter itself is WEIGHT, a mirror (optimizer moment) RESIDENT. A value
    computed from optimizer state is OPT (moment updates, the update itself); one computed
    from data or from a gradient is GRAD (dW = x^T dy, its square for Adam); the rest
    (casts and transposes of the weight) WEIGHT. Outputs take their role's class, so the
    new weight is WEIGHT and the new moments RESIDENT.
    """
    cls = np.full(len(owner), WEIGHT, np.int64)
    for i, r in zip(in_ids, in_roles, strict=True):
        if r.kind == PARAM and r.mirror:
            cls[i] = RESIDENT
    for op in ops:
        owned_in = [cls[i] for i in op.ins if owner[i] >= 0]
        if any(c in (OPT, RESIDENT) for c in owned_in):
            c = OPT
        elif GRAD in owned_in or any(dep[i] for i in op.ins):
            c = GRAD
        else:
            c = WEIGHT
        for o in op.outs:
            cls[o] = c
    for o, r in zip(out_ids, out_roles, strict=True):
        if r.kind == PARAM:
            cls[o] = RESIDENT if r.mirror else WEIGHT
    return cls


def liveness(ops: Sequence[FlatOp], kinds: Sequence[str], in_ids: Sequence[int],
             out_ids: Sequence[int], nbytes: np.ndarray, batched: np.ndarray,
             owner: np.ndarray, vclass: np.ndarray, num_params: int) -> np.ndarray:
    """Live bytes per program point, in buckets [batched, other, then (class, param)].

    Row 0 is before the first op; inputs are live from it, outputs to the end. `nbytes`
    is what a value takes in device memory (0 for one in host memory).
    """
    nv, n, P = len(nbytes), len(ops), num_params
    consumers_heavy = np.zeros(nv, bool)
    for op, kind in zip(ops, kinds, strict=True):
        if kind in (MATMUL, HEAVY):
            consumers_heavy[op.ins] = True
    consumers_heavy[list(out_ids)] = True
    materialized = np.zeros(nv, bool)
    materialized[list(in_ids)] = True
    roots: dict[int, frozenset[int]] = {}
    start = np.full(nv, -1, np.int64)
    last = np.full(nv, -2, np.int64)
    produced = np.zeros(nv, bool)
    produced[list(in_ids)] = True
    for k, (op, kind) in enumerate(zip(ops, kinds, strict=True)):
        used: set[int] = set()
        for i in op.ins:
            if not produced[i]:  # a literal or constant: materialized at its first use
                produced[i] = materialized[i] = True
                start[i] = k
            used |= roots.get(i, {i})
        for r in used:
            last[r] = max(last[r], k)
        for o in op.outs:
            produced[o] = True
            if kind == FREE and op.ins:
                roots[o] = frozenset(roots.get(op.ins[0], {op.ins[0]}))
            elif kind == ELEMENTWISE and not consumers_heavy[o]:
                roots[o] = frozenset(used) if used else frozenset({o})
                if not used:
                    materialized[o] = True
                    start[o] = k
            else:
                materialized[o] = True
                start[o] = k
    for o in out_ids:
        for r in roots.get(o, {o}):
            last[r] = n
            materialized[r] = True
    cols = np.where(batched, 0, np.where(owner >= 0, 2 + vclass * P + owner, 1))
    diff = np.zeros((n + 3, 2 + NUM_CLASSES * P))
    mat = np.flatnonzero(materialized)
    s = np.maximum(start[mat], -1) + 1          # shift: point 0 is "before the first op"
    e = np.maximum(last[mat], start[mat]) + 1
    np.add.at(diff, (s, cols[mat]), nbytes[mat])
    np.add.at(diff, (e + 1, cols[mat]), -nbytes[mat])
    return prune(np.cumsum(diff, axis=0)[: n + 2])


def prune(live: np.ndarray) -> np.ndarray:
    """Drop program points another point dominates in every bucket: with non-negative
    per-bucket weights they can never be the peak, and fewer rows make every candidate's
    peak cheaper to evaluate."""
    for _ in range(8):
        if len(live) < 3:
            return live
        le_next = np.all(live[:-1] <= live[1:], axis=1)
        keep = np.ones(len(live), bool)
        keep[:-1] &= ~le_next
        eq_prev = np.all(live[1:] == live[:-1], axis=1)
        le_prev = np.all(live[1:] <= live[:-1], axis=1) & ~eq_prev
        keep[1:] &= ~le_prev
        if keep.all():
            return live
        live = live[keep]
    return live
