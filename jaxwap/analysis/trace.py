"""Tracing: the step's arguments flattened and classified, and its jaxpr.

`layout_of` flattens (args, kwargs) into leaves with readable paths, gives each a role
(parameter or a mirror of one, batch, other; see `analysis/roles.py`), traces the step on abstract
values with `jax.make_jaxpr`, and gives every output leaf the role of the input it
mirrors. With several processes a process-local batch leaf stands for its rows of the
global batch. Nothing here touches a device or a real array.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxwap.analysis.roles import (
    BATCH,
    PARAM,
    LeafRole,
    LeafTable,
    ParamInfo,
    SuffixIndex,
    abstract_entries,
    abstract_leaf,
    check_params_found,
    classify_leaves,
    param_infos,
    path_tokens,
)


@dataclass(frozen=True)
class ArgLayout:
    """The step's arguments flattened: per-leaf paths, avals and roles, and how to rebuild."""

    args_treedef: Any
    kw_names: tuple[str, ...]
    inputs: LeafTable
    outputs: LeafTable
    out_treedef: Any
    params: tuple[ParamInfo, ...]
    params_treedef: Any


def find_params(args: Sequence[Any], params: Any) -> Any:
    """The params tree: given, or the first argument (its `.params` for a TrainState)."""
    if params is not None:
        return params
    if not args:
        raise ValueError("the step was called with no positional arguments, so there is no "
                         "first argument to take as the parameters: pass params=")
    first = args[0]
    inner = getattr(first, "params", None)
    if inner is not None and not isinstance(first, dict) and jax.tree_util.tree_leaves(inner):
        return inner
    return first


def flat_leaves(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list, Any, tuple[str, ...]]:
    """(path, leaf) pairs of (args, kwargs) with readable roots, and how to rebuild them."""
    names = tuple(sorted(kwargs))
    tree = (tuple(args), tuple(kwargs[k] for k in names))
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return flat, treedef, names


def _root_path(path: Sequence[Any], names: tuple[str, ...]) -> tuple[str, Sequence[Any]]:
    which, idx = path[0].idx, path[1].idx
    root = f"args[{idx}]" if which == 0 else f"kwargs[{names[idx]!r}]"
    return root, path[2:]


def leaf_entries(args: Sequence[Any], kwargs: dict[str, Any]
                 ) -> tuple[list[tuple[str, Sequence[Any], Any]], Any, tuple[str, ...]]:
    """(root, key path, leaf) for every leaf of (args, kwargs), roots like `args[2]`."""
    flat, treedef, names = flat_leaves(args, kwargs)
    return [(*_root_path(path, names), leaf) for path, leaf in flat], treedef, names


def flat_arguments(args: Sequence[Any], kwargs: dict[str, Any]
                   ) -> tuple[list[Any], Any, tuple[str, ...]]:
    """(leaves, treedef, keyword names) of a call's arguments: one flatten of the
    positional arguments and of the keyword ones in sorted name order."""
    names = tuple(sorted(kwargs)) if kwargs else ()
    leaves, treedef = jax.tree_util.tree_flatten((tuple(args),
                                                  tuple(kwargs[k] for k in names)))
    return leaves, treedef, names


def signature(args: Sequence[Any], kwargs: dict[str, Any],
              flat: tuple[list[Any], Any, tuple[str, ...]] | None = None
              ) -> tuple[Any, list[Any]]:
    """(What a compiled step is reused for: the arguments' structure, shapes, dtypes and
    weak types; their leaves), from one flatten of them (`flat_arguments`, or `flat` where
    the caller has it): every call of a step computes it, so a jax array, the common leaf,
    is read directly (`abstract_leaf` names the path of any other leaf it refuses, which
    only an error needs)."""
    leaves, treedef, names = flat or flat_arguments(args, kwargs)

    arrays = list(map(isinstance, leaves, itertools.repeat(jax.Array)))
    if all(arrays):      # the common call, read in C: 108 leaves in about 15 us
        return (treedef, names, tuple(map(SHAPE_DTYPE, leaves))), leaves

    def key_of(i: int, leaf: Any) -> tuple[Any, ...]:
        if arrays[i]:
            return SHAPE_DTYPE(leaf)
        # as an array's key, so a numpy batch reuses the plan a jax one made; a weakly
        # typed leaf (a Python number) is told apart
        a = abstract_leaf(leaf, lambda: _leaf_path(args, kwargs, i))
        return (tuple(a.shape), a.dtype) + ((True,) if getattr(a, "weak_type", False) else ())
    return (treedef, names, tuple(key_of(i, x) for i, x in enumerate(leaves))), leaves


