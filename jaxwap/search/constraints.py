"""User constraints: layouts a person pins for chosen parameters, the planner searching
everything else around them.

`auto_shard(..., constraints={pattern: layout})` selects parameters by a regular
expression searched in their path (the keys joined by "/", e.g. "blocks/w1" or
"params/Dense_0/kernel") and pins each to a layout: a `PartitionSpec` over jaxwap's mesh
axes ("data", "model"), which is the weight's exact layout, or a strategy family name
from `STRATEGY_FAMILIES` ("replicate", "tp", "zero1", "fsdp", "offload"), which keeps
only that family's layouts for it. The first pattern that matches a parameter pins it; a
pattern that matches none is an error (a typo would otherwise pin nothing, silently).

Flax's logical partitioning metadata (Linen `nn.with_logical_partitioning`, NNX
`nnx.with_partitioning`) becomes constraints through `logical_constraints(params, rules)`:
each annotated parameter pinned to the spec its logical names map to under the rules.

A pin is checked on each mesh the search tries (`LayoutRules.why_not`): a mesh where a
pinned dimension does not divide over its axis is skipped, and where none is left the
error names the parameter, its shape, the spec and the reason.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jax.sharding import PartitionSpec

from jaxwap.analysis.roles import key_token
from jaxwap.core.records import DATA, MODEL, STRATEGY_FAMILIES, Strategy

_AXES = (DATA, MODEL)


@dataclass(frozen=True)
class Constraint:
    """One pin: parameters whose path matches `pattern` (`re.search`) take the weight
    layout `spec` (per-dim axis names or None), or only layouts of `family`."""

    pattern: str
    spec: tuple[str | None, ...] | None = None
    family: str | None = None

    def describe(self) -> str:
        return f"P{self.spec!r}" if self.spec is not None else f"{self.family!r}"


def parse_constraints(value: Any) -> tuple[Constraint, ...]:
    """`{pattern: PartitionSpec | tuple | family name}` (or a sequence of such pairs, in
    order) as checked `Constraint`s; the errors name the offending pattern and entry."""
    if isinstance(value, tuple) and all(isinstance(c, Constraint) for c in value):
        return value                    # already checked (a record remade by replace)
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(
            isinstance(x, (list, tuple)) and len(x) == 2 for x in value):
        pairs = [tuple(x) for x in value]
    else:
        raise TypeError(f"constraints must be a dict of path pattern -> PartitionSpec or "
                        f"strategy name, such as {{'blocks/.*kernel': P(None, 'model')}}, "
                        f"got {value!r}")
    out = []
    for pattern, layout in pairs:
        if not isinstance(pattern, str):
            raise TypeError(f"constraints: the pattern {pattern!r} must be a str (a regular "
                            f"expression over parameter paths such as 'blocks/w1')")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"constraints: the pattern {pattern!r} is not a regular "
                             f"expression: {e}") from None
        if isinstance(layout, Constraint):
            layout = layout.spec if layout.spec is not None else layout.family
        if isinstance(layout, str):
            if layout not in STRATEGY_FAMILIES:
                raise ValueError(f"constraints[{pattern!r}] = {layout!r}: a strategy name "
                                 f"must be one of {STRATEGY_FAMILIES}")
            out.append(Constraint(pattern, family=layout))
            continue
        if isinstance(layout, PartitionSpec):
            layout = tuple(layout)
        if not isinstance(layout, (tuple, list)):
            raise TypeError(f"constraints[{pattern!r}] = {layout!r}: give a PartitionSpec "
                            f"(or a tuple of axis names and None) or a strategy name")
        for entry in layout:
            if entry is not None and entry not in _AXES:
                raise ValueError(f"constraints[{pattern!r}] = {layout!r}: axis {entry!r} is "
                                 f"not in jaxwap's mesh (its axes: {_AXES}; one axis per dim)")
        named = [a for a in layout if a is not None]
        if len(named) != len(set(named)):
            raise ValueError(f"constraints[{pattern!r}] = {layout!r}: an axis may shard "
                             f"one dim only")
        out.append(Constraint(pattern, spec=tuple(layout)))
    return tuple(out)


def path_string(path: Sequence[str]) -> str:
    """The path a constraint's pattern is searched in: the keys joined by "/"."""
    return "/".join(str(k) for k in path)


