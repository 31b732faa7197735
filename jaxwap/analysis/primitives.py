"""What jaxwap knows about each jax primitive, in one table.

Every primitive name maps to a `PrimInfo`: its *kind* (how it costs and fuses), whether
it keeps its operand's layout (so a parameter's dim order carries through it), whether it
is a call whose body the flattener inlines, and, for matmuls, a *layer rule*: which of
the weight operand's dims the op contracts and which are its output features, the dims
tensor parallelism splits. A name not in the table is elementwise, as most of jax's
primitives are. The table is filled by `register` and `register_layer`, in the manner of
`jax.experimental.roofline.register_roofline`, so adding a primitive is one entry here
and never a new name set or `if` branch elsewhere. The operands each primitive is linear
in (`register_linear`, `linear_in`) are entries here too.

A *batch rule* says where an equation puts its operands' batch dim and whether it sums
over it; those rules are entries of this table as well, written in
`analysis/batch_rules.py`, which fills them in when imported. The flops and bytes of an
equation come from jax's roofline rules through `analysis/roofline_adapter.py`; a
primitive jax's roofline does not know may carry a cost rule of its own
(`PrimInfo.cost`): cuDNN's fused attention, whose rules, like every other read of its
private surface, live in `analysis/fused_attention.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jaxwap.analysis import fused_attention as attention

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
    `batch`: where the batch dim goes (`batch_rules.default_batch` where None).
    `linear`: the operands the result is linear in (None: all; or a rule), through which a
    partial sum over the batch stays a summand of what it flows into (a gradient, of its
    optimizer's moments)."""

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
register(PrimInfo(FREE), "reshape", "expand_dims", "broadcast_in_dim",
         "name", "tie", "device_put", "scan_slice")
register(PrimInfo(FREE, permutation=lambda eqn: tuple(eqn.params["permutation"])),
         "transpose")
# a squeeze keeps the operand's other dims in order (a stacked weight's one layer, `w[i]`,
# named in the weight's own dims)
register(PrimInfo(FREE, permutation=lambda eqn: tuple(
    k for k in range(len(eqn.invars[0].aval.shape)) if k not in eqn.params["dimensions"])),
    "squeeze")
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


# --------------------------------------------------------------------------- linear rules
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

