"""The loss rewritten around its layer scan: run as a pipeline, or cut to a stage's layers.

Both rewrites evaluate the loss's traced jaxpr equation by equation
(`flatten.evaluate`) with the one layer scan `layer_scan.find_layer_scan` found replaced,
so the user's code is unchanged and what comes out is ordinary JAX.

`pipelined_loss` replaces the scan by `schedule.pipelined` over the stage axis of the
mesh it is traced in: `jax.grad` of the rewritten loss is the backward pipeline. A stage
runs the scan's body on its local micro-batch, so the loss is traced again at that size
(a layer may reshape with its batch size) in the context the body runs in, the
pipeline's `shard_map` (every mesh axis manual: jax caches the traces of jitted helpers
and custom derivative rules by context). There, nested `jax.jit` calls are inlined and
sharding constraints dropped, since a stage lays out its own rows; a constraint given as
a bare `PartitionSpec` does not trace there, and is refused with `NoLayerScan` (a
`NamedSharding` one works).

`stack_cut` binds the scan again over fewer layers: the loss of one stage's share of the
stack, which the pipelined search prices. `evaluate_replacing` and `rebound` are the
evaluation every rewrite of a traced loss runs (`layer_remat`'s too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import AxisType

from jaxwap.analysis.flatten import REMAT_PRIMITIVES, bind, evaluate, is_value, scan_counts
from jaxwap.core.records import MODEL, STAGE
from jaxwap.runtime.batch_keys import fold_micro
from jaxwap.runtime.layer_scan import (
    CALL_PRIMITIVES,
    LayerScan,
    NoLayerScan,
    abstract_values,
    batch_at_rows,
    batch_size_of,
    called_jaxpr,
    equation_at,
    find_in_jaxpr,
    trace_loss,
)
from jaxwap.runtime.schedule import pipelined
from jaxwap.runtime.stage_layout import chunking, data_axes, to_stages

# inside a stage the rows are the stage's own: their layout constraints do not apply
_STAGE_IDENTITY = frozenset({"sharding_constraint"})


def evaluate_replacing(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], *,
                       replace: tuple[tuple[int, ...], Callable[[list[Any]], list[Any]]]
                       | None = None, in_stage: bool = False) -> list[Any]:
    """Evaluate a jaxpr (`flatten.evaluate`). `replace=(path, fn)`: the equation at `path`
    (nested calls on the way inlined) computes `fn(inputs)` instead. `in_stage`: evaluated
    inside the pipeline's `shard_map`, so nested jit calls are inlined (their meshes are
    not the stage's) and sharding constraints dropped."""

    def run(k: int, eqn: Any, ins: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        here = replace is not None and replace[0][0] == k
        if here and len(replace[0]) == 1:
            return replace[1](ins)
        if here or (in_stage and name in CALL_PRIMITIVES):
            inner = called_jaxpr(eqn)
            return evaluate_replacing(inner.jaxpr, inner.consts, ins, in_stage=in_stage,
                                      replace=(replace[0][1:], replace[1]) if here else None)
        if in_stage and name in _STAGE_IDENTITY:
            return ins
        if in_stage and name in REMAT_PRIMITIVES:
            # the user's checkpoint made again around its body evaluated in the stage: its
            # jaxpr was traced on the whole program's mesh, which a stage's manual axes do
            # not match (a layer gathered inside a stage failed to lower: a reduce-scatter
            # under it saw both meshes)
            inner = eqn.params["jaxpr"]
            body, consts = ((inner.jaxpr, inner.consts) if isinstance(inner, ClosedJaxpr)
                            else (inner, ()))
            return jax.checkpoint(lambda *a: evaluate_replacing(body, consts, a, in_stage=True),
                                  policy=eqn.params.get("policy"),
                                  prevent_cse=eqn.params.get("prevent_cse", True))(*ins)
        return bind(eqn, ins)

    return evaluate(jaxpr, consts, args, run)


def _outside_uses(jaxpr: Jaxpr, param_of: dict[Any, int], stacked: set[int],
                  path: tuple[int, ...]) -> list[str]:
    """The primitives other than the layer scan (at `path`) that read a stacked parameter
    leaf (or a dtype cast of one); `param_of` maps the jaxpr's parameter values to their
    leaf index."""
    param_of = dict(param_of)
    out = []
    for k, eqn in enumerate(jaxpr.eqns):
        ins = [v for v in eqn.invars if is_value(v)]
        name = eqn.primitive.name
        if path and k == path[0]:
            if len(path) > 1:            # a call on the way to the scan: look inside
                inner = called_jaxpr(eqn).jaxpr
                out += _outside_uses(inner, {i: param_of[o] for o, i in zip(
                    eqn.invars, inner.invars, strict=True) if is_value(o) and o in param_of},
                    stacked, path[1:])
        elif name == "convert_element_type" and ins and ins[0] in param_of:
            param_of[eqn.outvars[0]] = param_of[ins[0]]
        elif any(param_of.get(v) in stacked for v in ins):
            out.append(name)
    return out


def rebound(closed: ClosedJaxpr, out_tree: Any, leaves: Sequence[Any], batch: Any,
            path: tuple[int, ...], run: Callable[[list[Any]], list[Any]]) -> Any:
    """The traced loss's outputs (as `out_tree`) on the parameter `leaves` and `batch`,
    its layer scan at `path` computed by `run(inputs)` instead (the scan changed: fewer
    layers, a checkpointed body, checkpointed whole)."""
    outs = evaluate_replacing(closed.jaxpr, closed.consts,
                              [*leaves, *jax.tree_util.tree_leaves(batch)], replace=(path, run))
    return jax.tree_util.tree_unflatten(out_tree, outs)


def stack_cut(loss_fn: Callable, scan: LayerScan, layers: int,
              remat_stack: bool = False) -> Callable[[Any, Any], Any]:
    """`loss_fn` over `layers` of its stack's layers: the function takes the parameters
    with every stacked leaf (`scan.stacked`) cut to `layers` along its layer dim, and
    returns what `loss_fn` does for a model of that depth. What one pipeline stage runs
    (more layers than the stack's are allowed: the pricing traces a stage step with twice
    a stage's layers, which an uneven split's ceil(L / p) may take past L).

    Built from the traced jaxpr, never by calling `loss_fn` with fewer layers: a module
    whose depth is fixed (Flax's `nn.scan(..., length=L)`, an `nnx.scan` over a module
    made with L layers) cannot be called so. The loss is traced with the whole stack (at
    the batch it is given), then evaluated with its layer scan bound again with
    `length=layers`; a scan's body is one layer whatever the count. A loss that uses a
    stacked parameter outside its scan (its shapes fixed at L layers) cannot be cut, and
    raises `NoLayerScan` naming what reads it.

    `remat_stack`: the cut stack runs under one `jax.checkpoint` keeping only its input,
    as a pipeline stage whose loop steps keep only their inputs (`remat="stage"`) runs
    it: its backward pass runs the stage's layers forward again first."""
    if layers < 1:
        raise ValueError(f"layers={layers}: a stack has at least one layer")
    stacked = set(scan.stacked)

    def loss(params: Any, batch: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        whole = [jax.ShapeDtypeStruct((scan.length, *np.shape(x)[1:]), x.dtype)
                 if i in stacked else x for i, x in enumerate(abstract_values(leaves))]
        closed, out_tree = trace_loss(loss_fn, jax.tree_util.tree_unflatten(treedef, whole),
                                  batch)
        found = find_in_jaxpr(closed.jaxpr, len(leaves), batch_size_of(batch))
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
        eqn = equation_at(closed.jaxpr, found.path)
        shorter = eqn.replace(params={**eqn.params, "length": layers})
        first = sum(scan_counts(eqn.params))
        # the per-layer inputs that are not parameters come with the whole stack's rows:
        # the cut stack reads as many of them as it has layers (cycled past L)
        extras = {first + i for i in found.extras}
        picks = jnp.arange(layers) % scan.length

        def run(ins: list[Any]) -> list[Any]:
            return bind(shorter, [x[picks] if k in extras else x for k, x in enumerate(ins)])
        if remat_stack:
            checked = jax.checkpoint(lambda *ins: run(list(ins)),
                                     policy=jax.checkpoint_policies.nothing_saveable)
            return rebound(closed, out_tree, leaves, batch, found.path,
                            lambda ins: checked(*ins))
        return rebound(closed, out_tree, leaves, batch, found.path, run)

    return loss


def _stage_rows(batch_size: int, micro_batches: int, data_axis: Any) -> int:
    """The rows of one micro-batch on one device of the data axes (context mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    shards = int(np.prod([mesh.shape[a] for a in data_axes(data_axis)
                          if a in mesh.axis_names]))
    if batch_size % (micro_batches * shards):
        raise ValueError(f"a batch of {batch_size} rows does not split into "
                         f"{micro_batches} micro-batches x {shards} data shards")
    return batch_size // (micro_batches * shards)


def _body_at(loss_fn: Callable, params: Any, batch: Any, scan: Any, path: tuple[int, ...],
             rows: int, manual: frozenset[str]) -> tuple[ClosedJaxpr, tuple[int, ...]]:
    """The scan's body for `rows` rows, and the positions of its consts that have the
    batch's rows (a mask, positions, segment ids: cut to `rows` in this trace, as a stage
    reads its micro-batch's rows of them): `loss_fn` traced again with every batch leaf
    cut to `rows` rows (the leaves without the batch's rows, a PRNG key, stay whole), in
    the context of the pipeline's shard_map, where the body runs (the `manual` axes, its
    loop's own, manual; the others as they are). Any other const must keep its shape."""
    size, small = batch_size_of(batch), batch_at_rows(batch, rows)
    mesh = jax.sharding.get_abstract_mesh()
    # the context the body runs in: the loop's axes manual, as its shard_map sets them
    # (jax caches traces of jitted helpers and custom-derivative rules by that context,
    # and a value the stage cuts from its inputs carries it)
    inside = mesh.update_axis_types({a: AxisType.Manual for a in mesh.axis_names
                                     if a in manual})
    try:
        with jax.sharding.use_abstract_mesh(inside):
            closed = trace_loss(loss_fn, params, small)[0]
    except ValueError as e:
        raise NoLayerScan(f"the loss function does not trace inside the pipeline's "
                          f"shard_map, for a micro-batch of {rows} rows ({e}). A sharding "
                          f"constraint given as a bare PartitionSpec cannot be: give it a "
                          f"NamedSharding(mesh, spec)") from e
    again = None
    try:
        again = equation_at(closed.jaxpr, path)
    except (IndexError, KeyError):
        pass
    nc = scan_counts(scan.params)[0]

    def shapes(e: Any) -> list[Any]:             # consts and per-layer inputs
        return [v.aval.shape for i, v in enumerate(e.invars) if i != nc]
    same = (again is not None and again.primitive.name == "scan"
            and again.params["length"] == scan.params["length"]
            and scan_counts(again.params) == scan_counts(scan.params))
    whole, cut = shapes(scan), shapes(again) if same else []
    rowed = tuple(k for k in range(nc) if same and rows != size
                  and whole[k][:1] == (size,) and cut[k] == (rows, *whole[k][1:]))
    if not same or any(a != b for k, (a, b) in enumerate(zip(whole, cut, strict=True))
                       if k not in rowed):
        raise NoLayerScan(f"traced with a micro-batch of {rows} rows, the loss function no "
                          f"longer has the same layer scan: its layers must not depend on "
                          f"the batch size, and what they close over either has the "
                          f"batch's rows leading or does not change with them")
    return again.params["jaxpr"], rowed


def check_micro_batches(loss_fn: Callable, scan: LayerScan, params: Any, batch: Any) -> None:
    """Raise `NoLayerScan` where a stage could not run the layer scan on a micro-batch:
    traced at half the batch's rows (one row for an odd batch), what the layers close
    over must have those rows leading or not change (`_body_at`). Only a scan that
    closes over a value with the batch's rows leading (`LayerScan.row_consts`) can fail
    it; the pipeline search asks before pricing stages it could not run."""
    size = batch_size_of(batch)
    if not scan.row_consts or size < 2:
        return
    closed, _ = trace_loss(loss_fn, params, batch)
    _body_at(loss_fn, params, batch, equation_at(closed.jaxpr, scan.path), scan.path,
             size // 2 if size % 2 == 0 else 1, frozenset())


def pipelined_loss(loss_fn: Callable, scan: LayerScan, *, stages: int, micro_batches: int,
                   repeats: int = 1, data_axis: str | tuple[str, ...] | None = None,
                   param_specs: Sequence[tuple[str | None, ...]] = (),
                   stage_remat: bool = False) -> Callable[[Any, Any], Any]:
    """`loss_fn` with its layer scan (`find_layer_scan`) run by `schedule.pipelined` over
    the stage axis of the mesh it is traced in (`jax.set_mesh`), each micro-batch split
    over `data_axis`. The stacked parameters are reordered for the circular schedule
    (`to_stages`) inside. `param_specs`, one per stacked parameter in `scan.stacked`'s
    order (empty: none), shards a stage's share of it beyond the layer dim
    (`pipelined`'s FSDP inside a stage); `stage_remat` keeps only each loop step's input
    (`pipelined`). What the layers read besides their parameters reaches every stage:
    per-layer inputs that are not parameters whole, each layer reading its row by its
    index in the stack (a key it draws from folded with the micro-batch's and the data
    shard's index, so each draws its own); consts with the batch's rows cut into
    micro-batches as the activation is (found by tracing the loss at a micro-batch's
    rows); other consts whole. The layers need not divide into the stages' chunks:
    `to_stages` pads each short chunk with an empty slot, laid out over the stage axis
    inside the step, so the parameters themselves keep the user's shapes (and whatever
    layout the plan stores them in). On a mesh with a model axis the loop keeps the
    activations it holds and sends split over it (`pipelined`'s `carry_axis`). The
    returned function takes `(params, batch)` and returns what `loss_fn` does; it traces
    `loss_fn` once per argument shapes and mesh."""
    if min(stages, micro_batches, repeats) < 1:
        raise ValueError(f"stages={stages}, micro_batches={micro_batches} and "
                         f"repeats={repeats} must be at least 1")
    if param_specs and len(param_specs) != len(scan.stacked):
        raise ValueError(f"param_specs has {len(param_specs)} specs for the layer scan's "
                         f"{len(scan.stacked)} stacked parameters {scan.stacked}")
    specs = [tuple(s) for s in param_specs] if param_specs else None
    chunking(scan.length, stages, repeats)      # raises if a chunk would have no layer
    traces: dict[Any, tuple[ClosedJaxpr, Any, LayerScan]] = {}
    bodies: dict[Any, ClosedJaxpr] = {}

    def traced(params: Any, batch: Any) -> tuple[Any, tuple[ClosedJaxpr, Any, LayerScan]]:
        leaves = jax.tree_util.tree_leaves((params, batch))
        key = (jax.tree_util.tree_structure((params, batch)),
               tuple((np.shape(x), str(jnp.result_type(x))) for x in leaves),
               jax.sharding.get_abstract_mesh())
        if key in traces:
            return key, traces[key]
        batch_size = batch_size_of(batch)
        closed, out_tree = trace_loss(loss_fn, params, batch)
        found = find_in_jaxpr(closed.jaxpr, len(jax.tree_util.tree_leaves(params)), batch_size)
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
        eqn = equation_at(closed.jaxpr, found.path)
        rows = _stage_rows(found.batch_size, micro_batches, data_axis)
        got = bodies.get((key, rows))
        if got is None:
            got = _body_at(loss_fn, params, batch, eqn, found.path, rows,
                           frozenset({STAGE, *data_axes(data_axis)}))
            if not any(isinstance(c, jax.core.Tracer) for c in got[0].consts):
                bodies[key, rows] = got
        body, rowed = got
        nc, nb = scan_counts(eqn.params)[0], len(body.consts)
        extras, n_xs = set(found.extras), len(eqn.invars) - nc - 1
        # what each stage takes besides its layers' parameters, in `pipelined`'s order:
        # the body's own consts, the scan's consts that go whole, the per-layer inputs
        # that are not parameters (whole), the consts with the batch's rows (`pipelined`'s
        # row consts, cut to the micro-batch's rows), and the micro-batch's index where a
        # layer draws random numbers
        order = [k for k in range(nc) if k not in rowed] + list(rowed)
        n_whole, n_extra = nc - len(rowed), len(found.extras)

        def layer(w: list[Any], h: Any, *passed: Any) -> Any:
            own, rest = passed[:nb], passed[nb:]
            whole, per_layer = rest[:n_whole], rest[n_whole:n_whole + n_extra]
            cut = rest[n_whole + n_extra:n_whole + n_extra + len(rowed)]
            consts: list[Any] = [None] * nc
            for k, v in zip(order, (*whole, *cut), strict=True):
                consts[k] = v
            if extras:       # each layer's row of the inputs that are not parameters
                *w, at = w
                params_in, its_rows = iter(w), iter(x[at] for x in per_layer)
                w = [next(its_rows) if i in extras else next(params_in)
                     for i in range(n_xs)]
            if found.draws:  # its own draw for each micro-batch and data shard
                micro = rest[-1]
                shard = jax.lax.axis_index(data_axis) if data_axis else 0
                for i, kind in found.draws:
                    w[i] = fold_micro(fold_micro(w[i], micro, kind), shard, kind)
            return evaluate_replacing(body.jaxpr, own, [*consts, h, *w], in_stage=True)[0]

        run = pipelined(layer, None, micro_batches=micro_batches, repeats=repeats,
                        data_axis=data_axis,
                        param_specs=specs + [()] if specs and extras else specs,
                        stage_remat=stage_remat, layers=scan.length, carry_axis=MODEL,
                        micro_index=bool(found.draws), row_consts=len(rowed))

        def replaced(ins: list[Any]) -> list[Any]:
            consts, h, xs = ins[:nc], ins[nc], ins[nc + 1:]
            # the inputs that are not parameters go whole to every stage, beside the
            # layer indices, stage-sharded as the parameters are, that pick their rows
            ws = [x for i, x in enumerate(xs) if i not in extras]
            if extras:
                ws.append(jnp.arange(scan.length, dtype=jnp.int32))
            out = run(to_stages(ws, stages, repeats), h, *body.consts,
                      *(consts[k] for k in order[:nc - len(rowed)]),
                      *(xs[i] for i in found.extras), *(consts[k] for k in rowed))
            # the per-layer outputs (unused: `find_in_jaxpr` checked) stay unmade
            return [out, *(None for _ in eqn.outvars[1:])]

        args = [*jax.tree_util.tree_leaves(params), *jax.tree_util.tree_leaves(batch)]
        outs = evaluate_replacing(closed.jaxpr, closed.consts, args, replace=(found.path, replaced))
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return loss


__all__ = ["check_micro_batches", "evaluate_replacing", "pipelined_loss", "rebound",
           "stack_cut"]
