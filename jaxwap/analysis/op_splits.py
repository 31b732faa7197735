"""How each op of the step splits across a mesh, and the layers tensor parallelism splits.

An op is *batched* (it splits over the data axis, touching a batched value) or *owned*
(it splits however its parameter is sharded); a matmul or convolution that uses a weight
against batched data is a *layer* (`Layer`), its weight dims contracted ("row") or not
("column") given by the primitive table's layer rules, with the bias added to its result.
`graph.analyze` calls `op_splits` once per step and keeps what it finds in the `Graph`.
Kept apart from `graph.py` so that the modules the analysis calls (liveness, tensor-parallel
activations) can name the `Layer` record without importing the analysis that calls them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxwap.analysis.dataflow import Dataflow
from jaxwap.analysis.flatten import FlatOp, FlatProgram
from jaxwap.analysis.primitives import FREE, MATMUL, prim_info
from jaxwap.analysis.roles import ParamInfo

__all__ = ["Layer", "OpSplits", "op_splits"]


@dataclass(frozen=True)
class Layer:
    """A weight used by a matmul/conv against batched data: what tensor parallelism splits.

    `in_dims` are the weight dims the op contracts (row sharding splits one of them and
    leaves partial sums to all-reduce); `out_dims` are its output-feature dims (column
    sharding splits one, leaving the activation sharded), both named in the parameter's
    own dims (a stacked parameter's past its stacked dim). Activation sizes are global
    bytes of the forward op's data operand and result (one iteration's, in a scan).
    `input_id` names the value the data operand is (past casts and reshapes): layers
    reading the same one are siblings (attention's q, k and v projections, a gated MLP's
    gate and up), whose input a tensor-parallel layout gathers or reduces once, not per
    layer (`Graph.layer_groups`); -1 when unknown. `bias` is the parameter added to the
    op's result, one element per output feature (a Dense or Conv bias), or -1: XLA moves
    it with the layer's activations when it moves them for FSDP (`collectives.fsdp_moves`).
    """

    param: int
    op_index: int
    in_dims: tuple[int, ...]
    out_dims: tuple[int, ...]
    act_in_bytes: float
    act_out_bytes: float
    needs_input_grad: bool
    input_id: int = -1
    weight_bytes: float = 0.0   # the weight operand as the op reads it (after any cast)
    bias: int = -1


@dataclass(frozen=True)
class OpSplits:
    """Per op (arrays over the flat program's ops): whether it is batched, the parameter
    that owns it (-1: none), the weight whose tensor-parallel layout splits it (-1: none);
    and the layers in forward order. The `Graph` keeps each as its own field."""

    batched: np.ndarray
    owner: np.ndarray
    tp_param: np.ndarray
    layers: tuple[Layer, ...]


def op_splits(prog: FlatProgram, kinds: Sequence[str], flow: Dataflow,
              params: Sequence[ParamInfo]) -> OpSplits:
    """How each op splits across a mesh: over the data axis (it touches a batched value),
    with a parameter (it makes or, unbatched, uses one of its forms), and for a matmul
    against batched data, with the tensor-parallel sharding of its weight's layer.

    A matmul's owner is the parameter of an operand first, of its result else; a layer is
    kept per parameter, its first use (the forward op). A matmul whose weight has no
    layer (its dims unknown) is not split by tensor parallelism.
    """
    n = len(prog.ops)
    batched, owner = flow.batched.tolist(), flow.owner.tolist()  # (fast to index)
    op_batched = [False] * n
    op_owner = [-1] * n
    tp = [-1] * n
    layers: dict[int, Layer] = {}
    source = _sources(prog)
    for k, (op, kind) in enumerate(zip(prog.ops, kinds, strict=True)):
        b = op_batched[k] = (any(batched[i] for i in op.ins)
                             or any(batched[o] for o in op.outs))
        in_owned = [i for i in op.ins if owner[i] >= 0]
        out_owned = [o for o in op.outs if owner[o] >= 0]
        if kind == MATMUL:
            if in_owned:
                op_owner[k] = owner[in_owned[0]]
            elif out_owned:
                op_owner[k] = owner[out_owned[0]]
            if op_owner[k] >= 0 and b:
                tp[k] = op_owner[k]
            layer = _layer_of(op, k, flow, prog.nbytes, source)
            if layer is not None and layer.param not in layers:
                layers[layer.param] = layer
        elif out_owned:
            op_owner[k] = owner[out_owned[0]]
        elif in_owned and not b:
            op_owner[k] = owner[in_owned[0]]
    tp_param = np.array(tp, dtype=np.int64)
    tp_param[~np.isin(tp_param, list(layers))] = -1
    return OpSplits(np.array(op_batched, dtype=bool), np.array(op_owner, dtype=np.int64),
                     tp_param, _with_biases(prog, flow, layers, source, params))


def _with_biases(prog: FlatProgram, flow: Dataflow, layers: Mapping[int, Layer],
                 source: Sequence[int], params: Sequence[ParamInfo]) -> tuple[Layer, ...]:
    """The layers in forward order, each with its bias: the first parameter (of no layer
    of its own) added to the layer's result (past casts and reshapes), with one element
    per output feature (Flax adds a reshaped bias, no broadcast op between)."""
    made = {source[prog.ops[L.op_index].outs[0]]: L for L in layers.values()}
    owner, batched, size = flow.owner, flow.batched, prog.size
    found: dict[int, int] = {}
    for op in prog.ops:
        if op.prim != "add" or len(op.ins) != 2:
            continue
        for x, b in (op.ins, op.ins[::-1]):
            L = made.get(source[x])
            j = int(owner[b])
            if (L is None or L.param in found or j < 0 or j in layers or batched[b]
                    or size[b] != math.prod(params[L.param].shape[i] for i in L.out_dims)):
                continue
            found[L.param] = j
    return tuple(sorted((dataclasses.replace(L, bias=found.get(L.param, -1))
                         for L in layers.values()), key=lambda L: L.op_index))


def _sources(prog: FlatProgram) -> list[int]:
    """Per value, the value it is an alias of past casts, copies and reshapes (itself if
    none): siblings' inputs are one value, though each layer may cast its own copy."""
    source = list(range(len(prog.vars)))
    for op in prog.ops:
        info = prim_info(op.prim)
        if (len(op.ins) == 1 and len(op.outs) == 1 and info.kind == FREE
                and (info.permutation is None or op.prim == "squeeze")
                and op.prim != "broadcast_in_dim"):
            source[op.outs[0]] = source[op.ins[0]]
    return source


def _layer_of(op: FlatOp, k: int, flow: Dataflow, nbytes: np.ndarray,
              source: Sequence[int]) -> Layer | None:
    """The weight this matmul uses against batched data, its dims named by the table's
    layer rule and mapped to the parameter's own dims. The rhs is tried first."""
    rule = prim_info(op.prim).layer
    if rule is None:
        return None
    for w in (1, 0):
        wid, xid = op.ins[w], op.ins[1 - w]
        pw = flow.perm[wid]
        if flow.owner[wid] < 0 or pw is None or not flow.batched[xid]:
            continue
        dims = rule(op.eqn, w)
        if dims is None:
            continue
        return Layer(int(flow.owner[wid]), k, tuple(sorted(pw[d] for d in dims.in_dims)),
                     tuple(sorted(pw[d] for d in dims.out_dims)), float(nbytes[xid]),
                     float(nbytes[op.outs[0]]), bool(flow.pdep[xid]), source[xid],
                     float(nbytes[wid]))
    return None

