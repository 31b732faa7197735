"""The layer stack of a loss function, found in its jaxpr and run as a pipeline.

Most large JAX models run their repeated blocks as one `lax.scan` over parameters stacked
along a leading layer dim (`nn.scan`, `nnx.scan`, a hand-written scan). `find_layer_scan`
finds that scan in the loss function's jaxpr, from abstract arguments alone: a top-level
scan that carries one activation with the batch leading, iterates over stacked
parameter leaves (directly, or through dtype casts for mixed precision), stacks no
per-layer outputs anyone reads, and closes over nothing computed from the batch. Among
several, the one whose stacked parameters hold the most bytes.

`pipelined_loss` evaluates the same jaxpr equation by equation with that one scan
replaced by `pipeline.pipelined` over the stage axis of the mesh it is traced in: the
user's code is unchanged, and the rewritten loss is ordinary JAX, so `jax.grad` of it is
the backward pipeline. A scan jaxwap cannot pipeline raises `NoLayerScan`, whose message
says what is missing; the planner shows it in `explain()`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend.core import DropVar, Literal

from .pipeline import pipelined, to_stages


class NoLayerScan(ValueError):
    """Why a loss function's layers cannot be pipelined (the message says what is
    missing)."""


@dataclass(frozen=True)
class LayerScan:
    """The layer scan of a loss function: its length, which parameter leaves (indices
    into `jax.tree_util.tree_leaves(params)`) it iterates over, and its carried
    activation, batch leading."""

    length: int
    stacked: tuple[int, ...]
    carry_shape: tuple[int, ...]
    carry_dtype: str
    batch_size: int
    eqn_index: int

    @property
    def carry_row_bytes(self) -> int:
        """Bytes of one batch row of the carried activation: what a stage sends per row."""
        return int(np.prod(self.carry_shape[1:], dtype=np.int64)
                   * np.dtype(self.carry_dtype).itemsize)


def _abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _trace(loss_fn: Callable, params: Any, batch: Any) -> tuple[Any, Any, int, int]:
    """(closed jaxpr, output tree, number of param leaves, batch size) of the loss."""
    closed, out = jax.make_jaxpr(loss_fn, return_shape=True)(_abstract(params),
                                                             _abstract(batch))
    n_params = len(jax.tree_util.tree_leaves(params))
    leading = [np.shape(x)[0] for x in jax.tree_util.tree_leaves(batch) if np.ndim(x) > 0]
    if not leading:
        raise NoLayerScan("the batch has no leading (batch) dimension to split into "
                          "micro-batches")
    return closed, jax.tree_util.tree_structure(out), n_params, int(leading[0])


def _find(jaxpr: Any, n_params: int, batch_size: int) -> LayerScan:
    """The layer scan among `jaxpr`'s top-level equations (see the module docstring)."""
    param_of: dict[Any, int] = {v: i for i, v in enumerate(jaxpr.invars[:n_params])}
    on_batch = set(jaxpr.invars[n_params:])
    used: set[Any] = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    for eqn in jaxpr.eqns:
        used.update(v for v in eqn.invars if not isinstance(v, Literal))
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not isinstance(v, Literal)]
        if eqn.primitive.name == "convert_element_type" and ins and ins[0] in param_of:
            param_of[eqn.outvars[0]] = param_of[ins[0]]
        if any(v in on_batch for v in ins):
            on_batch.update(eqn.outvars)
    found: list[tuple[int, LayerScan]] = []
    reasons: list[tuple[int, str]] = []
    for k, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "scan":
            continue
        p = eqn.params
        nc, ncarry, length = p["num_consts"], p["num_carry"], int(p["length"])
        consts = eqn.invars[:nc]
        carry = eqn.invars[nc:nc + ncarry]
        xs = eqn.invars[nc + ncarry:]
        stacked = [param_of.get(v) for v in xs]
        weight = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in xs)
        why = None
        if p.get("reverse", False):
            why = "the scan runs in reverse"
        elif ncarry != 1:
            why = (f"the scan carries {ncarry} values; pipelining needs one carried "
                   f"activation")
        elif not xs or any(s is None for s in stacked):
            why = ("the scan's per-layer inputs include a value that is not a stacked "
                   "parameter")
        elif np.ndim(carry[0].aval) == 0 or carry[0].aval.shape[0] != batch_size:
            why = (f"the scan's carried value {carry[0].aval.str_short()} does not have "
                   f"the batch ({batch_size}) as its leading dim")
        elif any(v in used for v in eqn.outvars[ncarry:]):
            why = "the scan's stacked per-layer outputs are used"
        elif any(not isinstance(v, Literal) and v in on_batch for v in consts):
            why = "the scan's consts depend on the batch"
        elif length < 2:
            why = f"the scan has {length} layer"
        if why is not None:
            reasons.append((weight, why))
            continue
        a = carry[0].aval
        found.append((weight, LayerScan(length, tuple(int(s) for s in stacked),
                                        tuple(int(d) for d in a.shape), str(a.dtype),
                                        batch_size, k)))
    if found:
        return max(found, key=lambda x: x[0])[1]
    if reasons:
        raise NoLayerScan(max(reasons, key=lambda x: x[0])[1])
    raise NoLayerScan("the loss function has no lax.scan over stacked parameters at its "
                      "top level")