#: (shape, dtype) of an array or an aval, read in C: a jax array leaf's part of a key
SHAPE_DTYPE = operator.attrgetter("shape", "dtype")


def _leaf_path(args: Sequence[Any], kwargs: dict[str, Any], i: int) -> str:
    """The path of the i-th argument leaf, as errors name it (`args[0]['w']`)."""
    root, path, _ = leaf_entries(args, kwargs)[0][i]
    return f"{root}{jax.tree_util.keystr(tuple(path))}"


def own_arrays(leaves: Sequence[Any]) -> dict[int, int]:
    """id(array) -> parameter index for the params' own arrays, which settles a leaf that is
    one of them whatever its path. An array at several parameters (one zeros array used
    as two biases) says none of them: each of its uses is told by its path instead."""
    arrays = [(j, leaf) for j, leaf in enumerate(leaves)
              if isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))]
    uses = Counter(id(leaf) for _, leaf in arrays)
    return {id(leaf): j for j, leaf in arrays if uses[id(leaf)] == 1}


def passed_through(closed: Any) -> set[int]:
    """The outputs of a traced step that are one of its inputs, untouched."""
    ins = {id(v) for v in closed.jaxpr.invars}
    return {k for k, v in enumerate(closed.jaxpr.outvars) if id(v) in ins}


def layout_of(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any],
              params: Any, batch_size: int | None = None) -> tuple[ArgLayout, Any]:
    """Classify every argument leaf, trace the step, classify every output leaf.

    The step is traced before the inputs are settled: a leaf it hands back at the same
    path and shape (batch-norm statistics, a step counter) is carried state, not data,
    whatever its leading dimension. Outputs take the role of the input they mirror, so
    state comes back on the sharding it went in with.
    """
    ptree = find_params(args, params)
    infos, ptreedef = param_infos(ptree)
    identity = own_arrays(jax.tree_util.tree_leaves(ptree))
    entries, treedef, names = leaf_entries(args, kwargs)
    leaves = [leaf for _, _, leaf in entries]
    avals = abstract_entries(entries)

    def trace(avals: Sequence[Any]) -> tuple[Any, Any]:
        # Trace the user's function itself (not a wrapper made here), so jax's own tracing
        # cache, keyed on the function, makes a second planning of the same step cheap.
        a, k = jax.tree_util.tree_unflatten(treedef, avals)
        traced = jax.jit(fn).trace(*a, **dict(zip(names, k, strict=True)))
        return traced.jaxpr, traced.out_info

    closed, out_shape = trace(avals)
    out_flat, out_treedef = jax.tree_util.tree_flatten_with_path(out_shape)
    returned = [(path_tokens(p), tuple(int(d) for d in x.shape)) for p, x in out_flat]

    # (path suffix, shape) of every output: an input the step hands back at the end of
    # one of them, with its shape, is carried state; an input it returns untouched (the
    # batch's labels beside the predictions) is not made state by that
    kept = passed_through(closed)
    handed_back = {(t[len(t) - n:], s) for k, (t, s) in enumerate(returned) if k not in kept
                   for n in range(1, len(t) + 1)}

    def carried(tokens: tuple[str, ...], shape: tuple[int, ...]) -> bool:
        return len(tokens) > 0 and (tokens, shape) in handed_back

    inputs = globalize(classify_leaves(entries, infos, identity=identity,
                                       batch_size=batch_size, infer_batch=batch_size is None,
                                       carried=carried, returned=returned, avals=avals),
                                       leaves)
    check_params_found(inputs, infos)
    if batch_size is not None and not any(r.kind == BATCH for r in inputs.roles):
        raise ValueError(f"batch_size={batch_size}: no argument leaf has it as its leading "
                         f"dimension")
    if list(inputs.avals) != avals:  # several processes: trace the global shapes
        closed, out_shape = trace(inputs.avals)
    outputs = classify_leaves([("out", path, leaf) for path, leaf in out_flat], infos,
                              batch_size=inputs.batch_size, infer_batch=False)
    outputs = _mirror_inputs(outputs, returned, entries, inputs)
    return ArgLayout(treedef, names, inputs, outputs, out_treedef, infos, ptreedef), closed


