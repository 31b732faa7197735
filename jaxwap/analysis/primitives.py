"""What jaxwap knows about each jax primitive, in one table, and how to price one.

Every primitive name maps to a `PrimInfo`: its *kind* (how it costs and fuses), whether
it keeps its operand's layout (so a parameter's dim order carries through it), whether it
is a call whose body the flattener inlines, and, for matmuls, a *layer rule*: which of
the weight operand's dims the op contracts and which are its output features, the dims
tensor parallelism splits. A name not in the table is elementwise, as most of jax's
primitives are. The table is filled by `register` and `register_layer`, in the manner of
`jax.experimental.roofline.register_roofline`, so adding a primitive is one entry here
and never a new name set or `if` branch elsewhere. A *batch rule* (`register_batch`) says
where an equation puts its operands' batch dim and whether it sums over it (a partial sum
XLA all-reduces under data parallelism: a weight gradient, a loss, a statistic).

The flops and bytes of an equation come from the per-primitive rules of
`jax.experimental.roofline`, whose registry is private API. `roofline_rules()` is the one
adapter to it: it checks, once and before any cost is computed, that every piece it uses
is still there, and raises a RuntimeError naming what is gone otherwise, rather than
letting every op silently fall back to the generic cost. A primitive jax's roofline does
not know may carry a cost rule of its own (`PrimInfo.cost`): cuDNN's fused attention,
whose rules, like every other read of its private surface, live in `analysis/fused_attention.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from jaxwap.analysis import fused_attention as attention

try:
    import jax.experimental.roofline  # noqa: F401 - registers the per-primitive rules
except ImportError:  # reported, with the jax version, by roofline_rules() at first use
    pass

MATMUL, FREE, HEAVY, ELEMENTWISE = "matmul", "free", "heavy", "elementwise"


@dataclass(frozen=True, slots=True)
class LayerDims:
    """A weight operand's dims, in its own numbering: `in_dims` are contracted (row
    sharding splits one and all-reduces partial sums), `out_dims` are output features
    (column sharding splits one and leaves the activation sharded)."""

    in_dims: tuple[int, ...]
    out_dims: tuple[int, ...]


# (equation, position of the weight operand) -> its dims, or None: not a layer that way
LayerRule = Callable[[Any, int], LayerDims | None]
# (equation, each operand's batch dim or None) -> (each result's batch dim or None, whether
# it sums over the batch dim: a per-device partial sum, which data parallelism all-reduces)
Batched = tuple[list[int | None], bool]
BatchRule = Callable[[Any, Sequence[int | None]], Batched]
# (equation, operand position) -> whether the result is linear in that operand
LinearRule = Callable[[Any, int], bool]
# equation -> (flops, memory traffic in bytes): a primitive's own cost rule
CostRule = Callable[[Any], tuple[float, float]]


@dataclass(frozen=True, slots=True)
class PrimInfo:
    """One primitive as the cost model sees it.

    kind: "matmul" (tensor-core work; a layer when it has a layer rule), "free"
    (layout-only: XLA bitcasts it or fuses it into its consumer), "heavy" (starts its own
    kernel: reductions, data movement, control flow, collectives) or "elementwise"
    (fuses with its neighbours). `same_layout`: the result has the operand's shape and dim
    order, so a parameter's dim map passes through. `inline`: a call whose body is
    flattened into the caller. `layer`: for a matmul, its layer rule. `permutation`: for
    an op that reorders dims, the operand dim each result dim is (from the equation).
    `batch`: where the batch dim goes (`default_batch` where None). `linear`: the operands
    the result is linear in (None: all; or a rule), through which a partial sum over the
    batch stays a summand of what it flows into (a gradient, of its optimizer's moments).
    """

    kind: str = ELEMENTWISE
    same_layout: bool = False
    inline: bool = False
    layer: LayerRule | None = None
    permutation: Callable[[Any], tuple[int, ...]] | None = None
    batch: BatchRule | None = None
    linear: tuple[int, ...] | LinearRule | None = ()
    cost: CostRule | None = None


_TABLE: dict[str, PrimInfo] = {}
_DEFAULT = PrimInfo()


def register(info: PrimInfo, *names: str) -> None:
    """Record `info` for every primitive in `names`."""
    for name in names:
        _TABLE[name] = info


def register_layer(*names: str) -> Callable[[LayerRule], LayerRule]:
    """Decorator: `names` are matmuls whose weight dims the decorated rule gives."""
    def wrap(rule: LayerRule) -> LayerRule:
        register(PrimInfo(MATMUL, layer=rule), *names)
        return rule
    return wrap


def prim_info(name: str) -> PrimInfo:
    """The table's entry for primitive `name`; elementwise for a name it lacks."""
    return _TABLE.get(name, _DEFAULT)


# --------------------------------------------------------------------------- the table
register(PrimInfo(inline=True), "pjit", "jit", "closed_call", "core_call", "remat",
         "remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call",
         "custom_vjp_call_jaxpr", "custom_lin")
register(PrimInfo(FREE, same_layout=True), "convert_element_type", "copy", "copy_p",
         "stop_gradient", "reduce_precision", "pvary", "sharding_constraint",
         "optimization_barrier")
register(PrimInfo(FREE), "reshape", "squeeze", "expand_dims", "broadcast_in_dim",
         "name", "tie", "device_put", "scan_slice")
register(PrimInfo(FREE, permutation=lambda eqn: tuple(eqn.params["permutation"])),
         "transpose")
register(PrimInfo(HEAVY), "reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
         "reduce_and", "reduce_or", "reduce_xor", "reduce", "argmax", "argmin", "gather",
         "scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max",
         "scatter-sub", "select_and_scatter_add", "select_and_scatter",
         "select_and_gather_add", "reduce_window_sum", "reduce_window_max",
         "reduce_window_min", "reduce_window", "sort", "cumsum", "cumprod", "cummax",
         "cummin", "cumlogsumexp", "top_k", "dynamic_update_slice", "fft", "while", "scan",
         "cond", "custom_linear_solve", "cholesky", "triangular_solve", "lu", "qr", "eigh",
         "svd", "random_bits", "threefry2x32", "rng_bit_generator", "shard_map",
         "all_gather", "psum", "reduce_scatter", "all_to_all", "ppermute", "scan_stack")
# cuDNN's fused attention: tensor-core work of its own (no weight: no layer rule), priced
# by its own rule, the batch and heads carried to its results (`analysis/fused_attention.py`)
register(PrimInfo(MATMUL, batch=attention.fused_batch, cost=attention.fused_cost),
         *attention.PRIMITIVES)


def _features(ndim: int, *taken: tuple[int, ...]) -> tuple[int, ...]:
    """The dims of an ndim-array that are in none of `taken`: its output features."""
    used = {d for dims in taken for d in dims}
    return tuple(d for d in range(ndim) if d not in used)


@register_layer("dot_general")
def _dot_general_layer(eqn: Any, w: int) -> LayerDims | None:
    """Either operand can be the weight; its contracting dims are in, the rest (bar the
    batch dims) out."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    contract, batch = (rc, rb) if w == 1 else (lc, lb)
    ndim = len(eqn.invars[w].aval.shape)
    return LayerDims(tuple(contract), _features(ndim, tuple(contract), tuple(batch)))


@register_layer("conv_general_dilated")
def _conv_layer(eqn: Any, w: int) -> LayerDims | None:
    """The kernel (rhs) is the weight: its input-feature dim is in, its output-feature dim
    out. A grouped or depthwise conv is not split this way."""
    p = eqn.params
    if w != 1 or p.get("feature_group_count", 1) != 1 or p.get("batch_group_count", 1) != 1:
        return None
    rhs_spec = p["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
    return LayerDims((rhs_spec[1],), (rhs_spec[0],))


@register_layer("ragged_dot_general")
def _ragged_dot_layer(eqn: Any, w: int) -> LayerDims | None:
    """The rhs [groups, k, n] of a grouped matmul (mixture of experts) is the weight: its
    contracting dims are in; dims neither contracted nor batch nor group are out."""
    if w != 1:
        return None
    dn = eqn.params["ragged_dot_dimension_numbers"]
    (_, rc), (_, rb) = dn.dot_dimension_numbers
    ndim = len(eqn.invars[w].aval.shape)
    return LayerDims(tuple(rc), _features(ndim, tuple(rc), tuple(rb),
                                          tuple(dn.rhs_group_dimensions)))


# --------------------------------------------------------------------------- batch rules
def register_linear(operands: tuple[int, ...] | LinearRule | None, *names: str) -> None:
    """`names` are linear in `operands` (None: in every operand; a rule: where it says)."""
    for name in names:
        _TABLE[name] = dataclasses.replace(prim_info(name), linear=operands)


register_linear(None, "add", "sub", "add_any", "neg", "mul", "dot_general",
                "conv_general_dilated", "ragged_dot_general", "reduce_sum", "cumsum",
                "convert_element_type", "copy", "copy_p", "reduce_precision", "pvary",
                "sharding_constraint", "optimization_barrier", "reshape", "squeeze",
                "expand_dims", "broadcast_in_dim", "transpose", "concatenate", "device_put",
                "scan_slice", "scan_stack")
register_linear((0,), "div", "pad", "slice", "dynamic_slice", "gather", "rev")
register_linear((0, 1), "dynamic_update_slice")
register_linear((0, 2), "scatter-add")
register_linear(tuple(range(1, 16)), "select_n")
register_linear(lambda eqn, _: eqn.params.get("y") == 1, "integer_pow")  # optax's g**1


def linear_in(eqn: Any, name: str, position: int) -> bool:
    """Whether an equation of primitive `name` is linear in its operand at `position`."""
    ops = prim_info(name).linear
    if callable(ops):
        return bool(ops(eqn, position))
    return ops is None or position in ops


def register_batch(*names: str) -> Callable[[BatchRule], BatchRule]:
    """Decorator: the batch rule of `names` (their entries otherwise unchanged)."""
    def wrap(rule: BatchRule) -> BatchRule:
        for name in names:
            _TABLE[name] = dataclasses.replace(prim_info(name), batch=rule)
        return rule
    return wrap


def batch_rule(name: str) -> BatchRule:
    """Primitive `name`'s batch rule (`default_batch` where it has none)."""
    return prim_info(name).batch or default_batch


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(getattr(v, "aval", None), "shape", ()))


