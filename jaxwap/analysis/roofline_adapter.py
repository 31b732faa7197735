"""The one adapter to jax's roofline rules, which price each equation in flops and bytes.

The flops and bytes of an equation come from the per-primitive rules of
`jax.experimental.roofline`, whose registry is private API. `roofline_rules()` is the one
adapter to it: it checks, once and before any cost is computed, that every piece it uses
is still there, and raises a RuntimeError naming what is gone otherwise, rather than
letting every op silently fall back to the generic cost. A primitive jax's roofline does
not know may carry a cost rule of its own (`primitives.PrimInfo.cost`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import Any

import jax

try:
    import jax.experimental.roofline  # noqa: F401 - registers the per-primitive rules
except ImportError:  # reported, with the jax version, by roofline_rules() at first use
    pass

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
