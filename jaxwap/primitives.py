"""What jaxwap knows about each jax primitive, in one table, and how to price one.

Every primitive name maps to a `PrimInfo`: its *kind* (how it costs and fuses), whether
it keeps its operand's layout (so a parameter's dim order carries through it), whether it
is a call whose body the flattener inlines, and, for matmuls, a *layer rule*: which of
the weight operand's dims the op contracts and which are its output features, the dims
tensor parallelism splits. A name not in the table is elementwise, as most of jax's
primitives are. The table is filled by `register` and `register_layer`, in the manner of
`jax.experimental.roofline.register_roofline`, so adding a primitive is one entry here
and never a new name set or `if` branch elsewhere.

The flops and bytes of an equation come from the per-primitive rules of
`jax.experimental.roofline`, whose registry is private API. `roofline_rules()` is the one
adapter to it: it checks, once and before any cost is computed, that every piece it uses
is still there, and raises a RuntimeError naming what is gone otherwise, rather than
letting every op silently fall back to the generic cost.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

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
    """

    kind: str = ELEMENTWISE
    same_layout: bool = False
    inline: bool = False
    layer: LayerRule | None = None
    permutation: Callable[[Any], tuple[int, ...]] | None = None


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