def default_batch(eqn: Any, axes: Sequence[int | None]) -> Batched:
    """A result keeps an operand's batch dim where it has that operand's shape, or at
    least its rank and that dim's size (elementwise ops, windows, pads, sorts, splits)."""
    ins = [(_shape(v), a) for v, a in zip(eqn.invars, axes, strict=True) if a is not None]
    out: list[int | None] = []
    for v in eqn.outvars:
        shape = _shape(v)
        same = next((a for s, a in ins if s == shape), None)
        if same is None:
            same = next((a for s, a in ins if len(s) == len(shape) and s[a] == shape[a]), None)
        out.append(same)
    return out, False


def _one(eqn: Any, axis: int | None, partial: bool = False) -> Batched:
    return [axis] + [None] * (len(eqn.outvars) - 1), partial


@register_batch("broadcast_in_dim")
def _broadcast_batch(eqn: Any, axes: Sequence[int | None]) -> Batched:
    a = axes[0]
    return _one(eqn, None if a is None else eqn.params["broadcast_dimensions"][a])


@register_batch("transpose")
def _transpose_batch(eqn: Any, axes: Sequence[int | None]) -> Batched:
    a = axes[0]
    return _one(eqn, None if a is None else list(eqn.params["permutation"]).index(a))


@register_batch("reshape")
def _reshape_batch(eqn: Any, axes: Sequence[int | None]) -> Batched:
    """The batch dim goes to the result dim that starts at the same element offset,
    merged with minor dims or split (its major part carries the sharding)."""
    a, src, dst = axes[0], _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if a is None:
        return _one(eqn, None)
    prefix, p = math.prod(src[:a]), 1
    for b, n in enumerate(dst):
        if p == prefix and n != 1 and (n % src[a] == 0 or src[a] % n == 0):
            return _one(eqn, b)
        p *= n
    return _one(eqn, None)