@dataclass(frozen=True)
class LayoutRules:
    """The layouts a search may give: the strategy families allowed (None: all) and,
    per parameter index, its pin. One record travels from the planner to every place that
    makes a parameter's candidate layouts (`strategies.param_strategies`)."""

    families: frozenset[str] | None = None
    pins: tuple[tuple[int, Constraint], ...] = ()
    #: parameters whose weight stays whole over the data axis (no FSDP; ZeRO-1 may still
    #: split their optimizer state): a pipeline's stacked weights, which a loop over the
    #: stages would gather on every loop step (`pipeline_search`), where an ordinary step
    #: gathers them once a pass
    whole_over_data: frozenset[int] = frozenset()

    def pin(self, j: int) -> Constraint | None:
        return next((c for i, c in self.pins if i == j), None)

    def keeping_whole(self, params: Iterable[int]) -> LayoutRules:
        """These rules with `params` (indices) also kept whole over the data axis."""
        return dataclasses.replace(self, whole_over_data=self.whole_over_data | set(params))

    def admits(self, s: Strategy) -> bool:
        """Whether the families allow this layout (pins aside)."""
        return self.families is None or s.families <= self.families

    @property
    def forced(self) -> bool:
        """Whether the families force a split (replicated is not among them)."""
        return self.families is not None and "replicate" not in self.families

    def apply(self, j: int, options: Sequence[Strategy], shape: Sequence[int],
              layer: Any, m: int = 2) -> tuple[Strategy, ...]:
        """Parameter j's layouts under its pin (all of `options` when it has none): the
        generated ones that obey it, named as pinned, or for a spec no generated layout
        has, that spec itself (its model-axis dim priced as the layer's column or row
        split). On a mesh whose model axis `m` is 1 a spec's model entries split nothing,
        so a generated layout without them obeys it (a Flax rule sharding a norm scale
        over the tensor axis holds on a data-only mesh); the plan keeps the spec as given.
        Empty when the pin cannot hold here (`why_not` says why)."""
        c = self.pin(j)
        if c is None:
            return tuple(options)
        if c.family is not None:
            kept = [s for s in options if (s.families == {"replicate"}
                                           if c.family == "replicate"
                                           else c.family in s.families)]
        else:
            spec = c.spec if m > 1 else tuple(None if a == MODEL else a for a in c.spec)
            kept = [dataclasses.replace(s, spec=c.spec) for s in options
                    if tuple(s.spec) == spec]
            if not kept and len(c.spec) == len(shape):
                kind = _model_kind(c.spec, layer)
                if kind is not None:
                    kept = [Strategy({"col": "tp-col", "row": "tp-row"}.get(kind, "spec"),
                                     c.spec, tp=kind, data_sharded=DATA in c.spec)]
        return tuple(dataclasses.replace(s, name=f"{s.name}, pinned") for s in kept)

    def why_not(self, params: Sequence[Any], d: int, m: int, layers: Mapping[int, Any],
                options: Any) -> str | None:
        """Why the pins cannot all hold on a (d, m) mesh (`params` the graph's ParamInfo,
        `layers` by parameter index, `options(j)` parameter j's generated layouts), or
        None when they can."""
        for j, c in self.pins:
            p, generated = params[j], options(j)
            where = f"{path_string(p.path)} with shape {tuple(p.shape)}, constraint {c.describe()}"
            if c.spec is not None:
                if len(c.spec) != len(p.shape):
                    return f"{where}: the spec names {len(c.spec)} dims, the parameter has " \
                           f"{len(p.shape)}"
                for dim, axis in enumerate(c.spec):
                    size = {DATA: d, MODEL: m}.get(axis, 1)
                    if p.shape[dim] % size:
                        return (f"{where}: dim {dim} ({p.shape[dim]}) is not divisible by the "
                                f"{axis} axis of size {size} on a {d}x{m} mesh")
                if (m > 1 and MODEL in c.spec and _model_kind(c.spec, layers.get(j)) is None
                        and not any(tuple(s.spec) == c.spec for s in generated)):
                    return (f"{where}: the model axis on dim {c.spec.index(MODEL)} is not a "
                            f"feature dim of a layer jaxwap prices as tensor-parallel, nor "
                            f"the feature dim of a bias whose kernel's column split it follows")
            if not self.apply(j, generated, p.shape, layers.get(j), m):
                what = f"{c.family!r} layout" if c.family else "layout it allows"
                return f"{where}: no {what} on a {d}x{m} mesh"
        return None


def _model_kind(spec: Sequence[str | None], layer: Any) -> str | None:
    """The tensor-parallel kind of a spec: "none" without the model axis, "col" / "row"
    where it splits the layer's output / contracted feature dim, None otherwise."""
    if MODEL not in spec:
        return "none"
    if layer is None:
        return None
    dim = list(spec).index(MODEL)
    return "col" if dim in layer.out_dims else "row" if dim in layer.in_dims else None


