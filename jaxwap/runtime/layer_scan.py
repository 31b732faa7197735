"""The layer stack of a loss function, found in its jaxpr and run as a pipeline.

Most large JAX models run their repeated blocks as one `lax.scan` over parameters stacked
along a leading layer dim (`nn.scan`, `nnx.scan`, a hand-written scan). `find_layer_scan`
finds that scan in the loss function's jaxpr, from abstract arguments alone: a scan at
the top level of the loss (or inside a `jax.jit` it calls) that carries one activation
with the batch leading, iterates over stacked parameter leaves (directly, or through
dtype casts for mixed precision), stacks no per-layer outputs anyone reads, and closes
over nothing computed from the batch. Among several, the one whose stacked parameters
hold the most bytes. A scan jaxwap cannot pipeline raises `NoLayerScan`, whose message
says what is missing; the planner shows it in `explain()`.

`pipelined_loss` evaluates the same jaxpr equation by equation with that one scan
replaced by `schedule.pipelined` over the stage axis of the mesh it is traced in: the
user's code is unchanged, and the rewritten loss is ordinary JAX, so `jax.grad` of it is
the backward pipeline. A stage runs the scan's body on its local micro-batch, so the
loss is traced again at that size (a layer may reshape with its batch size) in the
context the body runs in, the pipeline's `shard_map` (every mesh axis manual: jax caches
the traces of jitted helpers and custom derivative rules by context). There, nested
`jax.jit` calls are inlined and sharding constraints dropped, since a stage lays out its
own rows; a constraint given as a bare `PartitionSpec` does not trace there, and is
refused with `NoLayerScan` (a `NamedSharding` one works).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal
from jax.sharding import AxisType

from jaxwap.analysis.flatten import bind, evaluate, scan_counts
from jaxwap.core.records import STAGE
from jaxwap.runtime.schedule import pipelined, stage_order, to_stages

# calls the search looks through and the rewrite inlines: the scan may sit inside one
_CALLS = frozenset({"jit", "pjit", "closed_call"})
# inside a stage the rows are the stage's own: their layout constraints do not apply
_STAGE_IDENTITY = frozenset({"sharding_constraint"})
# what a user wrote, for the primitives that can hide a scan from the search
_WRITTEN = {"remat2": "jax.checkpoint", "checkpoint": "jax.checkpoint", "cond": "lax.cond",
            "while": "lax.while_loop", "custom_jvp_call": "a jax.custom_jvp function",
            "custom_vjp_call": "a jax.custom_vjp function", "shard_map": "jax.shard_map"}


class NoLayerScan(ValueError):
    """Why a loss function's layers cannot be pipelined (the message says what is
    missing)."""


@dataclass(frozen=True)
class LayerScan:
    """The layer scan of a loss function: its length, which parameter leaves (indices
    into `jax.tree_util.tree_leaves(params)`) it iterates over, and its carried
    activation, batch leading. `path` locates it in the jaxpr (equation indices, through
    nested `jax.jit` calls); `pipelined_loss` finds it again by that."""

    length: int
    stacked: tuple[int, ...]
    carry_shape: tuple[int, ...]
    carry_dtype: str
    batch_size: int
    path: tuple[int, ...] = ()

    @property
    def carry_row_bytes(self) -> int:
        """Bytes of one batch row of the carried activation: what a stage sends per row."""
        return int(np.prod(self.carry_shape[1:], dtype=np.int64)
                   * np.dtype(self.carry_dtype).itemsize)


def _abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype")
                                       else jnp.result_type(x)), tree)


def _batch_size(batch: Any) -> int:
    """The leading dim every batch leaf shares: the rows micro-batches split."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise NoLayerScan("the batch has no arrays, so no batch dim to split into "
                          "micro-batches")
    first, size = None, 0
    for path, x in leaves:
        where = f"batch{jax.tree_util.keystr(path)}"
        if np.ndim(x) == 0:
            raise NoLayerScan(f"{where} is a scalar: pipelining splits every batch leaf "
                              f"along its leading (batch) dim")
        if first is None:
            first, size = where, int(np.shape(x)[0])
        elif np.shape(x)[0] != size:
            raise NoLayerScan(f"the batch leaves disagree on the leading (batch) dim: "
                              f"{first} has {size} rows, {where} has {np.shape(x)[0]}")
    return size


def _trace(loss_fn: Callable, params: Any, batch: Any) -> tuple[ClosedJaxpr, Any]:
    """(closed jaxpr, output tree) of the loss on abstract arguments."""
    closed, out = jax.make_jaxpr(loss_fn, return_shape=True)(_abstract(params),
                                                             _abstract(batch))
    return closed, jax.tree_util.tree_structure(out)


