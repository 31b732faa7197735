"""The layer stack of a loss function, found in its jaxpr.

Most large JAX models run their repeated blocks as one `lax.scan` over parameters stacked
along a leading layer dim (`nn.scan`, `nnx.scan`, a hand-written scan; a `fori_loop`
reading `w[i]` is read as the scan it is, `indexed_stacks`). `find_layer_scan`
finds that scan in the loss function's jaxpr, from abstract arguments alone: a scan at
the top level of the loss (or inside a `jax.jit` it calls) that carries one activation
with the batch leading, iterates over stacked parameter leaves (directly, or through
dtype casts for mixed precision) and per-layer values that have no batch rows (a flag per
layer, a per-layer dropout key), and stacks no per-layer outputs anyone reads. What it
closes over may come from the batch: a value with the batch's rows (positions, segment
ids, a mask) is cut into micro-batches as the activation is. Among several, the one
whose stacked parameters hold the most bytes. A scan jaxwap cannot pipeline raises
`NoLayerScan`, whose message says what is missing; the planner shows it in `explain()`.

Finding is kept apart from what is done with the scan once found
(`runtime.layer_scan_rewrite`: the loss rewritten onto the pipeline, a stage's cut of the
stack), which locates it again by its `LayerScan.path` (`equation_at`) in a jaxpr traced
the same way (`trace_loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from jaxwap.analysis.flatten import bodies_one_to_one, is_value, scan_counts, sub_jaxprs
from jaxwap.analysis.graph_cache import abstract_key, kept
from jaxwap.analysis.roles import batch_rows, is_key_dtype
from jaxwap.runtime.batch_keys import maybe_raw_key, wrapped_keys
from jaxwap.runtime.indexed_stacks import as_layer_scans, called_jaxpr

# calls the search looks through and the rewrite inlines: the scan may sit inside one
CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call"})
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
    nested `jax.jit` calls); the rewrites (`layer_scan_rewrite`) find it again by that."""

    length: int
    stacked: tuple[int, ...]
    carry_shape: tuple[int, ...]
    carry_dtype: str
    batch_size: int
    path: tuple[int, ...] = ()
    # positions among the scan's per-layer inputs of those that are not parameters (a
    # per-layer flag or constant, a Flax dropout key the layers never draw from): a
    # pipeline passes them whole to every stage, each layer reading its own row
    extras: tuple[int, ...] = ()
    # those of them that are PRNG keys the layers draw from (dropout inside the stack),
    # each with None (typed keys) or the implementation raw key data is wrapped with: a
    # stage folds each micro-batch's and data shard's index into its layer's key
    draws: tuple[tuple[int, str | None], ...] = ()
    # positions among the scan's consts of those with the batch's rows leading (a mask,
    # positions, segment ids the layers read): a stage reads its micro-batch's rows of
    # them, where a trace at a micro-batch's rows shows them cut so (`_body_at`)
    row_consts: tuple[int, ...] = ()
    # a batch row's bytes of them: what the pipeline's loop holds per row it takes in
    row_const_bytes: int = 0
    # why it cannot be pipelined, where it is a loop over layers that can only be
    # checkpointed layer by layer (`find_in_jaxpr(..., remat=True)`); None: it can be
    not_pipelined: str | None = None

    @property
    def carry_row_bytes(self) -> int:
        """Bytes of one batch row of the carried activation: what a stage sends per row."""
        return int(np.prod(self.carry_shape[1:], dtype=np.int64)
                   * np.dtype(self.carry_dtype).itemsize)


