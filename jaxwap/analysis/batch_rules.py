"""Batch rules: where each primitive puts its operands' batch dim, and whether it sums it.

A batch rule takes an equation and each operand's batch dim (or None) and gives each
result's batch dim and whether the equation sums over the batch: a per-device partial sum
(a weight gradient, a loss, a statistic) that XLA all-reduces under data parallelism.
The rules are entries of the primitive table (`PrimInfo.batch`, `primitives.py`); this
module writes them there when it is imported, and `batch_rule` (which reads them) lives
here, so whoever asks for a rule has imported them all. A primitive without a rule gets
`default_batch`, which follows shapes: right for elementwise ops, windows, pads and sorts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from jaxwap.analysis.primitives import Batched, BatchRule, prim_info, register


def register_batch(*names: str) -> Callable[[BatchRule], BatchRule]:
    """Decorator: the batch rule of `names` (their entries otherwise unchanged)."""
    def wrap(rule: BatchRule) -> BatchRule:
        for name in names:
            register(dataclasses.replace(prim_info(name), batch=rule), name)
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
