"""From a step's jaxpr to the facts the cost model needs.

The jaxpr of a training step is flattened (calls such as `jit`, `custom_jvp_call` and
`remat` are inlined; a `scan` is inlined once with its ops' costs multiplied by its length,
so the liveness walk sees one iteration's temporaries, as the loop allocates them; `while`
and `cond` stay opaque), dead code is dropped, and
every remaining equation becomes an `Op` with its flops and memory traffic (from the
per-primitive rules of `jax.experimental.roofline` where they exist) and two dataflow
facts that decide how it splits across a mesh:

- *batched*: it touches a value that carries the batch dimension, so it splits over the
  data axis;
- *owner*: it works on one parameter (the parameter itself, a cast or transpose of it,
  its gradient, its optimizer moments, its update), so it splits however that parameter
  is sharded.

Ownership flows forward from the parameter inputs through shape-preserving ops and
backward from the parameter outputs (new params, new moments), which catches the
gradient of a weight (`dW = x^T dy`) without a name for it. Matmuls and convolutions
that use a weight as one operand and a batched value as the other are the *layers*
tensor parallelism can split; their dimension numbers say which weight dims are
contracted ("row" sharding) and which are not ("column").

Memory is a liveness walk over the flat program: elementwise chains are fused (their
intermediates are not materialised) and reshapes and broadcasts are aliases, as XLA
does; the live bytes at every point are kept split into batched / other buckets and, per
parameter, four classes a memory plan can place differently: the weight (and its casts,
and the new weight), its gradient, optimizer temporaries, and the resident optimizer state
(the moments passed in and handed back). A candidate's peak memory is then one
matrix-vector product.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.experimental.roofline  # noqa: F401 - registers the per-primitive rules
import numpy as np

from .state import BATCH, PARAM, LeafRole, ParamInfo

try:  # the rule registry of jax.experimental.roofline (module shadowed by its function)
    _RL = sys.modules["jax.experimental.roofline.roofline"]
    _RULES: dict[Any, Any] = _RL._rooflines
except (KeyError, AttributeError):  # pragma: no cover - a jax without the registry
    _RL, _RULES = None, {}

_INLINE = {"pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
           "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}
MATMUL = {"dot_general", "conv_general_dilated", "ragged_dot_general"}
# Layout-only ops: XLA turns them into bitcasts or fuses them into their consumer.
_FREE = {"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "convert_element_type",
         "copy", "copy_p", "stop_gradient", "transpose", "reduce_precision", "pvary",
         "sharding_constraint", "optimization_barrier", "name", "tie", "device_put",
         "scan_slice"}
# Ops that start their own kernel (reductions, data movement, control flow).
_HEAVY = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
          "reduce_or", "reduce_xor", "reduce", "argmax", "argmin", "gather", "scatter",
          "scatter-add", "scatter-mul", "scatter-min", "scatter-max", "scatter-sub",
          "select_and_scatter_add", "select_and_scatter", "select_and_gather_add",
          "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
          "sort", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "top_k",
          "dynamic_update_slice", "fft", "while", "scan", "cond", "custom_linear_solve",
          "cholesky", "triangular_solve", "lu", "qr", "eigh", "svd", "random_bits",
          "threefry2x32", "rng_bit_generator", "shard_map", "all_gather", "psum",
          "reduce_scatter", "all_to_all", "ppermute", "scan_stack"}
_SAME_LAYOUT = {"convert_element_type", "copy", "copy_p", "stop_gradient",
                "reduce_precision", "pvary", "sharding_constraint", "optimization_barrier"}


@dataclass(frozen=True)
class Layer:
    """A weight used by a matmul/conv against batched data: what tensor parallelism splits.

    `in_dims` are the weight dims the op contracts (row sharding splits one of them and
    leaves partial sums to all-reduce); `out_dims` are its output-feature dims (column
    sharding splits one, leaving the activation sharded). Activation sizes are global
    bytes of the forward op's data operand and result.
    """

    param: int
    op_index: int
    in_dims: tuple[int, ...]
    out_dims: tuple[int, ...]
    act_in_bytes: float
    act_out_bytes: float
    needs_input_grad: bool


# Classes of a parameter's own values (columns of Graph.live after batched and other).
WEIGHT, GRAD, OPT, RESIDENT = range(4)
NUM_CLASSES = 4


@dataclass(frozen=True)
class Graph:
    """The step as the cost model sees it (struct of arrays over ops, for speed)."""

    params: tuple[ParamInfo, ...]
    batch_size: int | None
    prims: tuple[str, ...]
    flops: np.ndarray          # [ops] flops of the whole (unsharded) step
    bytes: np.ndarray          # [ops] memory traffic after fusion
    kernels: np.ndarray        # [ops] kernel launches
    is_matmul: np.ndarray      # [ops] bool
    low_precision: np.ndarray  # [ops] bool: 16-bit operands (tensor-core peak)
    batched: np.ndarray        # [ops] bool
    owner: np.ndarray          # [ops] int param index or -1
    tp_param: np.ndarray       # [ops] int: the weight whose TP sharding splits this matmul
    layers: tuple[Layer, ...]
    live: np.ndarray           # [points, 2 + 4P] live bytes: batched, other, then per
                               # class (WEIGHT, GRAD, OPT, RESIDENT) a column per param
    state_bytes: np.ndarray    # [P] bytes of argument leaves owned by each param
    unmodeled: tuple[str, ...]
    op_class: np.ndarray       # [ops] class of the value an op produces (WEIGHT .. RESIDENT)
    repeat: np.ndarray         # [ops] iterations of the enclosing (inlined) scans
    resident_bytes: np.ndarray  # [P] bytes of each param's optimizer state (its mirrors)
    host_transfer: np.ndarray  # [ops] bool: a copy between device and host memory
    # [P] how many times a parameter's gradient is produced per step: inside a scan over
    # micro-batches XLA reduces it across the data axis in every iteration
    grad_repeat: np.ndarray

    @property
    def total_flops(self) -> float:
        return float(self.flops.sum())

    @property
    def total_bytes(self) -> float:
        return float(self.bytes.sum())

    @property
    def num_ops(self) -> int:
        return len(self.prims)


# --------------------------------------------------------------------------- flatten
@dataclass
class _Var:
    shape: tuple[int, ...]
    dtype: Any
    nbytes: int
    size: int
    repeat: int = 1      # iterations of the enclosing (inlined) scans
    on_host: bool = False  # in host memory (a residual offloaded by a remat policy)


@dataclass
class _RawOp:
    eqn: Any
    ins: list[int]
    outs: list[int]
    repeat: int = 1


@dataclass(frozen=True)
class _Prim:
    name: str


@dataclass(frozen=True)
class _Synthetic:
    """Stands in for an equation where a scan is inlined: slicing one iteration's input
    out of the stacked `xs` (an alias), or stacking one iteration's output into `ys`."""

    primitive: _Prim
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    effects: Any = None


