"""The loss with its layers run as calls of their own: checkpointed (per-layer
rematerialization, `layer_remat_loss`), or jitted for the planner's traces
(`shared_blocks_loss`).

Both are built from the loss's traced jaxpr (`layer_scan.trace_loss`), evaluated again
equation by equation with each layer replaced (`layer_scan_rewrite.evaluate_replacing`),
so the user's code is unchanged and what comes out is ordinary JAX. The layers are the
body of the loss's layer scan, else the repeats of an unrolled model
(`layer_blocks.find_repeated_blocks`). An unrolled model's alike repeats
(`layer_blocks.alike_repeats`) run one function, traced once: JAX's caches of its
derivative and transposition then serve every layer, where differentiating each layer's
equations afresh is most of tracing a deep unrolled step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr

from jaxwap.analysis.flatten import bind, evaluate, group_ios
from jaxwap.runtime.layer_blocks import RepeatedBlocks, alike_repeats, find_layers
from jaxwap.runtime.layer_scan import (
    NoLayerScan,
    batch_size_of,
    called_jaxpr,
    equation_at,
    trace_loss,
)
from jaxwap.runtime.layer_scan_rewrite import evaluate_replacing, rebound


def layer_remat_loss(loss_fn: Callable, policy: Any) -> Callable[[Any, Any], Any]:
    """`loss_fn` with each of its layers rematerialized: run under `jax.checkpoint(policy=
    ...)`, so the backward pass keeps what the policy saves of each layer (nothing: the
    layer's input alone; the matmul outputs; or those in host memory) and recomputes the
    rest a layer at a time, as Megatron and MaxText checkpoint per layer. Checkpointing
    the whole loss saves nothing (its recomputation replays the whole forward pass at
    once); per layer, what the forward pass keeps for the backward one shrinks to what the
    policy keeps.

    The layers are the body of the loss's layer scan (`find_in_jaxpr`), else the repeats
    of an unrolled model (`layer_blocks.find_repeated_blocks`); a loss with neither
    raises `NoLayerScan` with both reasons. Built from the traced jaxpr (the loss traced
    at the batch it is given, evaluated again with each layer checkpointed), so the
    user's code is unchanged. Unlike a scan's body, unrolled blocks sit side by side in
    one program, where XLA's common-subexpression elimination would merge a block's
    recomputation with its forward pass: their `prevent_cse` stays on."""
    def loss(params: Any, batch: Any) -> Any:
        leaves = jax.tree_util.tree_leaves(params)
        closed, out_tree = trace_loss(loss_fn, params, batch)
        found = find_layers(closed.jaxpr, len(leaves), batch_size_of(batch))
        if isinstance(found, RepeatedBlocks):
            return blocks_as_calls(closed, out_tree, leaves, batch, found,
                                   lambda f: jax.checkpoint(f, policy=policy))
        eqn = equation_at(closed.jaxpr, found.path)
        body = eqn.params["jaxpr"]

        def layer(*args: Any) -> list[Any]:
            return evaluate(body.jaxpr, body.consts, args)

        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.jaxpr.invars]
        checked = jax.make_jaxpr(jax.checkpoint(layer, policy=policy, prevent_cse=False))(
            *avals)
        remat = eqn.replace(params={**eqn.params, "jaxpr": checked})
        return rebound(closed, out_tree, leaves, batch, found.path,
                       lambda ins: bind(remat, ins))

    return loss


def shared_blocks_loss(loss_fn: Callable) -> Callable[[Any, Any], Any]:
    """`loss_fn` as the planner traces it: an unrolled model's repeated blocks each a
    `jax.jit` call, alike repeats one jitted function. The program is the same one, which
    the planner's analysis reads through the calls (they are inlined there, as XLA
    inlines them), but differentiating it costs one block's trace, not one per layer: an
    unrolled 126-layer model's value and gradient trace in a tenth of the time. A loss
    without repeated blocks (a layer scan, whose body JAX already traces once; or no
    layers) is `loss_fn` itself."""
    def loss(params: Any, batch: Any) -> Any:
        leaves = jax.tree_util.tree_leaves(params)
        try:
            closed, out_tree = trace_loss(loss_fn, params, batch)
            found = find_layers(closed.jaxpr, len(leaves), batch_size_of(batch))
        except NoLayerScan:
            found = None
        if not isinstance(found, RepeatedBlocks):
            return loss_fn(params, batch)
        return blocks_as_calls(closed, out_tree, leaves, batch, found, jax.jit)

    return loss


def blocks_as_calls(closed: ClosedJaxpr, out_tree: Any, leaves: Sequence[Any], batch: Any,
                    blocks: RepeatedBlocks, wrap: Callable[[Callable], Callable]) -> Any:
    """The traced loss's outputs (as `out_tree`) on the parameter `leaves` and `batch`,
    each of an unrolled model's repeated blocks run as `wrap(block)` (`jax.checkpoint`
    with a policy, `jax.jit`), made once for alike repeats."""

    def where(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        groups, calls = {}, []
        bounds = blocks.bounds()
        ios = group_ios(jaxpr, bounds)
        for i, ((first, past), alike) in enumerate(zip(
                bounds, alike_repeats(jaxpr, blocks, ios), strict=True)):
            if alike != i:
                # an alike repeat runs its first's function: one trace, whose derivative
                # and transposition JAX's caches then hold for every layer
                calls.append(calls[alike])
            else:
                ins, outs = ios[i]
                # the block as a jaxpr of its own, named as the repeat it is
                info = jaxpr.debug_info._replace(
                    func_src_info=f"repeated block at equations {first}:{past}",
                    arg_names=tuple(f"in{j}" for j in range(len(ins))),
                    result_paths=tuple(f"out{j}" for j in range(len(outs))))
                part = Jaxpr([], ins, outs, jaxpr.eqns[first:past],
                             effects=frozenset().union(
                                 *(e.effects for e in jaxpr.eqns[first:past])),
                             debug_info=info)
                calls.append(wrap(lambda *xs, part=part: evaluate(part, [], xs)))
            groups[first] = (past, lambda xs, block=calls[i]: block(*xs))
        return evaluate(jaxpr, consts, args, groups=groups)

    args = [*leaves, *jax.tree_util.tree_leaves(batch)]
    if blocks.path:
        call = equation_at(closed.jaxpr, blocks.path)
        inner = called_jaxpr(call)
        outs = evaluate_replacing(closed.jaxpr, closed.consts, args, replace=(
            blocks.path, lambda ins: where(inner.jaxpr, inner.consts, ins)))
    else:
        outs = where(closed.jaxpr, closed.consts, args)
    return jax.tree_util.tree_unflatten(out_tree, outs)


__all__ = ["blocks_as_calls", "layer_remat_loss", "shared_blocks_loss"]