@register_batch("squeeze")
def _squeeze_batch(eqn: Any, axes: Sequence[int | None]) -> Batched:
    a, dims = axes[0], tuple(eqn.params["dimensions"])
    return _one(eqn, None if a is None or a in dims else a - sum(d < a for d in dims))


@register_batch("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                "reduce_or", "reduce_xor", "argmax", "argmin")
def _reduce_batch(eqn: Any, axes: Sequence[int | None]) -> Batched:
    a, red = axes[0], tuple(eqn.params["axes"])
    if a is None:
        return _one(eqn, None)
    if a in red:
        return _one(eqn, None, True)
    return _one(eqn, a - sum(d < a for d in red))


@register_batch("dot_general")
def _dot_batch(eqn: Any, axes: Sequence[int | None]) -> Batched:
    """Contracting the batch dim (dW = x^T dy) leaves a partial sum; otherwise the dim
    lands among the result's batch, lhs-free or rhs-free dims."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    la, ra = axes[0], axes[1]
    if la in lc or ra in rc:
        return _one(eqn, None, True)
    if la is not None:
        if la in lb:
            return _one(eqn, list(lb).index(la))
        free = [d for d in range(len(_shape(eqn.invars[0]))) if d not in lc and d not in lb]
        return _one(eqn, len(lb) + free.index(la))
    if ra is not None:
        if ra in rb:
            return _one(eqn, list(rb).index(ra))
        nl = len(_shape(eqn.invars[0])) - len(lc) - len(lb)
        free = [d for d in range(len(_shape(eqn.invars[1]))) if d not in rc and d not in rb]
        return _one(eqn, len(lb) + nl + free.index(ra))
    return _one(eqn, None)


@register_batch("conv_general_dilated")
def _conv_batch(eqn: Any, axes: Sequence[int | None]) -> Batched:
    """The lhs batch dim maps to the result's; the kernel gradient contracts the batch
    (as the lhs feature or rhs input-feature dim, or in batch groups): a partial sum."""
    dn, p = eqn.params["dimension_numbers"], eqn.params
    la, ra = axes[0], axes[1]
    if la is not None:
        if la == dn.lhs_spec[0] and p.get("batch_group_count", 1) == 1:
            return _one(eqn, dn.out_spec[0])
        if la in dn.lhs_spec[2:]:
            return _one(eqn, dn.out_spec[2 + list(dn.lhs_spec[2:]).index(la)])
        return _one(eqn, None, True)
    if ra is not None:
        if ra == dn.rhs_spec[0]:
            return _one(eqn, dn.out_spec[1])
        return _one(eqn, None, True)
    return _one(eqn, None)


@register_batch("gather")
def _gather_batch(eqn: Any, axes: Sequence[int | None]) -> Batched:
    """A batched index array's dims are the result's non-offset dims; a batched operand's
    batch dim is a batching dim (paired with an index dim) or a kept slice dim."""
    dn = eqn.params["dimension_numbers"]
    oa, ia = axes[0], axes[1]
    rank = len(_shape(eqn.outvars[0]))
    rest = [d for d in range(rank) if d not in dn.offset_dims]
    if oa is not None and oa in dn.operand_batching_dims:
        ia = dn.start_indices_batching_dims[list(dn.operand_batching_dims).index(oa)]
    if ia is not None and ia < len(_shape(eqn.invars[1])) - 1:
        return _one(eqn, rest[ia])
    dropped = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
    kept = [d for d in range(len(_shape(eqn.invars[0]))) if d not in dropped]
    if oa is not None and oa in kept:
        return _one(eqn, dn.offset_dims[kept.index(oa)])
    return _one(eqn, None)


@register_batch("scatter-add", "scatter", "scatter-mul", "scatter-min", "scatter-max",
                "scatter-sub")
def _scatter_batch(eqn: Any, axes: Sequence[int | None]) -> Batched:
    """Updates scattered into an operand without a batch dim (an embedding's gradient)
    from every batch row are a partial sum; a batched operand, or a batch dim that is a
    window or batching dim of the updates, stays batched."""
    dn = eqn.params["dimension_numbers"]
    oa, ua = axes[0], axes[2]
    if oa is not None or ua is None:
        return _one(eqn, oa)
    if ua in dn.update_window_dims:
        dropped = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
        window = [d for d in range(len(_shape(eqn.invars[0]))) if d not in dropped]
        return _one(eqn, window[list(dn.update_window_dims).index(ua)])
    scatter = [d for d in range(len(_shape(eqn.invars[2]))) if d not in dn.update_window_dims]
    s = scatter.index(ua)
    if s in dn.scatter_indices_batching_dims:
        return _one(eqn, dn.operand_batching_dims[
            list(dn.scatter_indices_batching_dims).index(s)])
    return _one(eqn, None, True)


@register_batch("ragged_dot_general")
def _ragged_dot_batch(eqn: Any, axes: Sequence[int | None]) -> Batched:
    (lc, _), _ = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
    if axes[0] in lc:
        return _one(eqn, None, True)
    return default_batch(eqn, axes)


@register_batch("scan_slice")
def _scan_slice_batch(eqn: Any, axes: Sequence[int | None]) -> Batched:
    """One iteration's slice of a scanned input (an iteration over batch rows holds none)."""
    a = axes[0]  # (synthetic equations carry no variables: one operand, one result)
    return [None if a is None or a == 0 else a - 1], False


@register_batch("scan_stack")
def _scan_stack_batch(eqn: Any, axes: Sequence[int | None]) -> Batched:
    return [None if axes[0] is None else axes[0] + 1], False


# --------------------------------------------------------------------------- roofline
_ROOFLINE_MODULE = "jax.experimental.roofline.roofline"
_CTX_FIELDS = ("name_stack", "primitive", "avals_in", "avals_out", "jaxpr_eqn_ctx", "mesh",
               "pin_lhs_in_vmem", "pin_rhs_in_vmem")


def _outdated(what: str) -> RuntimeError:
    return RuntimeError(
        f"jax {jax.__version__} changed the private API of jax.experimental.roofline that "
        f"jaxwap prices operations with: {what}. jaxwap needs updating for this jax "
        f"version (or install a jax it supports).")


@dataclass(frozen=True)
class RooflineRules:
    """jax's per-primitive roofline rules, checked to have the shape jaxwap calls them in."""

    rules: dict[Any, Any]
    context: Any      # RooflineRuleContext
    shape: Any        # RooflineShape

    def cost(self, eqn: Any) -> tuple[float, float] | None:
        """(flops, hbm bytes) of `eqn` by jax's rule, or None: no rule, or the rule cannot
        price this equation (the caller falls back to a generic cost and records it)."""
        rule = self.rules.get(eqn.primitive)
        if rule is None:
            return None
        try:
            avals_in = [a.aval for a in eqn.invars]
            ctx = self.context(
                name_stack=eqn.source_info.name_stack, primitive=eqn.primitive,
                avals_in=avals_in, avals_out=[v.aval for v in eqn.outvars],
                jaxpr_eqn_ctx=eqn.ctx, mesh=None, pin_lhs_in_vmem=False,
                pin_rhs_in_vmem=False)
            res = rule(ctx, *(self.shape.from_aval(a) for a in avals_in), **eqn.params)
        except Exception:  # noqa: BLE001 - a rule that cannot price this eqn: fall back
            return None
        # some rules (conv_general_dilated) fill only the unfused counts
        return (float(max(res.flops, res.unfused_flops)),
                float(res.hbm_bytes or res.unfused_hbm_bytes))


@functools.cache
def roofline_rules() -> RooflineRules:
    """The checked adapter to jax's roofline registry (checked once, on first use, so that
    importing jaxwap never fails; a RuntimeError naming what is missing if jax moved it)."""
    try:
        module = importlib.import_module(_ROOFLINE_MODULE)
    except ImportError as e:
        raise _outdated(f"module {_ROOFLINE_MODULE} cannot be imported ({e})") from e
    rules = getattr(module, "_rooflines", None)
    if not isinstance(rules, dict):
        raise _outdated(f"{_ROOFLINE_MODULE}._rooflines (the rule registry) is missing")
    context = getattr(module, "RooflineRuleContext", None)
    if context is None or not dataclasses.is_dataclass(context):
        raise _outdated(f"{_ROOFLINE_MODULE}.RooflineRuleContext is missing")
    fields = {f.name: f for f in dataclasses.fields(context)}
    missing = [n for n in _CTX_FIELDS if n not in fields]
    required = [n for n, f in fields.items() if n not in _CTX_FIELDS
                and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    if missing or required:
        raise _outdated(f"RooflineRuleContext lacks the fields {missing} and requires the "
                        f"new fields {required}")
    shape = getattr(module, "RooflineShape", None)
    if shape is None or not callable(getattr(shape, "from_aval", None)):
        raise _outdated(f"{_ROOFLINE_MODULE}.RooflineShape.from_aval is missing")
    return RooflineRules(rules, context, shape)
