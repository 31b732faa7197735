"""What a pipeline's stage step keeps for its backward pass: its `jax.checkpoint` policy.

Each loop step of `runtime.schedule.pipelined` is a `jax.checkpoint`, so that the weights
sliced (or gathered) for a step are sliced again in the backward pass instead of being
stacked once per loop step. A checkpoint's policy reaches into every checkpoint nested in
it: jax partially evaluates an inner `jax.checkpoint` with the outer one's policy
(`pe.call_partial_eval_custom_rule` is handed the outer `saveable`), so a layer the user
checkpointed (`jax.checkpoint`, `nn.remat`, per-layer remat as Megatron and MaxText
write it) would keep every value it computes inside a stage that saves all but views:
on XLA:CPU, 2 stages x 2 data x 2 model, 8 layers of an MLP block, its compiled
temporaries were the same 28.1 MB checkpointed or not. So the stage's policy is built
from the layer's own: each layer's input is kept (named `LAYER_INPUT`, as the layer's
checkpoint keeps it), inside the layer the user's policy decides, and views are never
kept."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxwap.analysis.flatten import REMAT_PRIMITIVES
from jaxwap.runtime.layer_scan import CALL_PRIMITIVES, called_jaxpr

# Primitives whose outputs the stage step's checkpoint recomputes rather than keeps: views
# of other values, so their sources are kept (or, for the weights, held by the loop anyway).
# A layer's weights gathered over the data axes (FSDP inside a stage) are gathered again
# for the backward pass too, as FSDP does: kept, they would be the whole chunk per loop step.
VIEWS = frozenset({"all_gather", "broadcast_in_dim", "convert_element_type", "copy",
                   "dynamic_slice", "gather", "name", "reshape", "slice", "squeeze",
                   "transpose"})
# the name a stage gives each layer's input where the layer is checkpointed
LAYER_INPUT = "jaxwap_layer_input"

Policy = Callable[..., Any]


def keep_all_but_views(prim: Any, *_: Any, **__: Any) -> bool:
    """The stage step's remat policy for layers not checkpointed, and a gathering layer's:
    save every value except views (`VIEWS`), so the weights sliced for a step (gathered for
    a layer) are sliced (gathered) again in the backward pass instead of being stacked once
    per loop step (per layer). (`jax.checkpoint_policies.save_anything_except_these_names`
    cannot do it: in jax 0.10.2 it saves everything, names included.)"""
    return prim.name not in VIEWS


def layer_policy(layer: Callable[..., Any], args: Sequence[Any]) -> Policy | None:
    """The policy of the `jax.checkpoint` the layer is written under (traced on `args`,
    abstract shapes suffice), or None where it has none. Calls (`jax.jit`) on the way are
    looked into. Several checkpoints in one layer: a value any of their policies saves is
    saved. A layer checkpointed in part (a block under `jax.checkpoint` beside ops that
    are not) is recomputed whole under that policy inside a stage, the ops outside the
    checkpoint included: a stage then keeps less than the layer as written would, never
    more, and the step pays their recompute."""
    closed = jax.make_jaxpr(layer)(*args)
    policies: list[Policy] = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in REMAT_PRIMITIVES:
                policies.append(eqn.params.get("policy")
                                or jax.checkpoint_policies.nothing_saveable)
            elif name in CALL_PRIMITIVES:
                walk(called_jaxpr(eqn).jaxpr)
    walk(closed.jaxpr)
    if not policies:
        return None
    if len(policies) == 1:
        return policies[0]

    def any_saves(prim: Any, *args: Any, **params: Any) -> Any:
        for policy in policies:
            saved = policy(prim, *args, **params)
            if saved:
                return saved
        return False
    return any_saves


def stage_policy(inner: Policy | None) -> Policy:
    """The stage step's policy for layers checkpointed with `inner` (`layer_policy`):
    each layer's input kept (the value named `LAYER_INPUT`), views never, and the rest as
    `inner` says; `keep_all_but_views` for layers not checkpointed (None)."""
    if inner is None:
        return keep_all_but_views

    def policy(prim: Any, *args: Any, **params: Any) -> Any:
        if prim.name == "name":          # the user's own names are the user's policy's
            return params.get("name") == LAYER_INPUT or inner(prim, *args, **params)
        return prim.name not in VIEWS and inner(prim, *args, **params)
    return policy
