"""A training step jaxwap may restructure: `make_train_step(loss_fn, optimizer)`.

An opaque user step can only be sharded (and its optimizer state offloaded): its code
decides what the backward pass keeps alive. A step built here from a loss function and an
optax optimizer has two more knobs the planner may turn when memory is short:

- **rematerialization**: the loss is wrapped in `jax.checkpoint` with a policy, so the
  backward pass recomputes (or fetches from host memory) what the forward pass did not
  keep. Policies, by name: "dots" (keep matmul and convolution outputs, recompute the
  elementwise work between them), "dots_no_batch" (keep only matmuls without batch
  dimensions), "offload_dots" (as "dots_no_batch", but the kept values wait in pinned
  host memory), "none".
- **micro-batches**: the batch is split into `k` micro-batches whose gradients are summed
  in a `lax.scan` before one optimizer update. Micro-batch `i` is rows `i, i+k, i+2k, ...`,
  so a batch sharded over the data axis splits without moving data. With a loss that is
  a mean over the batch, the result equals the full-batch step up to float rounding. A
  PRNG key in the batch is folded with the micro-batch's index (`batch_keys`): each
  micro-batch draws its own dropout, as the whole batch's draw is its own, where the
  same key would repeat one micro-batch's mask in every other.

The step's signature is the usual one, so `auto_shard` and plain `jax.jit` both take it:

    step = jaxwap.make_train_step(loss_fn, optax.adam(1e-3))
    params, opt_state, loss = step(params, opt_state, batch)
    # has_aux=True: loss_fn returns (loss, aux); the step returns (params, opt_state, (loss, aux))
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxwap.analysis.roles import batch_rows
from jaxwap.core.records import DATA, REPLICA, StepVariant
from jaxwap.runtime.batch_keys import fold_micro, key_leaves
from jaxwap.runtime.stage_layout import micro_join, micro_split

T = TypeVar("T")


def _policy(name: str) -> Any:
    cp = jax.checkpoint_policies
    offload = cp.offload_dot_with_no_batch_dims("device", "pinned_host")
    return {"dots": cp.dots_saveable,
            "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
            "offload_dots": offload,
            "layer_dots": cp.dots_with_no_batch_dims_saveable,
            "layer_full": cp.nothing_saveable,
            "layer_offload": offload}[name]


@dataclass(frozen=True)
class _WithoutAux:
    """A loss function returning its loss alone, as `(params, batch) -> (loss, None)`."""

    loss_fn: Callable[..., Any]

    def __call__(self, params: Any, batch: Any) -> tuple[Any, None]:
        return self.loss_fn(params, batch), None


class TrainStep:
    """`step(params, opt_state, batch) -> (params, opt_state, loss)` built from a loss
    function and an optax optimizer; see the module docstring. `variant` says how it is
    restructured; `with_variant` gives the same step restructured another way."""

    def __init__(self, loss_fn: Callable[..., Any], optimizer: Any, *, has_aux: bool = False,
                 variant: StepVariant | None = None, _update: Callable[..., Any] | None = None,
                 _shared_blocks: bool = False) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(f"optimizer must be an optax GradientTransformation (with init "
                            f"and update), got {type(optimizer).__name__}")
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.has_aux = bool(has_aux)
        self.variant = variant or StepVariant()
        # the optimizer's update as one jitted function, shared by every variant of the
        # step: jax keeps its trace by (function, shapes), so the planner's traces of the
        # step restructured (remat, micro-batches) trace the update once, where tracing
        # optax over a large model's leaves costs seconds each time; XLA inlines the call
        self._update = _update or jax.jit(functools.partial(_apply_update, optimizer))
        self._shared_blocks = _shared_blocks
        self._planned_as: TrainStep | None = None
        self.__name__ = getattr(loss_fn, "__name__", "loss_fn") + "_train_step"

    def with_variant(self, variant: StepVariant) -> TrainStep:
        return TrainStep(self.loss_fn, self.optimizer, has_aux=self.has_aux, variant=variant,
                         _update=self._update, _shared_blocks=self._shared_blocks)

    def planned_as(self) -> TrainStep:
        """The same step as the planner traces it: a loss without remat has an unrolled
        model's repeated blocks each a jitted call (`layer_remat.shared_blocks_loss`),
        the same program differentiated one block at a time. Only traced, never run: the
        step that runs is this one. Made once per step, so jax's trace cache, keyed by
        the function, serves a second plan of it."""
        if self._shared_blocks:
            return self
        if self._planned_as is None:
            self._planned_as = TrainStep(self.loss_fn, self.optimizer, has_aux=self.has_aux,
                                         variant=self.variant, _update=self._update,
                                         _shared_blocks=True)
        return self._planned_as

    def init(self, params: Any) -> Any:
        """The optimizer state for `params` (`optimizer.init`)."""
        return self.optimizer.init(params)

    def loss_and_aux(self) -> Callable[..., Any]:
        """`loss_fn` as `(params, batch) -> (loss, aux)`, aux None without `has_aux`: the
        same function (equal, hashable) for every variant of the step, so the traces of
        it `layer_scan.trace_loss` keeps serve them all."""
        return self.loss_fn if self.has_aux else _WithoutAux(self.loss_fn)

    def _loss(self) -> Callable[..., Any]:
        fn = self.loss_and_aux()
        if self.variant.pipelined:       # its remat ("stage", or none) is the pipeline's
            return _pipelined(fn, self.variant)
        if self.variant.remat.startswith("layer_"):
            from jaxwap.runtime.layer_remat import layer_remat_loss

            fn = layer_remat_loss(fn, _policy(self.variant.remat))
        elif self.variant.remat != "none":
            fn = jax.checkpoint(fn, policy=_policy(self.variant.remat))
        elif self._shared_blocks:
            from jaxwap.runtime.layer_remat import shared_blocks_loss

            fn = shared_blocks_loss(fn)
        return fn

    def grads(self, params: Any, batch: Any) -> tuple[Any, Any, Any]:
        """(loss, aux, gradients) of the whole batch, micro-batched as the variant says."""
        vag = jax.value_and_grad(self._loss(), has_aux=True)
        # a pipeline's micro-batches flow through its stages inside the loss
        k = 1 if self.variant.pipelined else self.variant.micro_batches
        if k == 1:
            (loss, aux), g = vag(params, batch)
            return loss, aux, g
        # the leaves with the batch's leading dim are split; the rest (class weights, a
        # temperature) go whole to every micro-batch, a PRNG key folded with its index
        flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
        b = batch_rows([x for _, x in flat])
        split = [np.ndim(x) > 0 and np.shape(x)[0] == b for _, x in flat]
        micro = [_split(p, x, k) for (p, x), cut in zip(flat, split, strict=True) if cut]
        keys = key_leaves(lambda: self._loss_trace(params, batch), [x for _, x in flat],
                          [not cut for cut in split])

        def whole(x: Any, kind: Any, index: Any) -> Any:
            return x if kind is False else fold_micro(x, index, kind)

        def body(acc: Any, parts: Any) -> tuple[Any, Any]:
            index, it = parts[0], iter(parts[1])
            mb = jax.tree_util.tree_unflatten(treedef, [
                next(it) if cut else whole(x, kind, index)
                for (_, x), cut, kind in zip(flat, split, keys, strict=True)])
            (loss, aux), g = vag(params, mb)
            acc_g, acc_l = acc
            return (jax.tree_util.tree_map(jnp.add, acc_g, g),
                    acc_l + loss.astype(jnp.float32)), aux

        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        # the loss sums in float32 (a mean loss is float32 in the usual step anyway)
        (g, loss), auxs = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)),
                                       (jnp.arange(k, dtype=jnp.uint32), micro))
        g = jax.tree_util.tree_map(lambda x: x / k, g)
        aux = jax.tree_util.tree_map(lambda x: _combine(x, (b or 0) // k), auxs)
        return loss / k, aux, g

    def _loss_trace(self, params: Any, batch: Any) -> Any:
        """The loss's closed jaxpr on the whole batch (`layer_scan.trace_loss`, kept: the
        planner's layer searches trace the same)."""
        from jaxwap.runtime.layer_scan import trace_loss

        return trace_loss(self.loss_and_aux(), params, batch)[0]

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, ...]:
        loss, aux, g = self.grads(params, batch)
        params, opt_state = self._update(g, opt_state, params)
        return params, opt_state, ((loss, aux) if self.has_aux else loss)

    def __repr__(self) -> str:
        return f"TrainStep({self.__name__}, {self.variant.describe()})"