def abstract_values(tree: Any) -> Any:
    """`tree` as `jax.ShapeDtypeStruct`s: the loss is traced from shapes alone, so arrays
    and abstract arguments (and Python scalars, by their JAX type) trace alike."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype")
                                       else jnp.result_type(x)), tree)


def batch_size_of(batch: Any) -> int:
    """The batch's rows, which micro-batches split: the leading dim most of its leaves
    share (`roles.batch_rows`, as `make_train_step`'s micro-batches take it). Leaves
    without it (a PRNG key, class weights, a scalar temperature) are not rows: a stage's
    micro-batch leaves them whole."""
    size = batch_rows(jax.tree_util.tree_leaves(batch))
    if size is None:
        raise NoLayerScan("the batch has no array with a leading (batch) dim to split into "
                          "micro-batches")
    return size


def batch_at_rows(batch: Any, rows: int) -> Any:
    """The batch, abstract, with the leaves that have its rows (`batch_size_of`) cut to
    `rows`: what a pipeline stage's micro-batch is; the others (a PRNG key, class
    weights, a scalar) stay whole."""
    size = batch_size_of(batch)
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((rows, *np.shape(x)[1:]), x.dtype)
        if np.ndim(x) and np.shape(x)[0] == size else x, abstract_values(batch))


def trace_loss(loss_fn: Callable, params: Any, batch: Any) -> tuple[ClosedJaxpr, Any]:
    """(closed jaxpr, output tree) of the loss on abstract arguments. Kept
    (`graph_cache.kept`) by loss, argument shapes and context (the abstract mesh it is
    traced in), unless it closes over another trace's values: a plan's rewrites trace the
    same loss again for each variant (the layers found, each remat policy, each
    pipeline), and tracing a large unrolled model's Python is much of planning it."""
    args = (abstract_values(params), abstract_values(batch))

    def build() -> tuple[ClosedJaxpr, Any]:
        closed, out = jax.make_jaxpr(loss_fn, return_shape=True)(*args)
        # a fori_loop over stacked layers, as the layer scan it is
        return as_layer_scans(closed), jax.tree_util.tree_structure(out)
    return kept(("loss trace", loss_fn, *abstract_key(args)), build,
                keep=lambda got: not any(isinstance(c, jax.core.Tracer)
                                         for c in got[0].consts))


#: why a loss has no layer scan, where it has no scan at all
NO_SCAN = "the loss function has no lax.scan over stacked parameters at its top level"


def has_scan(jaxpr: Jaxpr) -> bool:
    """Whether a `lax.scan` runs anywhere in `jaxpr`, nested calls included: a step
    whose trace has none has no layer scan in its loss, which then need not be traced
    again to say so."""
    return any(e.primitive.name == "scan" or any(has_scan(j) for j in sub_jaxprs(e.params))
               for e in jaxpr.eqns)


def _indexed_stacks(consts: list[Any], param_of: dict[Any, int], length: int) -> list[Any]:
    """The consts of a scan of `length` iterations that are stacked parameters of as many
    layers: what a `fori_loop` over layers indexes where a layer scan slices (one that
    reads layer i at iteration i, `w[i]`, was made a layer scan: `trace_loss`)."""
    return [v for v in consts if is_value(v) and v in param_of and v.aval.shape[:1] == (length,)]


def reads(jaxpr: Jaxpr, var: Any) -> bool:
    """Whether `jaxpr` reads its input `var`: some equation takes it, other than a call
    whose body (taking its inputs one to one: jit, checkpoint, custom derivatives, a
    scan's body) leaves it unread, or it is an output."""
    if any(v is var for v in jaxpr.outvars):
        return True
    for eqn in jaxpr.eqns:
        for k, v in enumerate(eqn.invars):
            if v is not var:
                continue
            inner = bodies_one_to_one(eqn)
            if not inner or any(reads(j, j.invars[k]) for j in inner):
                return True
    return False


