"""Live bytes at every point of the flat program, in buckets a memory plan scales.

A candidate plan shards each bucket differently (batched values over the data axis, a
parameter's values however that parameter is placed), so the walk keeps the live bytes
split into buckets: batched, other, and per parameter one column for each of four value
classes a memory plan can place differently, a fifth for what an FSDP layout gathers
whole (WHOLE) and a sixth for the copy XLA's combined gradient all-reduce writes
(REDUCED). A candidate's peak memory is then one matrix-vector product over the rows
kept.

It models XLA's fusion and buffer assignment: elementwise chains are fused (their
intermediates are not materialised, the chain keeps its inputs alive instead) but for
what XLA keeps whole (`fusion.kept_whole`), a fused chain's result takes over the buffer
of an operand of its size that nothing reads after it (`_share_buffers`), and layout-only
ops (casts too) alias their operand, but where a matmul reads one of a fused chain: the
fusion writes it, at its own dtype (a norm's f32 output cast to bf16 for a matmul)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import scipy.sparse

from jaxwap.analysis.dataflow import Dataflow
from jaxwap.analysis.flatten import FlatOp, FlatProgram
from jaxwap.analysis.fusion import kept_whole
from jaxwap.analysis.live_matrix import LiveRows
from jaxwap.analysis.primitives import ELEMENTWISE, FREE, HEAVY, MATMUL
from jaxwap.analysis.roles import BATCH, PARAM, LeafRole
from jaxwap.analysis.tp_activations import ModelSplit

if TYPE_CHECKING:
    from jaxwap.analysis.op_splits import Layer

# Classes of a parameter's own values (columns of Graph.live after batched and other).
# WHOLE and REDUCED hold no value of the program: what an FSDP layout gathers whole for a
# while, and the all-reduced copy of a gradient (`whole` and `reduced` of `liveness`).
WEIGHT, GRAD, OPT, RESIDENT, WHOLE, REDUCED = range(6)
NUM_CLASSES = 6


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
    cls = [WEIGHT] * len(owner)  # (python lists: fast to index one by one)
    owned, data = (owner >= 0).tolist(), np.asarray(dep, dtype=bool).tolist()
    for i, r in zip(in_ids, in_roles, strict=True):
        if r.kind == PARAM and r.mirror:
            cls[i] = RESIDENT
    for op in ops:
        owned_in = [cls[i] for i in op.ins if owned[i]]
        if OPT in owned_in or RESIDENT in owned_in:
            c = OPT
        elif GRAD in owned_in or any(data[i] for i in op.ins):
            c = GRAD
        else:
            c = WEIGHT
        for o in op.outs:
            cls[o] = c
    for o, r in zip(out_ids, out_roles, strict=True):
        if r.kind == PARAM:
            cls[o] = RESIDENT if r.mirror else WEIGHT
    return np.array(cls, dtype=np.int64)


def gathered_whole(ops: Sequence[FlatOp], nbytes: np.ndarray, layers: Sequence[Layer],
                   tp_param: np.ndarray, value_owner: np.ndarray, stacked: np.ndarray
                   ) -> list[tuple[int, int, int, float]]:
    """(first op, last op, parameter, bytes) of what a layer's weight is gathered to where
    FSDP gathers it (the WHOLE class: `Strategy.divisors`, `layout_memory`): XLA gathers
    it where the forward pass first uses it and the backward pass reads that gather, so
    the whole weight (as the matmuls read it) is live from its first batched use
    (`tp_param`) to its last; and each weight gradient a batched op makes (a value the
    parameter owns: `value_owner`, not the op's owner, which a forward or input-gradient
    matmul shares with its weight operand while its result is batched activations) is
    whole where it is made, before it is reduced. A scanned layer's weight (`stacked`) is
    gathered a slice per iteration: left out. (A 4096 x 4096 FSDP layer on a 4x1 mesh:
    XLA's memory 201 MB, the model 95 MB without these.)

    Uses inside a differentiated `jax.checkpoint` (`FlatOp.region`: a checkpointed layer's
    recomputation and gradient) read the weight through that checkpoint's optimization
    barrier, a value of its own, which XLA gathers again there: each such region holds
    its own gather, from its first use to its last, and the uses outside any share one.
    An unrolled model checkpointed block by block then holds one layer's gathered weights
    at a time in its backward pass, not every layer's from the forward pass on."""
    out: list[tuple[int, int, int, float]] = []
    regions = np.array([op.region for op in ops], dtype=np.int64)
    for L in layers:
        if stacked[L.param] >= 0:
            continue
        ks = np.flatnonzero(tp_param == L.param)
        for r in np.unique(regions[ks]).tolist():
            kr = ks[regions[ks] == r]
            out.append((int(kr.min()), int(kr.max()), L.param, float(L.weight_bytes)))
        out += [(k, k, L.param, float(nbytes[ops[k].outs[0]])) for k in ks.tolist()
                if ops[k].outs and value_owner[ops[k].outs[0]] == L.param]
    return out


def liveness(ops: Sequence[FlatOp], kinds: Sequence[str], in_ids: Sequence[int],
             held: Sequence[int], nbytes: np.ndarray, batched: np.ndarray,
             owner: np.ndarray, vclass: np.ndarray, num_params: int,
             extra: np.ndarray | None = None, extra_keys: Sequence[Any] = (),
             whole: Sequence[tuple[int, int, int, float]] = (),
             reduced: Sequence[tuple[int, int, int, float]] = (),
             kept: np.ndarray | None = None
             ) -> tuple[np.ndarray | LiveRows, list[int]]:
    """Live bytes per program point, in buckets [batched, other, then (class, param), then
    one per extra bucket that holds some bytes] (held as its changes from row to row
    where `live_rows` gives them), and those extra buckets (indices into `extra_keys`,
    in the order of their keys).

    Row 0 is before the first op; inputs live from it, `held` (outputs, batch) to the end. `nbytes`
    is what a value takes in device memory (0 for one in host memory). A batched value
    whose `extra` is e >= 0 goes to extra bucket e instead of the batched one (a bucket a
    memory plan weighs apart: bytes a tensor-parallel layout also splits); of the
    `len(extra_keys)` extra buckets only those some value occupies get a column, so the
    matrix is built at its final width rather than cut down from all of them. `whole`
    adds (first op, last op, parameter, bytes) to that parameter's WHOLE bucket from
    before the first op to after the last: bytes no value of the program holds;
    `reduced` likewise to the REDUCED bucket (`grad_reductions.reduced_copies`). Every
    bucket's weight is non-negative, so pruning the points another dominates in every
    bucket stays exact. `kept`: the results XLA does not fuse into their readers.
    """
    nv, n, P = len(nbytes), len(ops), num_params
    # (python lists: fast to index one by one)
    consumers_heavy = [False] * nv
    for op, kind in zip(ops, kinds, strict=True):
        if kind in (MATMUL, HEAVY):
            for i in op.ins:
                consumers_heavy[i] = True
    materialized, produced, fused = [False] * nv, [False] * nv, [False] * nv
    for i in [*held, *([] if kept is None else np.flatnonzero(kept).tolist())]:
        consumers_heavy[i] = True   # (outputs, and what XLA keeps whole: materialized)
    for i in in_ids:
        materialized[i] = produced[i] = True
    roots: dict[int, frozenset[int]] = {}
    start = [-1] * nv
    last = [-2] * nv
    for k, (op, kind) in enumerate(zip(ops, kinds, strict=True)):
        used: set[int] = set()
        for i in op.ins:
            if not produced[i]:  # a literal or constant: materialized at its first use
                produced[i] = materialized[i] = True
                start[i] = k
            used |= roots.get(i, {i})
        for r in used:
            last[r] = k  # (k only grows)
        for o in op.outs:
            produced[o] = True
            if kind == FREE and op.ins and not (consumers_heavy[o] and fused[op.ins[0]]):
                roots[o] = frozenset(roots.get(op.ins[0], {op.ins[0]}))
                fused[o] = fused[op.ins[0]]
            elif kind == ELEMENTWISE and not consumers_heavy[o] and used:
                roots[o], fused[o] = frozenset(used), True
            else:   # (a view a matmul reads of a fused chain: the fusion writes it)
                materialized[o], start[o] = True, k
    for o in held:
        for r in roots.get(o, {o}):
            last[r] = n
            materialized[r] = True
    _share_buffers(ops, kinds, roots, start, last, materialized, nbytes)
    start, last = np.array(start, dtype=np.int64), np.array(last, dtype=np.int64)
    materialized = np.array(materialized, dtype=bool)
    base = 2 + NUM_CLASSES * P
    mat = np.flatnonzero(materialized)
    used: list[int] = []
    first: Any = 0
    if extra is not None:
        held = np.unique(extra[mat][batched[mat] & (extra[mat] >= 0) & (nbytes[mat] > 0)])
        used = sorted(held.tolist(), key=lambda e: extra_keys[e])
        column = np.full(max(len(extra_keys), 1), -1, dtype=np.int64)
        column[used] = base + np.arange(len(used))
        # an extra bucket no value occupies (nothing there) keeps its bytes batched
        first = np.where(extra >= 0, column[np.maximum(extra, 0)], 0)
        first = np.where(first >= 0, first, 0)
    cols = np.where(batched, first, np.where(owner >= 0, 2 + vclass * P + owner, 1))
    s = np.maximum(start[mat], -1) + 1          # shift: point 0 is "before the first op"
    e = np.maximum(last[mat], start[mat]) + 1
    w = np.array([(*x, WHOLE) for x in whole] + [(*x, REDUCED) for x in reduced],
                 dtype=np.float64).reshape(-1, 5)
    live, _ = live_rows(n + 2, np.concatenate([s, w[:, 0].astype(np.int64) + 1]),
                              np.concatenate([e + 1, w[:, 1].astype(np.int64) + 2]),
                              np.concatenate([cols[mat], 2 + w[:, 4].astype(np.int64) * P
                                              + w[:, 2].astype(np.int64)]),
                              np.concatenate([nbytes[mat], w[:, 3]]), base + len(used))
    return live, used


@dataclass(frozen=True)
class StepMemory:
    """`step_memory`'s answer: what `Graph` keeps of the step's memory."""

    live: np.ndarray | LiveRows
    op_class: np.ndarray
    resident_bytes: np.ndarray
    tp_live_param: np.ndarray
    tp_live_kind: tuple[str, ...]


def step_memory(prog: FlatProgram, kinds: Sequence[str], flow: Dataflow,
                in_roles: Sequence[LeafRole], out_roles: Sequence[LeafRole],
                num_params: int, split: ModelSplit,
                whole: Sequence[tuple[int, int, int, float]] = (),
                reduced: Sequence[tuple[int, int, int, float]] = ()) -> StepMemory:
    """Live device bytes per program point in buckets, the class of what each op makes,
    and each parameter's resident optimizer state (its mirrors among the inputs), which a
    memory plan may shard or offload apart from the weight. The batch is never donated:
    XLA keeps its entry buffers to the end, as it keeps the outputs, past their last read.

    A batched value a tensor-parallel layout splits (`tp_activations.model_splits`) goes to its
    (parameter, kind)'s column after the per-class ones instead of the batched column;
    only the (parameter, kind) pairs that hold some bytes get a column, in the order of
    parameter, then kind."""
    vclass = value_classes(prog.ops, prog.in_ids, in_roles, prog.out_ids, out_roles,
                           flow.owner, flow.dep)
    device_bytes = np.where(prog.on_host, 0.0, prog.nbytes)
    label = np.where(flow.batched, split.label, -1)
    batch = [i for i, r in zip(prog.in_ids, in_roles, strict=True) if r.kind == BATCH]
    live, used = liveness(prog.ops, kinds, prog.in_ids, [*prog.out_ids, *batch],
                                   device_bytes, flow.batched, flow.owner, vclass, num_params,
                                   label, split.pairs, whole, reduced, kept_whole(prog, kinds))
    pairs = [split.pairs[e] for e in used]
    resident = np.zeros(num_params)
    for i, r in zip(prog.in_ids, in_roles, strict=True):
        if r.kind == PARAM and r.mirror:
            resident[r.param] += prog.nbytes[i]
    op_class = np.array([vclass[op.outs[0]] if op.outs else WEIGHT for op in prog.ops],
                        dtype=np.int64)
    return StepMemory(live, op_class, resident,
                      np.array([j for j, _ in pairs], dtype=np.int64), tuple(k for _, k in pairs))


def _share_buffers(ops: Sequence[FlatOp], kinds: Sequence[str],
                   roots: dict[int, frozenset[int]], start: list[int], last: list[int],
                   materialized: list[bool], nbytes: np.ndarray) -> None:
    """Elementwise results written over an operand's buffer, as XLA's buffer assignment
    writes a loop fusion's result into an operand of its size that nothing reads after it
    (the state the step is donated included: Adam's new moment where the old one was).
    Such an operand's life ends where the fused op starts (`last` is moved back), so the
    two are not counted live together: AlexNet-small on one device peaked at 413 MB in
    its 64 MiB fc7's update (old and new moment, gradient and weight) where XLA allocates
    354 MB. One result per operand buffer."""
    size = nbytes.tolist()
    taken: set[int] = set()
    for k, (op, kind) in enumerate(zip(ops, kinds, strict=True)):
        if kind != ELEMENTWISE:
            continue
        for o in op.outs:
            if not materialized[o] or start[o] != k or size[o] <= 0:
                continue
            fed: set[int] = set()
            for i in op.ins:
                fed |= roots.get(i, {i})
            free = sorted(r for r in fed if materialized[r] and last[r] == k
                          and r not in taken and size[r] == size[o])
            if free:
                r = free[0]
                taken.add(r)
                last[r] = k - 1


def live_rows(points: int, begin: np.ndarray, end: np.ndarray, cols: np.ndarray,
              nbytes: np.ndarray, width: int, passes: int = 8
              ) -> tuple[np.ndarray | LiveRows, scipy.sparse.csc_array | None]:
    """`prune` of the [points, width] matrix whose column `cols[j]` holds `nbytes[j]` from
    row `begin[j]` to row `end[j] - 1` (`dense_live_rows`), without building it; and its
    changes from each kept row to the next (row 0: itself), sparse, as `Graph.live_changes`
    wants them (None where the dense path ran), made from the few changes rather than by
    scanning the matrix (a 1T model's is 370 MB with 25,000 changes).

    A deep model has about as many rows as ops and a column per parameter, so the whole
    matrix grows with the square of its depth. But a pruning pass only asks, of each
    pair of neighbouring rows, whether every cell grows from one to the next, or every
    cell shrinks, or none changes: the signs of the net change of each column between
    them. Those changes are few (each value starts and ends once), so every pass runs on
    them alone (`_sparse_prune`: rows where nothing changes make runs of equal rows, of
    which the first pass keeps at most the last), and only the rows the passes keep are
    summed. Byte counts are integers, so every sum is exact in float64 whatever its order
    while it stays below 2**53 bytes, and the result is that of `prune` on the whole
    matrix, bit for bit. (A step moving more than 2**53 bytes in all, a 70B model at a
    global batch of millions of tokens, rounds sums at 1e-16 of their size, as the whole
    matrix in float64 would: building that one instead would cost the square of its
    depth for nothing.) The kept rows stay those changes (`live_matrix.LiveRows`), each
    row summed when read.
    """
    if len(nbytes) == 0 or not np.all(nbytes == np.floor(nbytes)):
        return dense_live_rows(points, begin, end, cols, nbytes, width, passes), None
    ev = np.concatenate([begin, end])
    inside = ev < points
    cell = (ev * width + np.concatenate([cols, cols]))[inside]
    change = np.concatenate([nbytes, -nbytes])[inside]
    cells, where = np.unique(cell, return_inverse=True)
    net = np.bincount(where, weights=change, minlength=len(cells))
    moved = net != 0
    cells, net = cells[moved], net[moved]
    row, col = cells // width, cells % width
    # runs of equal rows start at row 0 and at every row where something changes
    starts = np.unique(np.concatenate([[0], row]))

    def rows_at(at: np.ndarray) -> tuple[LiveRows, scipy.sparse.csc_array]:
        """The rows `at` (ascending), each the sum of the changes at or before it (held
        as those changes, `live_matrix.LiveRows`), and their changes from one to the
        next (exact: integer sums)."""
        k = np.searchsorted(at, row)
        ok = k < len(at)
        cells, where = np.unique(k[ok] * width + col[ok], return_inverse=True)
        sums = np.bincount(where, weights=net[ok], minlength=len(cells))
        nz = sums != 0
        cells, sums = cells[nz], sums[nz]
        changes = scipy.sparse.csc_array((sums, (cells // width, cells % width)),
                                         shape=(len(at), width))
        return LiveRows(changes), changes

    if points < 3:
        counts = np.diff(np.append(starts, points))
        return np.repeat(rows_at(starts)[0].dense(), counts, axis=0), None
    # the first pass of `prune` on the runs: a run's rows but its last are <= the next
    # (equal) row; its last is dropped where the next row only grows from it or, when the
    # run is one row, where it only shrinks from the row before
    run = np.searchsorted(starts, row)
    grows = np.bincount(run, weights=net > 0, minlength=len(starts)) > 0
    shrinks = np.bincount(run, weights=net < 0, minlength=len(starts)) > 0
    counts = np.diff(np.append(starts, points))
    keep = np.ones(len(starts), bool)
    keep[:-1] &= shrinks[1:]
    keep[1:] &= ~((counts[1:] == 1) & ~grows[1:])
    if keep.all() and (counts == 1).all():  # the pass drops nothing: prune returns it all
        return rows_at(starts)
    return rows_at(_sparse_prune(starts[keep], row, col, net, width, passes - 1))


def _sparse_prune(at: np.ndarray, row: np.ndarray, col: np.ndarray, net: np.ndarray,
                  width: int, passes: int) -> np.ndarray:
    """`prune`'s passes on the rows `at` of the matrix whose cell (row[i], col[i])
    changes by net[i] from the row before, the rows kept (ascending): row a is <= row b
    in every column where no column's changes between them sum below zero, equal where
    none sums to anything but zero."""
    for _ in range(passes):
        if len(at) < 3:
            return at
        # the changes between neighbours at[g - 1] and at[g], summed per (g, column)
        g = np.searchsorted(at, row)
        inner = (g > 0) & (g < len(at))
        cells, where = np.unique(g[inner] * width + col[inner], return_inverse=True)
        sums = np.bincount(where, weights=net[inner], minlength=len(cells))
        gap = cells // width
        up = np.zeros(len(at), bool)
        down = np.zeros(len(at), bool)
        up[gap[sums > 0]] = True
        down[gap[sums < 0]] = True
        keep = np.ones(len(at), bool)
        keep[:-1] &= down[1:]                 # not <= the next row
        keep[1:] &= up[1:] | ~down[1:]        # not <= the row before (and unequal)
        if keep.all():
            return at
        at = at[keep]
    return at


def dense_live_rows(points: int, begin: np.ndarray, end: np.ndarray, cols: np.ndarray,
                    nbytes: np.ndarray, width: int, passes: int = 8) -> np.ndarray:
    """`prune` of the whole [points, width] matrix `live_rows` describes, built."""
    diff = np.zeros((points + 1, width))
    np.add.at(diff, (begin, cols), nbytes)
    np.add.at(diff, (end, cols), -nbytes)
    return prune(np.cumsum(diff, axis=0)[:points], passes)


def prune(live: np.ndarray, passes: int = 8) -> np.ndarray:
    """Drop program points another point dominates in every bucket: with non-negative
    per-bucket weights they can never be the peak, and fewer rows make every candidate's
    peak cheaper to evaluate."""
    for _ in range(passes):
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