_SLICE, _STACK = _Synthetic(_Prim("scan_slice")), _Synthetic(_Prim("scan_stack"))


def _itemsize_of(dtype: Any) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # PRNG key and other extended dtypes
        return getattr(dtype, "itemsize", 8) or 8


def _aval_info(aval: Any, repeat: int = 1) -> _Var:
    shape = tuple(int(s) for s in getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    size = math.prod(shape)
    space = getattr(aval, "memory_space", None)
    host = space is not None and getattr(space, "name", str(space)).lower().endswith("host")
    return _Var(shape, dtype, size * _itemsize_of(dtype), size, repeat, host)


def _sub_jaxpr(eqn: Any) -> Any | None:
    if eqn.primitive.name not in _INLINE:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None and (hasattr(sub, "eqns") or hasattr(sub, "jaxpr")):
            return sub
    return None


class _Flattener:
    def __init__(self) -> None:
        self.vars: list[_Var] = []
        self.ops: list[_RawOp] = []
        self.repeat = 1

    def new(self, aval: Any) -> int:
        self.vars.append(_aval_info(aval, self.repeat))
        return len(self.vars) - 1

    def op(self, eqn: Any, ins: list[int], outs: list[int]) -> None:
        self.ops.append(_RawOp(eqn, ins, outs, self.repeat))

    def scan(self, eqn: Any, ins: list[int]) -> list[int]:
        """Inline a scan's body once, its ops repeated `length` times."""
        p = eqn.params
        body, nc, nk = p["jaxpr"], int(p["num_consts"]), int(p["num_carry"])
        inner = body.jaxpr if hasattr(body, "jaxpr") else body
        outer = self.repeat
        self.repeat = outer * max(int(p["length"]), 1)
        slices = []
        for x, v in zip(ins[nc + nk:], inner.invars[nc + nk:], strict=True):
            slices.append(self.new(v.aval))
            self.op(_SLICE, [x], [slices[-1]])
        outs = self.run(body, list(ins[: nc + nk]) + slices)
        ys = []
        for y, v in zip(outs[nk:], eqn.outvars[nk:], strict=True):
            self.repeat = outer
            ys.append(self.new(v.aval))
            self.repeat = outer * max(int(p["length"]), 1)
            self.op(_STACK, [y], [ys[-1]])
        self.repeat = outer
        return list(outs[:nk]) + ys

    def atom(self, a: Any, env: dict[Any, int]) -> int:
        if type(a).__name__ == "Literal":
            return self.new(a.aval)  # a fresh constant, never batched or owned
        return env[a]

    def run(self, jaxpr: Any, in_ids: Sequence[int]) -> list[int]:
        consts = getattr(jaxpr, "consts", None)
        inner = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr
        env: dict[Any, int] = {}
        for v in inner.constvars:
            env[v] = self.new(v.aval)
        del consts
        for v, i in zip(inner.invars, in_ids, strict=True):
            env[v] = i
        for eqn in inner.eqns:
            ins = [self.atom(a, env) for a in eqn.invars]
            sub = _sub_jaxpr(eqn)
            if sub is not None:
                outs = self.run(sub, ins)
            elif eqn.primitive.name == "scan":
                outs = self.scan(eqn, ins)
            else:
                outs = [self.new(v.aval) for v in eqn.outvars]
                self.op(eqn, ins, outs)
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o
        return [self.atom(a, env) for a in inner.outvars]


def _dce(ops: list[_RawOp], out_ids: Sequence[int]) -> list[_RawOp]:
    needed = set(out_ids)
    keep = []
    for op in reversed(ops):
        effects = getattr(op.eqn, "effects", None)
        if effects or any(o in needed for o in op.outs):
            keep.append(op)
            needed.update(op.ins)
    keep.reverse()
    return keep


# --------------------------------------------------------------------------- costs
def _rule_cost(eqn: Any) -> tuple[float, float] | None:
    """(flops, hbm bytes) from jax.experimental.roofline's rule, or None without one."""
    rule = _RULES.get(eqn.primitive)
    if rule is None or _RL is None:
        return None
    try:
        avals_in = [a.aval for a in eqn.invars]
        avals_out = [v.aval for v in eqn.outvars]
        ctx = _RL.RooflineRuleContext(
            name_stack=eqn.source_info.name_stack, primitive=eqn.primitive,
            avals_in=avals_in, avals_out=avals_out, jaxpr_eqn_ctx=eqn.ctx, mesh=None,
            pin_lhs_in_vmem=False, pin_rhs_in_vmem=False)
        shapes = [_RL.RooflineShape.from_aval(a) for a in avals_in]
        res = rule(ctx, *shapes, **eqn.params)
    except Exception:  # noqa: BLE001 - a rule that cannot price this eqn: fall back, recorded
        return None
    # some rules (conv_general_dilated) fill only the unfused counts
    return (float(max(res.flops, res.unfused_flops)),
            float(res.hbm_bytes or res.unfused_hbm_bytes))


def _kind(prim: str) -> str:
    if prim in MATMUL:
        return "matmul"
    if prim in _FREE:
        return "free"
    if prim in _HEAVY:
        return "heavy"
    return "elementwise"


# --------------------------------------------------------------------------- analysis
def analyze(closed_jaxpr: Any, in_roles: Sequence[LeafRole], out_roles: Sequence[LeafRole],
            params: Sequence[ParamInfo], batch_size: int | None) -> Graph:
    """Flatten the step's jaxpr and derive per-op costs, splits, layers and liveness."""
    fl = _Flattener()
    in_ids = [fl.new(v.aval) for v in closed_jaxpr.jaxpr.invars]
    out_ids = fl.run(closed_jaxpr, in_ids)
    ops = _dce(fl.ops, out_ids)
    V = fl.vars
    nv, P = len(V), len(params)
    size = np.array([v.size for v in V], dtype=np.int64)
    nbytes = np.array([v.nbytes for v in V], dtype=np.float64)

    # --- dataflow: batch dependence, parameter dependence, ownership (with dim map)
    dep = np.zeros(nv, bool)
    pdep = np.zeros(nv, bool)
    owner = np.full(nv, -1, np.int64)
    perm: list[tuple[int, ...] | None] = [None] * nv
    for i, r in zip(in_ids, in_roles, strict=True):
        if r.kind == BATCH:
            dep[i] = True
        elif r.kind == PARAM:
            owner[i] = r.param
            pdep[i] = True
            if V[i].shape == params[r.param].shape:
                perm[i] = tuple(range(len(V[i].shape)))
    on_host = np.array([v.on_host for v in V], dtype=bool)
    # a device_put between device and host memory is a transfer over the host link, and
    # its result a buffer of its own
    crossing = [op.eqn.primitive.name == "device_put"
                and len({bool(on_host[i]) for i in op.ins + op.outs}) > 1 for op in ops]
    kinds = ["heavy" if c else _kind(op.eqn.primitive.name)
             for op, c in zip(ops, crossing, strict=True)]
    for op, kind in zip(ops, kinds, strict=True):
        d = any(dep[i] for i in op.ins)
        pd = any(pdep[i] for i in op.ins)
        for o in op.outs:
            dep[o] |= d
            pdep[o] |= pd
        if kind not in ("free", "elementwise"):
            continue
        prim = op.eqn.primitive.name
        for o in op.outs:
            src = next((i for i in op.ins if owner[i] >= 0 and size[i] == size[o]), None)
            if src is None:
                continue
            owner[o] = owner[src]
            if perm[src] is None:
                continue
            if prim == "transpose":
                perm[o] = tuple(perm[src][p] for p in op.eqn.params["permutation"])
            elif (prim in _SAME_LAYOUT or kind == "elementwise") and V[o].shape == V[src].shape:
                perm[o] = perm[src]
    for o, r in zip(out_ids, out_roles, strict=True):
        if r.kind == PARAM and owner[o] < 0 and size[o] == params[r.param].size:
            owner[o] = r.param
    for op, kind in zip(reversed(ops), reversed(kinds), strict=True):
        if kind not in ("free", "elementwise"):
            continue
        for o in op.outs:
            if owner[o] < 0:
                continue
            for i in op.ins:
                if owner[i] < 0 and size[i] == size[o]:
                    owner[i] = owner[o]
    B = batch_size
    ndim = np.array([len(v.shape) for v in V])
    batched = dep & (owner < 0) & (ndim >= 1)
    if B:
        # inside a scan over micro-batches one iteration holds B / length rows
        rows = B // np.gcd(B, np.array([v.repeat for v in V], dtype=np.int64))
        batched &= (size % rows == 0) & (size >= rows)
    else:
        batched[:] = False
    vclass = _classes(ops, kinds, in_ids, in_roles, out_ids, out_roles, owner, dep, nv)

    # --- per-op costs and splits
    n = len(ops)
    flops = np.zeros(n)
    traffic = np.zeros(n)
    kernels = np.zeros(n)
    is_matmul = np.zeros(n, bool)
    lowp = np.zeros(n, bool)
    op_batched = np.zeros(n, bool)
    op_owner = np.full(n, -1, np.int64)
    tp_param = np.full(n, -1, np.int64)
    producer_kind: dict[int, str] = {}
    unmodeled: set[str] = set()
    layers: dict[int, Layer] = {}
    for k, (op, kind) in enumerate(zip(ops, kinds, strict=True)):
        eqn = op.eqn
        prim = eqn.primitive.name
        cost = _rule_cost(eqn)
        out_bytes = float(sum(nbytes[o] for o in op.outs))
        in_bytes = float(sum(nbytes[i] for i in op.ins))
        if cost is None:
            if kind not in ("free",):
                unmodeled.add(prim)
            cost = (float(sum(size[o] for o in op.outs)), in_bytes + out_bytes)
        f, b = cost
        f, b = f * op.repeat, b * op.repeat
        if kind == "free":
            f, b, kern = 0.0, 0.0, 0.0
        elif kind == "elementwise":
            # A fused chain writes each result once; a new fusion starts where no input
            # comes from another fusible op.
            b = out_bytes * op.repeat
            kern = 0.0 if any(producer_kind.get(i) in ("elementwise", "free")
                              for i in op.ins) else float(op.repeat)
        else:
            kern = float(op.repeat)
        flops[k], traffic[k], kernels[k] = f, b, kern
        for o in op.outs:
            producer_kind[o] = kind
        op_batched[k] = any(batched[i] for i in op.ins) or any(batched[o] for o in op.outs)
        in_owned = [i for i in op.ins if owner[i] >= 0]
        out_owned = [o for o in op.outs if owner[o] >= 0]
        if kind == "matmul":
            is_matmul[k] = True
            lowp[k] = all(_itemsize(V[i].dtype) <= 2 for i in op.ins)
            if in_owned:
                op_owner[k] = owner[in_owned[0]]
            elif out_owned:
                op_owner[k] = owner[out_owned[0]]
            if op_owner[k] >= 0 and op_batched[k]:
                tp_param[k] = op_owner[k]
            layer = _layer_of(op, k, owner, perm, batched, pdep, nbytes, V)
            if layer is not None and layer.param not in layers:
                layers[layer.param] = layer
        else:
            if out_owned:
                op_owner[k] = owner[out_owned[0]]
            elif in_owned and not op_batched[k]:
                op_owner[k] = owner[in_owned[0]]
    # a TP split needs a layer whose weight dims are known; otherwise the matmul is not split
    tp_param[~np.isin(tp_param, list(layers))] = -1

    device_bytes = np.where(on_host, 0.0, nbytes)
    live = _liveness(ops, kinds, in_ids, out_ids, nv, device_bytes, batched, owner, vclass, P)
    state_bytes = np.zeros(P)
    resident = np.zeros(P)
    for i, r in zip(in_ids, in_roles, strict=True):
        if r.kind == PARAM:
            state_bytes[r.param] += nbytes[i]
            if r.mirror:
                resident[r.param] += nbytes[i]
    op_class = np.array([vclass[op.outs[0]] if op.outs else WEIGHT for op in ops],
                        dtype=np.int64)
    grad_repeat = np.ones(P)
    for k, op in enumerate(ops):
        if op_owner[k] >= 0 and op_class[k] == GRAD and op.repeat > 1:
            grad_repeat[op_owner[k]] = max(grad_repeat[op_owner[k]], op.repeat)
    return Graph(
        params=tuple(params), batch_size=B, prims=tuple(op.eqn.primitive.name for op in ops),
        flops=flops, bytes=traffic, kernels=kernels, is_matmul=is_matmul,
        low_precision=lowp, batched=op_batched, owner=op_owner, tp_param=tp_param,
        layers=tuple(sorted(layers.values(), key=lambda L: L.op_index)), live=live,
        state_bytes=state_bytes, unmodeled=tuple(sorted(unmodeled)), op_class=op_class,
        repeat=np.array([float(op.repeat) for op in ops]), resident_bytes=resident,
        host_transfer=np.array(crossing, dtype=bool), grad_repeat=grad_repeat)


def _itemsize(dtype: Any) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 8


def _layer_of(op: _RawOp, k: int, owner: np.ndarray, perm: list, batched: np.ndarray,
              pdep: np.ndarray, nbytes: np.ndarray, V: list[_Var]) -> Layer | None:
    """The weight this matmul/conv uses against batched data, with its dim roles."""
    if len(op.ins) < 2:
        return None
    prim = op.eqn.primitive.name
    lhs, rhs = op.ins[0], op.ins[1]
    if prim == "dot_general":
        (lc, rc), (lb, rb) = op.eqn.params["dimension_numbers"]
        for w, x, contract, batch in ((rhs, lhs, rc, rb), (lhs, rhs, lc, lb)):
            if owner[w] >= 0 and perm[w] is not None and batched[x]:
                pw = perm[w]
                in_dims = tuple(sorted(pw[c] for c in contract))
                out_dims = tuple(sorted(pw[d] for d in range(len(pw))
                                        if d not in contract and d not in batch))
                return Layer(int(owner[w]), k, in_dims, out_dims, float(nbytes[x]),
                             float(nbytes[op.outs[0]]), bool(pdep[x]))
        return None
    if prim == "conv_general_dilated":
        p = op.eqn.params
        if p.get("feature_group_count", 1) != 1 or p.get("batch_group_count", 1) != 1:
            return None
        if owner[rhs] < 0 or perm[rhs] is None or not batched[lhs]:
            return None
        rhs_spec = p["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
        pw = perm[rhs]
        return Layer(int(owner[rhs]), k, (pw[rhs_spec[1]],), (pw[rhs_spec[0]],),
                     float(nbytes[lhs]), float(nbytes[op.outs[0]]), bool(pdep[lhs]))
    return None


def _classes(ops: list[_RawOp], kinds: list[str], in_ids: Sequence[int],
             in_roles: Sequence[LeafRole], out_ids: Sequence[int],
             out_roles: Sequence[LeafRole], owner: np.ndarray, dep: np.ndarray,
             nv: int) -> np.ndarray:
    """The class of every value a parameter owns (WEIGHT, GRAD, OPT, RESIDENT).

    Inputs: the parameter itself is WEIGHT, a mirror (optimizer moment) RESIDENT. A value
    computed from optimizer state is OPT (moment updates, the update itself); one computed
    from data or from a gradient is GRAD (dW = x^T dy, its square for Adam); the rest
    (casts and transposes of the weight) WEIGHT. Outputs take their role's class, so the
    new weight is WEIGHT and the new moments RESIDENT.
    """
    cls = np.full(nv, WEIGHT, np.int64)
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


def _liveness(ops: list[_RawOp], kinds: list[str], in_ids: Sequence[int],
              out_ids: Sequence[int], nv: int, nbytes: np.ndarray, batched: np.ndarray,
              owner: np.ndarray, vclass: np.ndarray, P: int) -> np.ndarray:
    """Live bytes per program point, in buckets [batched, other, then (class, param)]."""
    n = len(ops)
    consumers_heavy = np.zeros(nv, bool)
    for op, kind in zip(ops, kinds, strict=True):
        if kind in ("matmul", "heavy"):
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
            if kind == "free" and op.ins:
                roots[o] = frozenset(roots.get(op.ins[0], {op.ins[0]}))
            elif kind == "elementwise" and not consumers_heavy[o]:
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
    return _prune(np.cumsum(diff, axis=0)[: n + 2])


def _prune(live: np.ndarray) -> np.ndarray:
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