class _Search:
    """The candidates among a loss jaxpr's scans, the reasons the others were refused
    (weighted by their per-layer inputs' bytes: the most promising scan's reason is the
    one reported), and the names of equations that hide a scan from the search."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.found: list[tuple[int, LayerScan]] = []
        self.reasons: list[tuple[int, str]] = []
        self.hidden: list[str] = []
        # loops over layers that cannot be pipelined but can be checkpointed layer by
        # layer: per-layer inputs besides the weights (dropout keys), a fori_loop's
        # counter, more carries, used per-layer outputs, batch-dependent consts
        self.remat: list[tuple[int, LayerScan]] = []

    def walk(self, jaxpr: Jaxpr, param_of: dict[Any, int], on_batch: set[Any],
             live: set[Any], path: tuple[int, ...]) -> None:
        """Scan `jaxpr`'s equations in order: `param_of` maps the values that are
        parameter leaves (or casts of them) to their leaf index, `on_batch` holds the
        values computed from the batch, `live` the outputs the caller reads."""
        used = {v for v in jaxpr.outvars if is_value(v) and v in live}
        for eqn in jaxpr.eqns:
            used.update(v for v in eqn.invars if is_value(v))
        for k, eqn in enumerate(jaxpr.eqns):
            ins = [v for v in eqn.invars if is_value(v)]
            name = eqn.primitive.name
            if name == "convert_element_type" and ins and ins[0] in param_of:
                param_of[eqn.outvars[0]] = param_of[ins[0]]
            elif name == "scan":
                self.judge(eqn, param_of, on_batch, used, (*path, k))
            elif name in CALL_PRIMITIVES:
                inner = called_jaxpr(eqn).jaxpr
                pairs = list(zip(eqn.invars, inner.invars, strict=True))
                self.walk(inner,
                          {i: param_of[o] for o, i in pairs if is_value(o) and o in param_of},
                          {i for o, i in pairs if is_value(o) and o in on_batch},
                          {i for o, i in zip(eqn.outvars, inner.outvars, strict=True)
                           if o in used}, (*path, k))
            elif any(has_scan(j) for j in sub_jaxprs(eqn.params)):
                self.hidden.append(name)
            if any(v in on_batch for v in ins):
                on_batch.update(eqn.outvars)

    def judge(self, eqn: Any, param_of: dict[Any, int], on_batch: set[Any],
              used: set[Any], path: tuple[int, ...]) -> None:
        p = eqn.params
        (nc, ncarry), length = scan_counts(p), int(p["length"])
        consts, carry = eqn.invars[:nc], eqn.invars[nc:nc + ncarry]
        xs = eqn.invars[nc + ncarry:]
        stacked = [param_of.get(v) if is_value(v) else None for v in xs]
        weight = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in xs)
        aval = carry[0].aval if ncarry == 1 else None
        why = None
        if p.get("reverse", False):
            why = "the scan runs in reverse"
        elif not xs and _indexed_stacks(consts, param_of, length):
            why = ("the loop reads its stacked parameters other than as layer i at "
                   "iteration i (a fori_loop reading w[L - 1 - i], say); written as a "
                   "lax.scan over them, it can be pipelined")
        elif ncarry != 1:
            why = (f"the scan carries {ncarry} values; pipelining needs one carried "
                   f"activation")
        elif not xs or all(s is None for s in stacked):
            why = "the scan has no stacked parameters as per-layer inputs"
        elif isinstance(other := self._other_inputs(eqn, xs, stacked, on_batch), str):
            why = other
        elif np.ndim(aval) == 0 or aval.shape[0] != self.batch_size:
            why = (f"the scan's carried value {aval.str_short()} does not have the batch "
                   f"({self.batch_size}) as its leading dim")
        elif any(v in used for v in eqn.outvars[ncarry:]):
            why = "the scan's stacked per-layer outputs are used"
        elif length < 2:
            why = f"the scan has {length} layer"
        if why is not None:
            self.reasons.append((weight, why))
            self._remat_only(eqn, param_of, carry, xs, weight, why, path)
            return
        rowed = [k for k, v in enumerate(consts)
                 if is_value(v) and v.aval.shape[:1] == (self.batch_size,)]
        self.found.append((weight, LayerScan(
            length, tuple(int(s) for s in stacked if s is not None),
            tuple(int(d) for d in aval.shape), str(aval.dtype), self.batch_size, path,
            extras=tuple(i for i, s in enumerate(stacked) if s is None), draws=other,
            row_consts=tuple(rowed),
            row_const_bytes=sum(int(np.prod(consts[k].aval.shape[1:]))
                                * consts[k].aval.dtype.itemsize for k in rowed))))

    def _other_inputs(self, eqn: Any, xs: list[Any], stacked: list[int | None],
                      on_batch: set[Any]) -> str | tuple[tuple[int, str | None], ...]:
        """Why the scan's per-layer inputs that are not parameters keep it from a
        pipeline, or the PRNG keys the layers draw from (position; None for typed keys,
        else the implementation raw key data is wrapped with). A stage passes
        them whole and each layer reads its row: a per-layer constant or flag as it is, a
        key folded with the micro-batch's and the data shard's index (drawn as it was,
        every micro-batch and shard would draw the same); a value with the batch's rows
        cannot be (a micro-batch needs its own rows)."""
        body = eqn.params["jaxpr"].jaxpr
        inner = body.invars[len(body.invars) - len(xs):]
        draws: list[tuple[int, str | None]] = []
        raw = {}
        for i, (x, s, v) in enumerate(zip(xs, stacked, inner, strict=True)):
            if s is not None:
                continue
            if not is_value(x):
                return "a per-layer input of the scan is a literal"
            if x in on_batch and x.aval.shape[1:2] == (self.batch_size,):
                return (f"a per-layer input of the scan ({x.aval.str_short()}) has the "
                        f"batch's rows")
            if is_key_dtype(x.aval.dtype) and reads(body, v):
                draws.append((i, None))
            elif maybe_raw_key(v.aval):
                raw[v] = i
        draws += [(i, impl) for i, impl in wrapped_keys(body, raw).items()]
        return tuple(sorted(draws))

    def _remat_only(self, eqn: Any, param_of: dict[Any, int], carry: list[Any],
                    xs: list[Any], weight: int, why: str, path: tuple[int, ...]) -> None:
        """Keep a scan refused for pipelining as layers to checkpoint, where it loops
        over layers: two or more iterations over stacked parameters (scanned, or indexed
        as its consts), with an activation of the batch's rows carried."""
        length = int(eqn.params["length"])
        consts = eqn.invars[:scan_counts(eqn.params)[0]]
        stacked = [param_of[v] for v in xs if is_value(v) and v in param_of]
        indexed = _indexed_stacks(consts, param_of, length)
        rows = [v.aval for v in carry if np.ndim(v.aval) and v.aval.shape[0] == self.batch_size]
        if length < 2 or not (stacked or indexed) or not rows:
            return
        weight += sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in indexed)
        aval = max(rows, key=lambda a: int(np.prod(a.shape)))
        self.remat.append((weight, LayerScan(
            length, tuple(stacked), tuple(int(d) for d in aval.shape), str(aval.dtype),
            self.batch_size, path, not_pipelined=why)))

    def best(self, remat: bool = False) -> LayerScan:
        if self.found:
            return max(self.found, key=lambda x: x[0])[1]
        if remat and self.remat:
            return max(self.remat, key=lambda x: x[0])[1]
        if self.reasons:
            raise NoLayerScan(max(self.reasons, key=lambda x: x[0])[1])
        if self.hidden:
            inside = _WRITTEN.get(self.hidden[0], f"`{self.hidden[0]}`")
            raise NoLayerScan(f"the loss function's lax.scan is inside {inside}, not at "
                              f"the top level of the loss function (only nested jax.jit "
                              f"calls are looked through)")
        raise NoLayerScan(NO_SCAN)