def resolve(constraints: Sequence[Constraint], params: Sequence[Any],
            families: frozenset[str] | None = None) -> LayoutRules:
    """The rules for a step's parameters (`ParamInfo`s, in leaf order): each parameter
    pinned by the first constraint whose pattern its path matches. A pattern matching no
    parameter raises, naming it and some paths."""
    pins: dict[int, Constraint] = {}
    for c in constraints:
        hits = [j for j, p in enumerate(params) if re.search(c.pattern, path_string(p.path))]
        if not hits:
            shown = ", ".join(path_string(p.path) for p in params[:8])
            raise ValueError(f"constraints: the pattern {c.pattern!r} matches no parameter "
                             f"path (paths look like: {shown}{', ...' if len(params) > 8 else ''})")
        for j in hits:
            pins.setdefault(j, c)
    return LayoutRules(families, tuple(sorted(pins.items())))


def logical_constraints(params: Any, rules: Sequence[tuple[str, Any]] | None = None
                        ) -> dict[str, tuple[str | None, ...]]:
    """Constraints from Flax partitioning metadata: Linen `nn.LogicallyPartitioned` /
    `nn.Partitioned` boxes (`nn.with_logical_partitioning`, `nn.with_partitioning`) or an
    NNX state whose variables carry sharding metadata (`nnx.with_partitioning`).

    Logical names map to mesh axes through `rules` (`logical_axis_rules` pairs such as
    `(("embed", None), ("mlp", "model"))`) as Flax maps them
    (`nn.logical_to_mesh_axes`): the first rule for a name whose mesh axis the spec has
    not used yet, and a name no rule places is replicated, so a Flax example's own rules
    work with the names they leave out. A name that is itself a jaxwap mesh axis ("data",
    "model": `nn.with_partitioning` boxes) passes as it is. A rule that maps a name to an
    axis jaxwap's mesh does not have is an error naming both. Returns `{exact path
    pattern: spec}` for `auto_shard(..., constraints=...)`; the paths are those of the
    unboxed parameters the step receives."""
    import jax

    specs = _flax_specs(params)
    out: dict[str, tuple[str | None, ...]] = {}
    for path, spec in jax.tree_util.tree_flatten_with_path(
            specs, is_leaf=lambda x: isinstance(x, tuple) or x is None)[0]:
        if spec is None:
            continue
        axes = _mesh_axes(spec, rules or (), jax.tree_util.keystr(path))
        # an NNX state's leaves sit one key deeper, at the variable's "value"
        out["^" + re.escape(path_string([key_token(k) for k in path])) + "(/value)?$"] = axes
    return out


def _mesh_axes(spec: Sequence[str | None], rules: Sequence[tuple[str, Any]], where: str
               ) -> tuple[str | None, ...]:
    """One parameter's logical `spec` as jaxwap mesh axes under `rules`, by Flax's rule
    (`flax.linen.spmd._logical_to_mesh_axes`): rules in order, each placing the first dim
    of its name that is still unplaced when its axis is still free."""
    def axes_of(name: str, value: Any) -> tuple[str, ...]:
        names = (value,) if isinstance(value, str) else tuple(value or ())
        for axis in names:
            if axis not in _AXES:
                raise ValueError(f"{where}: the rule ({name!r}, {value!r}) maps logical axis "
                                 f"{name!r} to {axis!r}, not a jaxwap mesh axis {_AXES}; "
                                 f"map it to one of those or to None")
        if len(names) > 1:
            raise ValueError(f"{where}: the rule ({name!r}, {value!r}) shards one dim over "
                             f"{len(names)} axes; jaxwap shards a dim over one axis")
        return names

    placed: list[Any] = [_UNPLACED] * len(spec)
    for name, value in rules:
        if name not in spec:
            continue
        names = axes_of(name, value)
        pos = list(spec).index(name)
        used = {p for p in placed if isinstance(p, str)}
        if placed[pos] is _UNPLACED and not set(names) & used:
            placed[pos] = names[0] if names else None
    used = {p for p in placed if isinstance(p, str)}
    return tuple(
        p if p is not _UNPLACED
        else (n if n in _AXES and n not in used else None) for n, p in zip(
            spec, placed, strict=True))


_UNPLACED = object()


def _flax_specs(params: Any) -> Any:
    """A tree like the unboxed parameters with each annotated leaf's spec (a tuple of
    names or None) and None elsewhere."""
    import jax

    def spec_of(x: Any) -> Any:
        names = getattr(x, "names", None)                       # Linen boxes
        if names is None:
            meta = getattr(x, "get_metadata", None)             # NNX variables
            md = meta() if callable(meta) else {}
            names = md.get("out_sharding", md.get("sharding", md.get("sharding_names")))
        return tuple(names) if names is not None else None

    def boxed(x: Any) -> bool:
        return hasattr(x, "unbox") or hasattr(x, "get_metadata")

    return jax.tree_util.tree_map(spec_of, params, is_leaf=boxed)


__all__ = ["Constraint", "LayoutRules", "logical_constraints",
           "parse_constraints", "path_string", "resolve"]