def find_layer_scan(loss_fn: Callable, params: Any, batch: Any) -> LayerScan:
    """The layer scan of `loss_fn(params, batch)` (arrays or `jax.ShapeDtypeStruct`s);
    `NoLayerScan` says why there is none it can pipeline."""
    closed, _, n_params, batch_size = _trace(loss_fn, params, batch)
    return _find(closed.jaxpr, n_params, batch_size)


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
          replace: dict[int, Callable[[list[Any]], list[Any]]] | None = None) -> list[Any]:
    """Evaluate a jaxpr by binding its equations in turn, equation k replaced by
    `replace[k](inputs) -> outputs` where given."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    def write(v: Any, x: Any) -> None:
        if not isinstance(v, DropVar):
            env[v] = x

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        write(v, x)
    for v, x in zip(jaxpr.invars, args, strict=True):
        write(v, x)
    for k, eqn in enumerate(jaxpr.eqns):
        ins = [read(v) for v in eqn.invars]
        if replace and k in replace:
            outs = replace[k](ins)
        else:
            bound = eqn.primitive.get_bind_params(eqn.params)
            # jax 0.10 returns the params; older versions (subfuns, params)
            subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
            # not under the equation's own context (`eqn.ctx`): it holds the mesh of the
            # trace that made it, while a layer runs inside the pipeline's shard_map
            outs = eqn.primitive.bind(*subfuns, *ins, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            write(v, x)
    return [read(v) for v in jaxpr.outvars]


def pipelined_loss(loss_fn: Callable, scan: LayerScan, *, stages: int, micro_batches: int,
                   repeats: int = 1, data_axis: str | tuple[str, ...] | None = None
                   ) -> Callable[[Any, Any], Any]:
    """`loss_fn` with its layer scan run by `pipeline.pipelined` over the stage axis of
    the mesh it is traced in (`jax.set_mesh`), the batch split over `data_axis`. The
    stacked parameters are reordered for the circular schedule (`to_stages`) inside."""
    if scan.length % (stages * repeats):
        raise ValueError(f"{scan.length} layers cannot be split into {stages} stages x "
                         f"{repeats} repeats of equal chunks")

    def loss(params: Any, batch: Any) -> Any:
        closed, out_tree, n_params, batch_size = _trace(loss_fn, params, batch)
        found = _find(closed.jaxpr, n_params, batch_size)
        eqn = closed.jaxpr.eqns[found.eqn_index]
        body = eqn.params["jaxpr"]
        nc = eqn.params["num_consts"]

        def layer(w: list[Any], h: Any, *consts: Any) -> Any:
            return _eval(body.jaxpr, body.consts, [*consts, h, *w])[0]

        run = pipelined(layer, None, micro_batches=micro_batches, repeats=repeats,
                        data_axis=data_axis)

        def replaced(ins: list[Any]) -> list[Any]:
            consts, h, xs = ins[:nc], ins[nc], ins[nc + 1:]
            out = run(to_stages(list(xs), stages, repeats), h, *consts)
            # the per-layer outputs (unused: `_find` checked) stay unmade
            return [out, *(None for _ in eqn.outvars[1:])]

        leaves = [*jax.tree_util.tree_leaves(params), *jax.tree_util.tree_leaves(batch)]
        outs = _eval(closed.jaxpr, closed.consts, leaves, {found.eqn_index: replaced})
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return loss


__all__ = ["LayerScan", "NoLayerScan", "find_layer_scan", "pipelined_loss"]
