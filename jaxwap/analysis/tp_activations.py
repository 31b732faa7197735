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

from jaxwap.analysis.batch_rules import batch_rule, default_batch
from jaxwap.analysis.flatten import FlatOp, FlatProgram
from jaxwap.analysis.primitives import MATMUL
from jaxwap.analysis.roles import ParamInfo

if TYPE_CHECKING:  # the record only: the analysis (graph.py) calls this module
    from jaxwap.analysis.op_splits import Layer

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
    # the pairs whose split dim a split or slice cuts into parts (a fused q/k/v weight's
    # output split into q, k and v): the parts do not fall on the devices' blocks, and
    # XLA reshuffles them (a collective-permute forward, all-to-alls backward)
    cut: frozenset[int] = frozenset()


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
    Every op then moves the split dim by its batch rule (`batch_rules.batch_rule`, the
    rules `grad_reductions.batch_dims` follows for the data axis) and drops it where the rule sums
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
    cut: set[int] = set()
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
        if op.prim in ("split", "slice"):
            cut.update(e for e, axes in cands.items() if _cuts(op, axes[0]))
        for e, axes in cands.items():
            outs = _moved(op, axes)
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
                      tuple(granule.get(e, 0) for e in range(len(pairs))), frozenset(cut))


def _moved(op: FlatOp, axes: Sequence[int | None]) -> Sequence[int | None]:
    """Where the op puts a split dim of its operands (`axes`, None: not split) in each of
    its results, by its batch rule (`batch_rules.batch_rule`)."""
    try:
        outs, _ = batch_rule(op.prim)(op.eqn, axes)
    except Exception:  # noqa: BLE001 - an equation its rule does not expect
        outs, _ = default_batch(op.eqn, axes)
    return outs


def _cuts(op: FlatOp, dim: int | None) -> bool:
    """Whether a split or slice cuts its operand's `dim` into less than the whole."""
    if dim is None:
        return False
    if op.prim == "split":
        return op.eqn.params["axis"] == dim and len(op.eqn.params["sizes"]) > 1
    p = op.eqn.params
    return p["limit_indices"][dim] - p["start_indices"][dim] < op.eqn.invars[0].aval.shape[dim]


def column_leaks(prog: FlatProgram, kinds: Sequence[str], owner: np.ndarray,
                 perm: Sequence[tuple[int, ...] | None], layers: Sequence[Layer],
                 params: Sequence[ParamInfo], stacked: np.ndarray) -> frozenset[int]:
    """The parameters whose column split reaches the matmuls of more than one other layer.

    A Megatron column layer's split ends at its row partner (the MLP's hidden at the
    down projection, attention's heads at the scores and the output projection). A
    column split of a layer that writes the residual stream (an attention or MLP output
    projection) reaches every layer after it, and XLA's partitioner then keeps the
    stream split by feature for the rest of the network, gathering and all-reducing
    around every layer (GPT-2, 8 devices: 7.5 GB of collectives where the chain prices
    0.6). Each column layer's split is followed forward on its own (a bit per layer, so
    one layer's split does not hide another's, as `model_splits`' one label per value
    does) through every op but a matmul, which ends every split it reads (the readers
    are counted there) and starts its own weight's where the split dim lands in its
    result. A split that a reduction sums away is kept: the test errs towards a leak,
    which only withholds a layout."""
    tdim = tp_dims(layers, params, stacked)
    cols = {j: d for (j, k), d in tdim.items() if k == "col"}
    if not cols:
        return frozenset()
    bit = {j: 1 << b for b, j in enumerate(cols)}
    of_bit = list(cols)             # the column layer of each bit
    owner_l = owner.tolist()
    carried = [0] * len(prog.vars)
    readers: dict[int, set[int]] = {j: set() for j in cols}
    for op, kind in zip(prog.ops, kinds, strict=True):
        mask = 0
        for i in op.ins:
            mask |= carried[i]
        if kind != MATMUL:
            if mask:
                for o in op.outs:
                    carried[o] |= mask
            continue
        # the weights this matmul applies forward (a column layer's split dim lands in
        # the result: y = x @ W, not the backward pass's dx = dy @ W^T, which reads the
        # cotangents of every value the forward pass used), and where its own split lands
        forward: set[int] = set()
        n = len(op.ins)
        for pos, i in enumerate(op.ins):
            j, pm = owner_l[i], perm[i]
            if j < 0 or pm is None:
                continue
            if j not in cols:
                forward.add(j)      # no column split to tell the direction by: counted
                continue
            if cols[j] not in pm:
                continue
            axes: list[int | None] = [None] * n
            axes[pos] = pm.index(cols[j])
            for o, a in zip(op.outs, _moved(op, axes), strict=True):
                if a is not None:
                    carried[o] |= bit[j]
                    forward.add(j)
        while mask:     # each column split this matmul reads, by its set bit
            low = mask & -mask
            j = of_bit[low.bit_length() - 1]
            readers[j].update(forward - {j})
            mask ^= low
    return frozenset(j for j, r in readers.items() if len(r) > 1)


def op_model_splits(prog: FlatProgram, split: ModelSplit, batched: np.ndarray,
                    tp_param: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per op, the (parameter, kind index) whose tensor-parallel layout splits its
    result over the model axis (`Graph.tp_op_param`): the label of the value it makes,
    for a batched op (`batched`) that no layer's matmul already splits (`tp_param` -1);
    (-1, -1) else."""
    n = len(prog.ops)
    param = np.full(n, -1, np.int64)
    kind = np.full(n, -1, np.int64)
    for k, op in enumerate(prog.ops):
        if not op.outs or not batched[k] or tp_param[k] >= 0:
            continue
        e = int(split.label[op.outs[0]])
        if e >= 0:
            j, name = split.pairs[e]
            param[k], kind[k] = j, TP_KINDS.index(name)
    return param, kind


__all__ = ["TP_KINDS", "ModelSplit", "column_leaks", "model_splits", "op_model_splits",
           "tp_dims"]
