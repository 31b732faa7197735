"""Per value of the flat program: what it is computed from (the batch, a parameter),
which parameter it is a form of (the parameter itself, a cast or transpose of it, its
gradient, its optimizer moments, its update) with the map from its dims to the
parameter's, and which values carry the batch dimension; and the dim of each parameter a
scan over layers iterates over. The first passes of `graph.analyze`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxwap.analysis.flatten import FlatOp, FlatProgram
from jaxwap.analysis.primitives import ELEMENTWISE, FREE, HEAVY, prim_info
from jaxwap.analysis.roles import BATCH, PARAM, LeafRole, ParamInfo


def op_kinds(prog: FlatProgram) -> tuple[list[str], np.ndarray]:
    """Each op's kind from the primitive table, and which ops cross to or from host memory.

    A device_put between device and host memory is a transfer over the host link, and its
    result a buffer of its own: heavy, not the free alias a device_put otherwise is.
    """
    crossing = np.array([op.prim == "device_put"
                         and len({bool(prog.on_host[i]) for i in op.ins + op.outs}) > 1
                         for op in prog.ops], dtype=bool)
    kinds = [HEAVY if c else prim_info(op.prim).kind
             for op, c in zip(prog.ops, crossing, strict=True)]
    return kinds, crossing


@dataclass(frozen=True)
class Dataflow:
    """Per value: what it is computed from, and what parameter it is a form of."""

    dep: np.ndarray       # [values] bool: computed from batch data
    pdep: np.ndarray      # [values] bool: computed from a parameter
    owner: np.ndarray     # [values] the parameter it is a form of, or -1
    perm: list[tuple[int, ...] | None]  # [values] its dims as its owner's dims, if known
    batched: np.ndarray   # [values] bool: carries the batch dimension


def dataflow(prog: FlatProgram, kinds: Sequence[str], in_roles: Sequence[LeafRole],
              out_roles: Sequence[LeafRole], params: Sequence[ParamInfo],
              batch_size: int | None) -> Dataflow:
    """Batch and parameter dependence, and ownership with its dim map.

    Dependence flows through every op. Ownership flows only through layout and
    elementwise ops that keep the element count (a cast, transpose or update of a weight
    is still that weight; a matmul's result is not): forward from the parameter inputs,
    then backward from the parameter outputs. The dim map follows transposes and
    same-shape ops, so a layer's weight dims can be named in the parameter's own order.
    """
    V, size = prog.vars, prog.size.tolist()  # (python lists: fast to index one by one)
    nv = len(V)
    dep = [False] * nv
    pdep = [False] * nv
    owner = [-1] * nv
    perm: list[tuple[int, ...] | None] = [None] * nv
    for i, r in zip(prog.in_ids, in_roles, strict=True):
        if r.kind == BATCH:
            dep[i] = True
        elif r.kind == PARAM:
            owner[i] = r.param
            pdep[i] = True
            if V[i].shape == params[r.param].shape:
                perm[i] = tuple(range(len(V[i].shape)))
    for op, kind in zip(prog.ops, kinds, strict=True):
        ins = op.ins
        d = any(dep[i] for i in ins)
        pd = any(pdep[i] for i in ins)
        for o in op.outs:
            dep[o] = dep[o] or d
            pdep[o] = pdep[o] or pd
        if op.prim in _SCAN_OPS:
            _scan_owner(op, owner, perm, forward=True)
            continue
        if op.prim == "dynamic_slice" and loop_slice_dim(op, V) is not None:
            # one layer of a stacked weight a loop indexes (`w[i]` in a `fori_loop`):
            # that weight, its dims as the stack's (the indexed one now of size 1)
            owner[op.outs[0]], perm[op.outs[0]] = owner[ins[0]], perm[ins[0]]
            continue
        if kind not in (FREE, ELEMENTWISE):
            continue
        info = prim_info(op.prim)
        for o in op.outs:
            src = next((i for i in ins if owner[i] >= 0 and size[i] == size[o]), None)
            if src is None:
                continue
            owner[o] = owner[src]
            if perm[src] is None:
                continue
            if info.permutation is not None:
                perm[o] = tuple(perm[src][p] for p in info.permutation(op.eqn))
            elif (info.same_layout or kind == ELEMENTWISE) and V[o].shape == V[src].shape:
                perm[o] = perm[src]
    for o, r in zip(prog.out_ids, out_roles, strict=True):
        if r.kind == PARAM and owner[o] < 0 and size[o] == params[r.param].size:
            owner[o] = r.param
    for op, kind in zip(reversed(prog.ops), reversed(kinds), strict=True):
        if op.prim in _SCAN_OPS:
            _scan_owner(op, owner, perm, forward=False)
            continue
        if kind not in (FREE, ELEMENTWISE):
            continue
        for o in op.outs:
            if owner[o] < 0:
                continue
            for i in op.ins:
                if owner[i] < 0 and size[i] == size[o]:
                    owner[i] = owner[o]
    dep = np.array(dep, dtype=bool)
    owner = np.array(owner, dtype=np.int64)
    pdep = np.array(pdep, dtype=bool)
    return Dataflow(dep, pdep, owner, perm, _batched(prog, dep, owner, batch_size))


def looked_up(prog: FlatProgram, in_roles: Sequence[LeafRole], out_roles: Sequence[LeafRole],
              params: Sequence[ParamInfo], batch_size: int | None) -> frozenset[int]:
    """The parameters an embedding lookup reads: each one a `gather` takes its table from
    (the parameter itself, or a cast or copy of it: `dataflow`'s ownership). XLA's
    partitioner gives a lookup's result the table's sharding: a table sharded over the
    data axis on its feature dim makes the looked-up activations feature-sharded and
    whole-batch, and from there the rest of the network (`compile.compile_layout` gathers
    such a table first)."""
    kinds, _ = op_kinds(prog)
    owner = dataflow(prog, kinds, in_roles, out_roles, params, batch_size).owner
    return frozenset(int(owner[op.ins[0]]) for op in prog.ops
                     if op.prim == "gather" and owner[op.ins[0]] >= 0)


_SCAN_OPS = ("scan_slice", "scan_stack")


def _scan_owner(op: FlatOp, owner: list[int], perm: list[tuple[int, ...] | None],
                forward: bool) -> None:
    """Ownership through a scan's slicing and stacking (`analysis/flatten.py`): one iteration's
    slice of a stacked parameter is that parameter (its layer's weight), and so is the
    stack of one iteration's gradient, or of a weight's cast saved for the backward pass.
    The slice's dims are the stack's past its leading dim; a stack's leading dim is the
    one parameter dim its slice's map leaves out."""
    src, dst = (op.ins[0], op.outs[0]) if forward else (op.outs[0], op.ins[0])
    if owner[src] < 0 or owner[dst] >= 0:
        return
    owner[dst] = owner[src]
    if not forward or perm[src] is None:
        return
    p = perm[src]
    if op.prim == "scan_slice":
        perm[dst] = p[1:]
    else:
        left = sorted(set(range(len(p) + 1)) - set(p))
        if len(left) == 1 and all(0 <= x <= len(p) for x in p):
            perm[dst] = (left[0], *p)


def _batched(prog: FlatProgram, dep: np.ndarray, owner: np.ndarray,
             batch_size: int | None) -> np.ndarray:
    """Values that split over the data axis: computed from the batch, not a parameter's,
    and holding a whole number of (per-iteration) batch rows."""
    ndim = np.array([len(v.shape) for v in prog.vars])
    batched = dep & (owner < 0) & (ndim >= 1)
    if not batch_size:
        return np.zeros_like(batched)
    # inside a scan over micro-batches one iteration holds B / length rows
    B = batch_size
    rows = B // np.gcd(B, np.array([v.repeat for v in prog.vars], dtype=np.int64))
    return batched & (prog.size % rows == 0) & (prog.size >= rows)


def loop_slice_dim(op: FlatOp, V: Sequence[Any]) -> int | None:
    """The dim a loop indexes one layer out of, where `op` is a `dynamic_slice` taking a
    window of 1 on that dim alone and all of every other, inside a loop whose iterations
    the dim's length divides (`fori_loop(0, L, ...)` reading `w[i]` of an [L, ...] stack:
    every layer once per pass); None otherwise."""
    shape = V[op.ins[0]].shape
    sizes = tuple(op.eqn.params.get("slice_sizes", ()))
    if len(sizes) != len(shape):
        return None
    cut = [k for k, (n, s) in enumerate(zip(shape, sizes, strict=True)) if n != s]
    if len(cut) != 1 or sizes[cut[0]] != 1:
        return None
    n = shape[cut[0]]
    return cut[0] if 1 < n <= op.repeat and op.repeat % n == 0 else None


def stacked_dims(prog: FlatProgram, flow: Dataflow, params: Sequence[ParamInfo]
                 ) -> np.ndarray:
    """Per parameter, the dim a loop takes one layer out of in each iteration, named in
    the parameter's own dims; -1 if no loop iterates over it. A scan slices its scanned
    input's leading dim (`scan_slice`); a loop over a stack it closes over indexes it
    (`loop_slice_dim`). A parameter whose dim map is unknown there but whose shape is the
    sliced value's is taken as stacked on that dim."""
    stacked = np.full(len(params), -1, np.int64)
    for op in prog.ops:
        if op.prim == "scan_slice":
            d: int | None = 0
        elif op.prim == "dynamic_slice":
            d = loop_slice_dim(op, prog.vars)
        else:
            continue
        x = op.ins[0]
        p = int(flow.owner[x])
        if d is None or p < 0 or stacked[p] >= 0:
            continue
        perm = flow.perm[x]
        if perm is not None:
            stacked[p] = perm[d]
        elif prog.vars[x].shape == tuple(params[p].shape):
            stacked[p] = d
    return stacked


__all__ = ["Dataflow", "dataflow", "looked_up", "loop_slice_dim", "op_kinds", "stacked_dims"]
