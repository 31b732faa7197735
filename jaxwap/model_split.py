"""Which activations a tensor-parallel layout splits over the model axis.

Megatron's column-then-row pairing leaves the values between the two layers (the MLP
hidden, the attention heads and their scores) split over the model axis, and their
cotangents in the backward pass. The memory model credits those bytes only when the
layout that splits them is chosen, so the analysis labels each batched value with the
(parameter, kind) whose layout would split it (`model_splits`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .flatten import FlatProgram
from .primitives import MATMUL, batch_rule, default_batch
from .state import ParamInfo

if TYPE_CHECKING:  # the record only: the analysis (graph.py) calls this module
    from .graph import Layer

TP_KINDS = ("col", "row")


@dataclass(frozen=True)
class ModelSplit:
    """Per value, the (parameter, kind) whose tensor-parallel layout splits it over the
    model axis, as an index into `pairs` (-1: none)."""

    label: np.ndarray                 # [values] int
    pairs: tuple[tuple[int, str], ...]
    # per pair, the gcd of the sizes of the dims its split lands on (attention's heads,
    # a GQA model's kv heads, an MLP's hidden): a model axis that does not divide it
    # would split inside a head, which XLA reshuffles with all-to-alls
    granule: tuple[int, ...] = ()


def tp_dims(layers: Sequence[Layer], params: Sequence[ParamInfo], stacked: np.ndarray
             ) -> dict[tuple[int, str], int]:
    """Per (parameter, kind), the parameter dim that kind splits: of the layer's output
    features ("col") or contracted dims ("row"), the largest, the first of equals (the
    dim `solve` splits when the model axis divides them all); never a stacked dim."""
    out: dict[tuple[int, str], int] = {}
    for L in layers:
        shape = params[L.param].shape
        for kind, dims in zip(TP_KINDS, (L.out_dims, L.in_dims), strict=True):
            dims = [x for x in dims if x != stacked[L.param]]
            if dims:
                out[L.param, kind] = max(dims, key=lambda x: (shape[x], -x))
    return out


def model_splits(prog: FlatProgram, kinds: Sequence[str], owner: np.ndarray,
                 perm: Sequence[tuple[int, ...] | None], batched: np.ndarray,
                 layers: Sequence[Layer], params: Sequence[ParamInfo],
                 stacked: np.ndarray) -> ModelSplit:
    """Which values a tensor-parallel layer's layout splits over the model axis (Megatron:
    the activations between a column- and the next row-parallel layer, and in the backward
    pass their cotangents), found by following a split dim forward through the program.

    A matmul that uses a layer's weight (or a cast, transpose or slice of it) seeds one:
    for each kind, the weight dim that kind splits (`tp_dims`) lands in the result, where
    the matmul keeps it (h = x @ W1 when W1 is column-parallel, dh = dy @ W2^T when W2 is
    row-parallel) or is summed away (a partial sum: all-reduced, whole on every device).
    Every op then moves the split dim by its batch rule (`primitives.batch_rule`, the
    rules `comm.batch_dims` follows for the data axis) and drops it where the rule sums
    over it (a contraction, a reduction). Each value keeps one such split: of the
    candidates, the operands' in operand order, then the op's own weight's ("col" before
    "row"), the first the op keeps in a result. So a value two layers' activations meet
    in (SwiGLU's gate * up, attention's q . k) is credited to the first's layout alone.
    Only batched values keep a split (the caller credits batched bytes). Each pair's
    `granule` is the gcd of the sizes of the dims its split lands on (0: none).
    """
    tdim = tp_dims(layers, params, stacked)
    if not tdim:
        return ModelSplit(np.full(len(prog.vars), -1, np.int64), ())
    granule: dict[int, int] = {}
    pair_id: dict[tuple[int, str], int] = {}
    owner, batched = owner.tolist(), batched.tolist()
    label: list[tuple[int, int] | None] = [None] * len(prog.vars)  # (pair, dim)
    for op, kind in zip(prog.ops, kinds, strict=True):
        if not any(batched[o] for o in op.outs):
            continue
        # candidates: pair -> each operand's split dim for that pair
        cands: dict[int, list[int | None]] = {}
        n = len(op.ins)
        for pos, i in enumerate(op.ins):
            lab = label[i]
            if lab is not None:
                cands.setdefault(lab[0], [None] * n)[pos] = lab[1]
        if kind == MATMUL:
            for pos, i in enumerate(op.ins):
                j, pm = owner[i], perm[i]
                if j < 0 or pm is None:
                    continue
                for k in TP_KINDS:
                    pd = tdim.get((j, k))
                    if pd is None or pd not in pm:
                        continue
                    e = pair_id.setdefault((j, k), len(pair_id))
                    cands.setdefault(e, [None] * n)[pos] = pm.index(pd)
        if not cands:
            continue
        rule = batch_rule(op.prim)
        for e, axes in cands.items():
            try:
                outs, _ = rule(op.eqn, axes)
            except Exception:  # noqa: BLE001 - an equation its rule does not expect
                outs, _ = default_batch(op.eqn, axes)
            if any(a is not None for a in outs):
                for o, a in zip(op.outs, outs, strict=True):
                    if a is not None and batched[o]:
                        label[o] = (e, a)
                        size = prog.vars[o].shape[a]
                        if size > 1:
                            granule[e] = math.gcd(granule.get(e, 0), size)
                break
    pairs = tuple(sorted(pair_id, key=pair_id.__getitem__))
    return ModelSplit(np.array([-1 if lab is None else lab[0] for lab in label],
                                dtype=np.int64), pairs,
                      tuple(granule.get(e, 0) for e in range(len(pairs))))


__all__ = ["TP_KINDS", "ModelSplit", "model_splits", "tp_dims"]