def _apply_update(optimizer: Any, g: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
    """(new params, new optimizer state): the optimizer's update applied."""
    import optax

    updates, opt_state = optimizer.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _pipelined(fn: Callable[..., Any], variant: StepVariant) -> Callable[..., Any]:
    """`fn` with its layer stack (the `lax.scan` over stacked parameters `jaxwap.runtime.layer_scan`
    finds) run as a pipeline over the stage axis of the mesh it is traced in, the batch
    split over that mesh's data axes."""
    from jaxwap.runtime.layer_scan import find_layer_scan
    from jaxwap.runtime.layer_scan_rewrite import pipelined_loss

    def loss(params: Any, batch: Any) -> Any:
        names = jax.sharding.get_abstract_mesh().axis_names
        data = tuple(a for a in (REPLICA, DATA) if a in names) or None
        scan = find_layer_scan(fn, params, batch)
        return pipelined_loss(fn, scan, stages=variant.stages,
                              micro_batches=variant.micro_batches, repeats=variant.repeats,
                              data_axis=data, param_specs=variant.stage_specs,
                              stage_remat=variant.remat == "stage")(params, batch)
    return loss


def _split(path: Any, x: Any, k: int) -> Any:
    """[B, ...] -> [k, B/k, ...], micro-batch i holding rows i, i+k, ...: a batch whose
    rows are sharded in contiguous blocks over the data axis stays where it is."""
    shape = np.shape(x)
    if shape[0] % k:
        where = f"batch{jax.tree_util.keystr(path)}"
        raise ValueError(f"{where} with shape {tuple(shape)}: its leading (batch) dimension "
                         f"must divide into {k} micro-batches")
    return micro_split(jnp.asarray(x), k)


def _combine(x: Any, rows: int) -> Any:
    """Per-micro-batch aux values, stacked [k, ...], as the whole batch would give them:
    one per example (`rows`, the micro-batch's batch size, leading) put back in the
    batch's order (`_split`'s inverse); other floats averaged (a mean metric stays the
    whole batch's mean), integers summed (counts over the batch add up), booleans and-ed
    (a flag holds for the batch where it holds for every part)."""
    if x.ndim > 1 and x.shape[1] == rows:
        return micro_join(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.mean(0)
    return x.all(0) if x.dtype == jnp.bool_ else x.sum(0, dtype=x.dtype)


def make_train_step(loss_fn: Callable[..., Any], optimizer: Any, *,
                    has_aux: bool = False) -> TrainStep:
    """A standard training step from `loss_fn(params, batch) -> loss` (or `(loss, aux)`
    with `has_aux=True`) and an optax optimizer. The loss should be a mean over the batch,
    so that micro-batching leaves the result unchanged. Under micro-batches an aux is
    combined as the whole batch would give it where its kind says how: per-example
    outputs (the batch's leading dim) reassembled, float metrics averaged, integers
    summed (counts), booleans and-ed; a float sum or an integer that is not a count would
    need the loss to return it per example. Batch leaves without the batch's leading dim
    (class weights, a temperature) reach every micro-batch whole; a PRNG key among them
    (typed, or raw data the loss wraps) is folded with the micro-batch's index, so the
    micro-batches draw their dropout apart. `auto_shard` may
    restructure the step (micro-batches, remat policy) when a plan does not fit
    otherwise; calling it directly runs it as written."""
    return TrainStep(loss_fn, optimizer, has_aux=has_aux)


def restructured(fn: Callable[..., Any], variant: StepVariant | None) -> Callable[..., Any]:
    """`fn` restructured as `variant` says (itself for None or the step as written); only
    a step `make_train_step` built can be."""
    if variant is None or variant.is_plain:
        return fn
    if not isinstance(fn, TrainStep):
        raise ValueError(f"a plan restructures the step ({variant.describe()}), but the step "
                         f"is not one jaxwap.make_train_step built")
    return fn.with_variant(variant)


def planned_trace(trace: Callable[[Callable[..., Any]], T], fn: Callable[..., Any]) -> T:
    """`trace(fn)` made from the step as the planner traces it (`TrainStep.planned_as`),
    the same program traced faster; `trace(fn)` itself where that fails (the faster
    trace is an optional branch: a failure of the user's own step surfaces from tracing
    the step as it is)."""
    if not isinstance(fn, TrainStep) or fn.planned_as() is fn:
        return trace(fn)
    try:
        return trace(fn.planned_as())
    except Exception:  # noqa: BLE001 - optional: trace the step as it is, which says why
        return trace(fn)


def ladder(batch_size: int | None, platform: str, max_micro_batches: int = 64,
           layers: str | None = None, rows: int | None = None) -> list[StepVariant]:
    """The variants to try when the step as written does not fit, cheapest first: where
    the loss has layers (`layers`: "scan", a layer scan; "blocks", an unrolled model's
    repeated blocks), per-layer rematerialization, selective (each layer's weight matmul
    outputs kept: what recomputes is attention's and the elementwise work) before full
    (only each layer's input kept: its whole forward pass again), and off the CPU
    (`platform`: "cpu", or an accelerator's) the selective one with its kept values in
    host memory; then ever more micro-batches (each
    halves the activations held at once and adds launches), which the search also tries
    with full per-layer remat (`step_variants.search_variants`).

    Whole-loss rematerialization is not on the ladder: its recomputation is one replay of
    the forward pass at the start of the backward pass, and the memory model, which walks
    the program in order, sees every recomputed value live until its use: the same peak as
    the step as written (checked on GPT-2 and a Llama decoder, byte for byte), so it could
    never be chosen. Per layer, the forward pass keeps only what the policy keeps, which
    the model credits as it reads the program. On a CPU, per-layer remat is offered for a
    layer scan only: XLA:CPU computes an unrolled model's recomputations all ahead of the
    backward pass, so its checkpointed blocks save nothing there (`layer_blocks`); and
    XLA:CPU places nothing in host memory: no offload rung there.

    The micro-batch counts are powers of two, after the counts that split `rows` (a data
    shard's rows on the widest data axis the batch allows) evenly, which keep that axis
    and with it the devices the weights shard over: 9 rows a shard (2,160 sequences on 240
    data devices) take 3 or 9 micro-batches, where any power of two would lose the axis.
    Where `rows` is a power of two the order is the powers' own."""
    out: list[StepVariant] = []
    if layers == "scan" or (layers == "blocks" and platform != "cpu"):
        out += [StepVariant(remat="layer_dots"), StepVariant(remat="layer_full")]
        if platform != "cpu":
            out.append(StepVariant(remat="layer_offload"))
    if not batch_size:
        return out
    top = min(batch_size, max_micro_batches)
    keep = [k for k in range(2, min(rows or 1, top) + 1) if rows % k == 0]
    powers = [1 << e for e in range(1, top.bit_length()) if 1 << e not in keep]
    out += [StepVariant(micro_batches=k) for k in keep + powers if batch_size % k == 0]
    return out


__all__ = ["TrainStep", "ladder", "make_train_step", "planned_trace", "restructured"]