def _mirror_inputs(outputs: LeafTable, returned: Sequence[tuple[tuple[str, ...], Any]],
                   entries: Sequence[tuple[str, Sequence[Any], Any]],
                   inputs: LeafTable) -> LeafTable:
    """An output at the path and shape of an input takes that input's role: state comes
    back as it went in, and a parameter's output is the parameter or one of its mirrors
    as the input at the longest matching path was (whatever order the step returns them).
    An output at the very path of a positional argument's leaf, its position included
    (`out[1][0]['w']` for `args[1][0]['w']`: the step hands back its arguments in their
    order), is that leaf, however well another path's end matches: new params returned
    beside `(ema, opt_state)` would otherwise take the EMA's role, `('0', 'w')` ending
    `args[1][0]['w']`'s path more fully than `args[0]['w']`'s."""
    items = [(path_tokens(p), root, (tuple(int(d) for d in a.shape), r))
             for (root, p, _), a, r in zip(entries, inputs.avals, inputs.roles, strict=True)]
    keyed = SuffixIndex([(t, sr) for t, _, sr in items if t])
    at = {(root[5:-1], *t): sr for t, root, sr in items if root.startswith("args[")}
    roles = list(outputs.roles)
    for i, (tokens, shape) in enumerate(returned):
        out = roles[i]

        def fits(sr: tuple[tuple[int, ...], LeafRole], out: LeafRole = out,
                 shape: tuple[int, ...] = shape) -> bool:
            return sr[0] == shape and (sr[1].kind == PARAM) == (out.kind == PARAM) \
                and (out.kind != PARAM or sr[1].param == out.param)
        best = at.get(tokens)
        if best is None or not fits(best):
            best = keyed.longest(tokens, fits)
        if best is not None:
            roles[i] = best[1]
    return LeafTable(outputs.paths, outputs.avals, tuple(roles), outputs.batch_size)


def is_process_local(leaf: Any) -> bool:
    """Host data (numpy, Python scalars, arrays on this process's devices only), as opposed
    to a global jax.Array or an abstract ShapeDtypeStruct, which already say global shapes."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return False
    if isinstance(leaf, jax.Array):
        return leaf.is_fully_addressable
    return True


def globalize(table: LeafTable, leaves: Sequence[Any]) -> LeafTable:
    """With several processes, each passes its own slice of the batch: a process-local
    batch leaf stands for `process_count` times its rows. Everything else (params, state)
    is the same on every process. A no-op with one process."""
    nproc = jax.process_count()
    if nproc == 1 or table.batch_size is None:
        return table
    avals = list(table.avals)
    for i, (role, leaf) in enumerate(zip(table.roles, leaves, strict=True)):
        if role.kind == BATCH and is_process_local(leaf):
            a = avals[i]
            avals[i] = jax.ShapeDtypeStruct((a.shape[0] * nproc, *a.shape[1:]), a.dtype)
    batch = table.batch_size * nproc if any(
        r.kind == BATCH and is_process_local(x) for r, x in zip(table.roles, leaves,
                                                                 strict=True)) else table.batch_size
    return LeafTable(table.paths, tuple(avals), table.roles, batch)


def trace_layout(fn: Callable, layout: ArgLayout) -> Any:
    """The jaxpr of `fn` at the layout's abstract arguments."""
    a, k = jax.tree_util.tree_unflatten(layout.args_treedef, layout.inputs.avals)
    return jax.make_jaxpr(fn)(*a, **dict(zip(layout.kw_names, k, strict=True)))


__all__ = ["SHAPE_DTYPE", "ArgLayout", "find_params", "flat_arguments", "flat_leaves",
           "globalize", "is_process_local", "layout_of", "leaf_entries", "signature",
           "trace_layout"]