def find_in_jaxpr(jaxpr: Jaxpr, n_params: int, batch_size: int,
                  remat: bool = False) -> LayerScan:
    """The layer scan of a loss jaxpr taking (param leaves, batch leaves). `remat`: where
    no scan can be pipelined, a loop over layers that can still be checkpointed layer by
    layer (`LayerScan.not_pipelined` says why it cannot be pipelined)."""
    search = _Search(batch_size)
    search.walk(jaxpr, {v: i for i, v in enumerate(jaxpr.invars[:n_params])},
                set(jaxpr.invars[n_params:]), {v for v in jaxpr.outvars if is_value(v)}, ())
    return search.best(remat)


def find_layer_scan(loss_fn: Callable, params: Any, batch: Any) -> LayerScan:
    """The layer scan of `loss_fn(params, batch)` (arrays or `jax.ShapeDtypeStruct`s);
    `NoLayerScan` says why there is none it can pipeline."""
    batch_size = batch_size_of(batch)
    closed, _ = trace_loss(loss_fn, params, batch)
    return find_in_jaxpr(closed.jaxpr, len(jax.tree_util.tree_leaves(params)), batch_size)


def equation_at(jaxpr: Jaxpr, path: tuple[int, ...]) -> Any:
    """The equation at `path` (equation indices through nested calls)."""
    eqn = jaxpr.eqns[path[0]]
    return eqn if len(path) == 1 else equation_at(called_jaxpr(eqn).jaxpr, path[1:])


__all__ = ["CALL_PRIMITIVES", "NO_SCAN", "LayerScan", "NoLayerScan", "abstract_values",
           "batch_at_rows", "batch_size_of", "called_jaxpr", "equation_at", "find_in_jaxpr",
           "find_layer_scan", "has_scan", "reads", "trace_loss"]