def _inner(eqn: Any) -> ClosedJaxpr:
    """The closed jaxpr a call equation (`_CALLS`) runs."""
    return eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]


def _sub_jaxprs(params: dict[str, Any]) -> Iterator[Jaxpr]:
    for v in params.values():
        for x in (v if isinstance(v, tuple | list) else (v,)):
            if isinstance(x, ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, Jaxpr):
                yield x


def _has_scan(jaxpr: Jaxpr) -> bool:
    return any(e.primitive.name == "scan" or any(_has_scan(j) for j in _sub_jaxprs(e.params))
               for e in jaxpr.eqns)


def _is_var(v: Any) -> bool:
    return not isinstance(v, Literal | DropVar)


class _Search:
    """The candidates among a loss jaxpr's scans, the reasons the others were refused
    (weighted by their per-layer inputs' bytes: the most promising scan's reason is the
    one reported), and the names of equations that hide a scan from the search."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.found: list[tuple[int, LayerScan]] = []
        self.reasons: list[tuple[int, str]] = []
        self.hidden: list[str] = []

    def walk(self, jaxpr: Jaxpr, param_of: dict[Any, int], on_batch: set[Any],
             live: set[Any], path: tuple[int, ...]) -> None:
        """Scan `jaxpr`'s equations in order: `param_of` maps the values that are
        parameter leaves (or casts of them) to their leaf index, `on_batch` holds the
        values computed from the batch, `live` the outputs the caller reads."""
        used = {v for v in jaxpr.outvars if _is_var(v) and v in live}
        for eqn in jaxpr.eqns:
            used.update(v for v in eqn.invars if _is_var(v))
        for k, eqn in enumerate(jaxpr.eqns):
            ins = [v for v in eqn.invars if _is_var(v)]
            name = eqn.primitive.name
            if name == "convert_element_type" and ins and ins[0] in param_of:
                param_of[eqn.outvars[0]] = param_of[ins[0]]
            elif name == "scan":
                self.judge(eqn, param_of, on_batch, used, (*path, k))
            elif name in _CALLS:
                inner = _inner(eqn).jaxpr
                pairs = list(zip(eqn.invars, inner.invars, strict=True))
                self.walk(inner,
                          {i: param_of[o] for o, i in pairs if _is_var(o) and o in param_of},
                          {i for o, i in pairs if _is_var(o) and o in on_batch},
                          {i for o, i in zip(eqn.outvars, inner.outvars, strict=True)
                           if o in used}, (*path, k))
            elif any(_has_scan(j) for j in _sub_jaxprs(eqn.params)):
                self.hidden.append(name)
            if any(v in on_batch for v in ins):
                on_batch.update(eqn.outvars)

    def judge(self, eqn: Any, param_of: dict[Any, int], on_batch: set[Any],
              used: set[Any], path: tuple[int, ...]) -> None:
        p = eqn.params
        (nc, ncarry), length = scan_counts(p), int(p["length"])
        consts, carry = eqn.invars[:nc], eqn.invars[nc:nc + ncarry]
        xs = eqn.invars[nc + ncarry:]
        stacked = [param_of.get(v) if _is_var(v) else None for v in xs]
        weight = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in xs)
        aval = carry[0].aval if ncarry == 1 else None
        why = None
        if p.get("reverse", False):
            why = "the scan runs in reverse"
        elif ncarry != 1:
            why = (f"the scan carries {ncarry} values; pipelining needs one carried "
                   f"activation")
        elif not xs or any(s is None for s in stacked):
            why = ("the scan's per-layer inputs include a value that is not a stacked "
                   "parameter")
        elif np.ndim(aval) == 0 or aval.shape[0] != self.batch_size:
            why = (f"the scan's carried value {aval.str_short()} does not have the batch "
                   f"({self.batch_size}) as its leading dim")
        elif any(v in used for v in eqn.outvars[ncarry:]):
            why = "the scan's stacked per-layer outputs are used"
        elif any(_is_var(v) and v in on_batch for v in consts):
            why = "the scan's consts depend on the batch"
        elif length < 2:
            why = f"the scan has {length} layer"
        if why is not None:
            self.reasons.append((weight, why))
            return
        self.found.append((weight, LayerScan(
            length, tuple(int(s) for s in stacked), tuple(int(d) for d in aval.shape),
            str(aval.dtype), self.batch_size, path)))

    def best(self) -> LayerScan:
        if self.found:
            return max(self.found, key=lambda x: x[0])[1]
        if self.reasons:
            raise NoLayerScan(max(self.reasons, key=lambda x: x[0])[1])
        if self.hidden:
            inside = _WRITTEN.get(self.hidden[0], f"`{self.hidden[0]}`")
            raise NoLayerScan(f"the loss function's lax.scan is inside {inside}, not at "
                              f"the top level of the loss function (only nested jax.jit "
                              f"calls are looked through)")
        raise NoLayerScan("the loss function has no lax.scan over stacked parameters at "
                          "its top level")


def _find(jaxpr: Jaxpr, n_params: int, batch_size: int) -> LayerScan:
    """The layer scan of a loss jaxpr taking (param leaves, batch leaves)."""
    search = _Search(batch_size)
    search.walk(jaxpr, {v: i for i, v in enumerate(jaxpr.invars[:n_params])},
                set(jaxpr.invars[n_params:]), {v for v in jaxpr.outvars if _is_var(v)}, ())
    return search.best()


def find_layer_scan(loss_fn: Callable, params: Any, batch: Any) -> LayerScan:
    """The layer scan of `loss_fn(params, batch)` (arrays or `jax.ShapeDtypeStruct`s);
    `NoLayerScan` says why there is none it can pipeline."""
    batch_size = _batch_size(batch)
    closed, _ = _trace(loss_fn, params, batch)
    return _find(closed.jaxpr, len(jax.tree_util.tree_leaves(params)), batch_size)


def _eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], *,
          replace: tuple[tuple[int, ...], Callable[[list[Any]], list[Any]]] | None = None,
          in_stage: bool = False) -> list[Any]:
    """Evaluate a jaxpr (`flatten.evaluate`). `replace=(path, fn)`: the equation at `path`
    (nested calls on the way inlined) computes `fn(inputs)` instead. `in_stage`: evaluated
    inside the pipeline's `shard_map`, so nested jit calls are inlined (their meshes are
    not the stage's) and sharding constraints dropped."""

    def run(k: int, eqn: Any, ins: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        here = replace is not None and replace[0][0] == k
        if here and len(replace[0]) == 1:
            return replace[1](ins)
        if here or (in_stage and name in _CALLS):
            inner = _inner(eqn)
            return _eval(inner.jaxpr, inner.consts, ins, in_stage=in_stage,
                         replace=(replace[0][1:], replace[1]) if here else None)
        if in_stage and name in _STAGE_IDENTITY:
            return ins
        return bind(eqn, ins)

    return evaluate(jaxpr, consts, args, run)


def _at(jaxpr: Jaxpr, path: tuple[int, ...]) -> Any:
    """The equation at `path` (equation indices through nested calls)."""
    eqn = jaxpr.eqns[path[0]]
    return eqn if len(path) == 1 else _at(_inner(eqn).jaxpr, path[1:])


def _outside_uses(jaxpr: Jaxpr, param_of: dict[Any, int], stacked: set[int],
                  path: tuple[int, ...]) -> list[str]:
    """The primitives other than the layer scan (at `path`) that read a stacked parameter
    leaf (or a dtype cast of one); `param_of` maps the jaxpr's parameter values to their
    leaf index."""
    param_of = dict(param_of)
    out = []
    for k, eqn in enumerate(jaxpr.eqns):
        ins = [v for v in eqn.invars if _is_var(v)]
        name = eqn.primitive.name
        if path and k == path[0]:
            if len(path) > 1:            # a call on the way to the scan: look inside
                inner = _inner(eqn).jaxpr
                out += _outside_uses(inner, {i: param_of[o] for o, i in zip(
                    eqn.invars, inner.invars, strict=True) if _is_var(o) and o in param_of},
                    stacked, path[1:])
        elif name == "convert_element_type" and ins and ins[0] in param_of:
            param_of[eqn.outvars[0]] = param_of[ins[0]]
        elif any(param_of.get(v) in stacked for v in ins):
            out.append(name)
    return out


def stack_cut(loss_fn: Callable, scan: LayerScan, layers: int) -> Callable[[Any, Any], Any]:
    """`loss_fn` over `layers` of its stack's layers: the function takes the parameters
    with every stacked leaf (`scan.stacked`) cut to `layers` along its layer dim, and
    returns what `loss_fn` does for a model of that depth. What one pipeline stage runs.

    Built from the traced jaxpr, never by calling `loss_fn` with fewer layers: a module
    whose depth is fixed (Flax's `nn.scan(..., length=L)`, an `nnx.scan` over a module
    made with L layers) cannot be called so. The loss is traced with the whole stack (at
    the batch it is given), then evaluated with its layer scan bound again with
    `length=layers`; a scan's body is one layer whatever the count. A loss that uses a
    stacked parameter outside its scan (its shapes fixed at L layers) cannot be cut, and
    raises `NoLayerScan` naming what reads it."""
    if not 1 <= layers <= scan.length:
        raise ValueError(f"layers={layers} is outside 1..{scan.length} (the stack's layers)")
    stacked = set(scan.stacked)

    def loss(params: Any, batch: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        whole = [jax.ShapeDtypeStruct((scan.length, *np.shape(x)[1:]), x.dtype)
                 if i in stacked else x for i, x in enumerate(_abstract(leaves))]
        closed, out_tree = _trace(loss_fn, jax.tree_util.tree_unflatten(treedef, whole),
                                  batch)
        found = _find(closed.jaxpr, len(leaves), _batch_size(batch))
        if (found.length, found.stacked) != (scan.length, scan.stacked):
            raise NoLayerScan(f"at {found.batch_size} rows the loss function's layer scan "
                              f"({found.length} layers over parameter leaves "
                              f"{found.stacked}) is not the one found at the full batch "
                              f"({scan.length} over {scan.stacked})")
        # a tracer binds an equation's shape params unchecked: what reads the stack
        # outside its scan would be traced with the whole stack's shapes on a cut one
        others = _outside_uses(closed.jaxpr, dict(zip(closed.jaxpr.invars, range(len(
            leaves)), strict=False)), stacked, found.path)
        if others:
            raise NoLayerScan(f"the loss function reads its stacked parameters outside "
                              f"the layer scan too ({', '.join(sorted(set(others)))}), "
                              f"with the shapes of all {scan.length} layers, so one "
                              f"stage's share of the stack cannot be priced on its own")
        eqn = _at(closed.jaxpr, found.path)
        shorter = eqn.replace(params={**eqn.params, "length": layers})
        outs = _eval(closed.jaxpr, closed.consts,
                     [*leaves, *jax.tree_util.tree_leaves(batch)],
                     replace=(found.path, lambda ins: bind(shorter, ins)))
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return loss


def _stage_rows(batch_size: int, micro_batches: int, data_axis: Any) -> int:
    """The rows of one micro-batch on one device of the data axes (context mesh)."""
    names = () if data_axis is None else (
        (data_axis,) if isinstance(data_axis, str) else tuple(data_axis))
    mesh = jax.sharding.get_abstract_mesh()
    shards = int(np.prod([mesh.shape[a] for a in names if a in mesh.axis_names]))
    if batch_size % (micro_batches * shards):
        raise ValueError(f"a batch of {batch_size} rows does not split into "
                         f"{micro_batches} micro-batches x {shards} data shards")
    return batch_size // (micro_batches * shards)


def _body_at(loss_fn: Callable, params: Any, batch: Any, scan: Any, path: tuple[int, ...],
             rows: int) -> ClosedJaxpr:
    """The scan's body for `rows` rows: `loss_fn` traced again with every batch leaf cut
    to `rows` rows, in the context of the pipeline's shard_map, where the body runs."""
    small = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((rows, *np.shape(x)[1:]), x.dtype), _abstract(batch))
    mesh = jax.sharding.get_abstract_mesh()
    # the context the body runs in: the mesh with every axis manual, as shard_map sets it
    # (jax caches traces of jitted helpers and custom-derivative rules by that context)
    inside = mesh.update_axis_types({a: AxisType.Manual for a in mesh.axis_names})
    try:
        with jax.sharding.use_abstract_mesh(inside):
            closed = jax.make_jaxpr(loss_fn)(_abstract(params), small)
    except ValueError as e:
        raise NoLayerScan(f"the loss function does not trace inside the pipeline's "
                          f"shard_map, for a micro-batch of {rows} rows ({e}). A sharding "
                          f"constraint given as a bare PartitionSpec cannot be: give it a "
                          f"NamedSharding(mesh, spec)") from e
    again = None
    try:
        again = _at(closed.jaxpr, path)
    except (IndexError, KeyError):
        pass
    nc = scan_counts(scan.params)[0]

    def shapes(e: Any) -> list[Any]:             # consts and per-layer inputs
        return [v.aval.shape for i, v in enumerate(e.invars) if i != nc]
    if (again is None or again.primitive.name != "scan"
            or again.params["length"] != scan.params["length"]
            or scan_counts(again.params) != scan_counts(scan.params)
            or shapes(again) != shapes(scan)):
        raise NoLayerScan(f"traced with a micro-batch of {rows} rows, the loss function no "
                          f"longer has the same layer scan: its layers must not depend on "
                          f"the batch size")
    return again.params["jaxpr"]


def pipelined_loss(loss_fn: Callable, scan: LayerScan, *, stages: int, micro_batches: int,
                   repeats: int = 1, data_axis: str | tuple[str, ...] | None = None,
                   param_specs: Sequence[tuple[str | None, ...]] = ()
                   ) -> Callable[[Any, Any], Any]:
    """`loss_fn` with its layer scan (`find_layer_scan`) run by `schedule.pipelined` over
    the stage axis of the mesh it is traced in (`jax.set_mesh`), each micro-batch split
    over `data_axis`. The stacked parameters are reordered for the circular schedule
    (`to_stages`) inside. `param_specs`, one per stacked parameter in `scan.stacked`'s
    order (empty: none), shards a stage's share of it beyond the layer dim
    (`pipelined`'s FSDP inside a stage). The returned function takes `(params, batch)`
    and returns what `loss_fn` does; it traces `loss_fn` once per argument shapes and
    mesh."""
    if min(stages, micro_batches, repeats) < 1:
        raise ValueError(f"stages={stages}, micro_batches={micro_batches} and "
                         f"repeats={repeats} must be at least 1")
    if param_specs and len(param_specs) != len(scan.stacked):
        raise ValueError(f"param_specs has {len(param_specs)} specs for the layer scan's "
                         f"{len(scan.stacked)} stacked parameters {scan.stacked}")
    specs = [tuple(s) for s in param_specs] if param_specs else None
    stage_order(scan.length, stages, repeats)       # raises if the layers do not split
    traces: dict[Any, tuple[ClosedJaxpr, Any, LayerScan]] = {}
    bodies: dict[Any, ClosedJaxpr] = {}

    def traced(params: Any, batch: Any) -> tuple[Any, tuple[ClosedJaxpr, Any, LayerScan]]:
        leaves = jax.tree_util.tree_leaves((params, batch))
        key = (jax.tree_util.tree_structure((params, batch)),
               tuple((np.shape(x), str(jnp.result_type(x))) for x in leaves),
               jax.sharding.get_abstract_mesh())
        if key in traces:
            return key, traces[key]
        batch_size = _batch_size(batch)
        closed, out_tree = _trace(loss_fn, params, batch)
        found = _find(closed.jaxpr, len(jax.tree_util.tree_leaves(params)), batch_size)
        if (found.length, found.stacked) != (scan.length, scan.stacked):
            raise ValueError(f"the loss function's layer scan ({found.length} layers over "
                             f"parameter leaves {found.stacked}) is not the one this "
                             f"pipeline was made for ({scan.length} over {scan.stacked})")
        # a trace that closed over another trace's values is good for that trace only
        if not any(isinstance(c, jax.core.Tracer) for c in closed.consts):
            traces[key] = (closed, out_tree, found)
        return key, (closed, out_tree, found)

    def loss(params: Any, batch: Any) -> Any:
        mesh = jax.sharding.get_abstract_mesh()
        if STAGE in mesh.axis_names and mesh.shape[STAGE] != stages:
            # the layers are ordered for `stages`: another count would run them out of order
            raise ValueError(f"this pipeline was made for {stages} stages, but the mesh's "
                             f"{STAGE!r} axis has {mesh.shape[STAGE]}")
        key, (closed, out_tree, found) = traced(params, batch)
        eqn = _at(closed.jaxpr, found.path)
        rows = _stage_rows(found.batch_size, micro_batches, data_axis)
        body = bodies.get((key, rows))
        if body is None:
            body = _body_at(loss_fn, params, batch, eqn, found.path, rows)
            if not any(isinstance(c, jax.core.Tracer) for c in body.consts):
                bodies[key, rows] = body
        nc, nb = scan_counts(eqn.params)[0], len(body.consts)

        def layer(w: list[Any], h: Any, *consts: Any) -> Any:
            return _eval(body.jaxpr, consts[:nb], [*consts[nb:], h, *w], in_stage=True)[0]

        run = pipelined(layer, None, micro_batches=micro_batches, repeats=repeats,
                        data_axis=data_axis, param_specs=specs)

        def replaced(ins: list[Any]) -> list[Any]:
            consts, h, xs = ins[:nc], ins[nc], ins[nc + 1:]
            out = run(to_stages(list(xs), stages, repeats), h, *body.consts, *consts)
            # the per-layer outputs (unused: `_find` checked) stay unmade
            return [out, *(None for _ in eqn.outvars[1:])]

        args = [*jax.tree_util.tree_leaves(params), *jax.tree_util.tree_leaves(batch)]
        outs = _eval(closed.jaxpr, closed.consts, args, replace=(found.path, replaced))
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return loss


__all__ = ["LayerScan", "NoLayerScan", "find_layer_scan", "pipelined_loss", "stack_cut"]
