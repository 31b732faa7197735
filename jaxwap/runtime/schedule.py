"""Pipeline stages: a stack of identical layers split over a "stage" mesh axis.

`pipelined(layer, mesh, ...)` turns `layer(params_l, h, *consts) -> h`, applied to every
slice of stacked parameters in turn (what `lax.scan` over a layer stack computes), into
the same function run as a pipeline: each device of the stage axis holds a contiguous
share of the layers, micro-batches flow from stage to stage with `ppermute`, and the
backward pass is the forward loop differentiated (GPipe: every micro-batch forward, then
backward).

With `repeats` r > 1 the schedule is circular (interleaved): the layers are cut into
p x r chunks, stage s holding chunks s, p + s, 2p + s, ..., and each micro-batch passes
round the ring of stages r times, which shrinks the bubble to (p - 1) / (m r + p - 1) of
the loop at the price of r times the sends. A micro-batch back at stage 0 for its next
round waits in a buffer until its turn, so the circular schedule needs at least as many
micro-batches as stages.

How a stack and a batch are laid out for the stages (uneven splits included) is
`runtime.stage_layout`'s.

A stage with nothing to do in a loop step (the bubble) skips its layers under `lax.cond`,
forward and backward, so in the bubble its device idles (except GPipe with `stage_remat`,
the memory-lean schedule, which runs them and drops the result: `_stage_step`). A
`lax.cond` alone would make the differentiated loop keep the stage's weights once per
loop step (the branch's residuals leave the cond as outputs, which the loop stacks). So
each step is also a `jax.checkpoint` whose policy saves everything except views (slices,
reshapes, casts): the weights the backward pass needs are sliced again from the stage's
share, which the loop holds once, and no layer is recomputed. What it costs: the
backward cond hands out the step's weight (and consts) gradient in a buffer of its own,
one copy of the stage's weights beside the accumulated gradient (measured on 2 stages,
GPipe: +5.2 MB of temporaries for 4.2 MB of stage weights and 1 MB of consts). The
circular schedule gains: computing the bubble kept round q's chunk once per loop step (2
stages, 8 micro-batches, 2 rounds: 45.6 MB of temporaries then, 11.1 MB now).

The planner's side is `runtime.layer_scan` (finding the scan), `runtime.layer_scan_rewrite`
(rewriting the loss onto the pipeline) and the cost model (`pipeline_cost`, `pipeline_plan`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxwap.core.records import STAGE, bubble_idles
from jaxwap.runtime.stage_layout import (
    carry_split_dim,
    chunking,
    data_axes,
    micro_join,
    micro_split,
    staged_in_specs,
)
from jaxwap.runtime.stage_policy import (
    LAYER_INPUT,
    keep_all_but_views,
    layer_policy,
    stage_policy,
)


def pipelined(layer: Callable[..., jax.Array], mesh: Mesh | None = None, *,
              micro_batches: int, repeats: int = 1,
              data_axis: str | tuple[str, ...] | None = None,
              param_specs: Any = None, stage_remat: bool = False,
              layers: int | None = None, carry_axis: str | None = None,
              micro_index: bool = False, row_consts: int = 0) -> Callable[..., jax.Array]:
    """`f(staged_params, x, *consts)`: `x` [B, ...] through every layer of the stack,
    `layer(params_l, h, *consts) -> h`, pipelined over the "stage" axis of `mesh` (None:
    the mesh of the context, `jax.set_mesh`). `staged_params` are the stacked parameters
    [L, ...] reordered by `to_stages` (and sharded over the stage axis along their leading
    dim); `consts` reach every stage whole (replicated). The batch is cut into
    `micro_batches` (`micro_split`), each split over `data_axis` (a name or a tuple of
    names) when given. A stage with no work in a loop step (the bubble) skips it.

    The loop is manual over the stage axis and the data axes only (`shard_map`'s
    `axis_names`); any other axis of the mesh (the model axis) is left to XLA's
    partitioner, so a layer whose weights are sharded over it runs tensor-parallel inside
    the stage, with the collectives XLA inserts for it (Megatron's all-reduces of the
    activations), without the layer knowing.

    `param_specs` (a tree like `staged_params`, each leaf a tuple of mesh axis names or
    None for the dims after the layer dim; None: all whole) shards a stage's share over
    other axes too. A dim over a data axis is FSDP inside the stage: the loop gathers
    each layer's weights just before it runs them (and again for the backward pass), and
    their gradients come back reduce-scattered, so a stage holds 1/d of its weights and
    gradients, at the price of a gather per layer per loop step. A dim over any other
    axis (the model axis) stays sharded through the loop: tensor parallelism inside the
    stage.

    `stage_remat`: each loop step keeps only its input for the backward pass, which runs
    the stage's layers forward again first (what MaxText's pipeline does): the loop then
    holds one activation per micro-batch and round, whatever the stage's layers keep, at
    the price of one more forward pass of the stack. Without it, a loop step keeps what
    its layers keep (all but views), for every micro-batch at once.

    `layers`: the stack's own layers, where `to_stages` padded it to more slots (None:
    every slot is a layer); a stage skips its empty slots (`chunking`).

    `carry_axis`: a mesh axis left to XLA (the model axis) over which the loop keeps the
    activations it holds and sends (the micro-batches, the round buffer, the outputs,
    each loop step's input and output) split, along the first dim of a row that divides
    (`carry_split_dim`: a transformer's sequence, as Megatron's sequence parallelism
    splits it), and so does a stage's chunk between its layers: each layer's output is
    kept split, so the input a layer keeps for its backward pass (all a checkpointed
    layer keeps) is 1/size of it on each device; XLA partitions the layer around it. The
    loop's buffers, the stage-to-stage sends and the layers' kept inputs are then 1/size
    of the local batch's activation. Ignored where the mesh lacks the axis or no dim
    divides.

    `micro_index`: the layer takes the micro-batch's index after the consts, which a
    layer drawing random numbers folds into its key to draw its own for each.

    `row_consts`: the last that many consts have the batch's rows leading (positions,
    segment ids, a mask the layers read): cut into micro-batches and split over the data
    axes as `x` is, each layer reading its micro-batch's rows."""
    m, r = micro_batches, repeats
    if m < 1 or r < 1:
        raise ValueError(f"micro_batches={m} and repeats={r} must be at least 1")
    if mesh is not None:
        _check_schedule(mesh, m, r)
    batch_spec = P(None, data_axis) if data_axis else P()
    # the axes the loop runs by hand; the rest of the mesh is XLA's to partition
    manual = frozenset({STAGE, *data_axes(data_axis)})

    def f(params: Any, x: jax.Array, *consts: Any) -> jax.Array:
        here = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
        if here is None or not here.axis_names:
            raise ValueError("pipelined() needs a mesh: pass one, or trace inside "
                             "`with jax.set_mesh(mesh):`")
        p = _check_schedule(here, m, r)
        c, a = _slots(params, layers, p, r)
        skip = bubble_idles(stage_remat, r)
        split = None
        if carry_axis in here.axis_names and carry_axis not in manual:
            dim = carry_split_dim(x.shape[1:], here.shape[carry_axis])
            split = None if dim is None else (dim, carry_axis)
        stage_step = _stage_step(layer, r, manual, param_specs, stage_remat, a < p * r, skip,
                                 split)
        params, specs = staged_in_specs(params, param_specs, mesh, here, manual)
        n = len(consts) - row_consts
        staged = jax.shard_map(_per_stage(stage_step, m, r, p, c, a, split, skip,
                                          micro_index, row_consts), mesh=mesh,
                               in_specs=(specs, batch_spec, *(P() for _ in consts[:n]),
                                         *(batch_spec for _ in consts[n:])),
                               out_specs=batch_spec, check_vma=False,
                               axis_names=set(manual & set(here.axis_names)))
        return micro_join(staged(params, micro_split(x, m), *consts[:n],
                                 *(micro_split(v, m) for v in consts[n:])))

    return f


def _slots(params: Any, layers: int | None, p: int, r: int) -> tuple[int, int]:
    """`chunking` of the staged stack: (slots per chunk, chunks full of layers)."""
    leaves = jax.tree.leaves(params)
    total = leaves[0].shape[0] if leaves else p * r
    if any(x.shape[0] != total for x in leaves):
        raise ValueError(f"the staged parameters' layer dims differ: "
                         f"{sorted({x.shape[0] for x in leaves})}")
    if total % (p * r):
        raise ValueError(f"{total} staged layer slots do not split into {p} stages x "
                         f"{r} repeats: lay the stack out with to_stages")
    c, a = chunking(layers if layers is not None else total, p, r)
    if c * p * r != total:
        raise ValueError(f"layers={layers} over {p} stages x {r} repeats takes {c * p * r} "
                         f"slots (to_stages), but the staged parameters have {total}")
    return c, a


def _kept_split(v: jax.Array, lead: int, split: tuple[int, str] | None) -> jax.Array:
    """`v`, with `lead` dims before its row, kept split as `split` (a row dim, a mesh
    axis left to XLA) asks; as it is for None."""
    if split is None:
        return v
    spec: list[str | None] = [None] * v.ndim
    spec[lead + split[0]] = split[1]
    return lax.with_sharding_constraint(v, P(*spec))


def _stage_step(layer: Callable[..., jax.Array], r: int, manual: frozenset[str],
                param_specs: Any, stage_remat: bool = False,
                uneven: bool = False, skip: bool = True,
                split: tuple[int, str] | None = None) -> Callable[..., jax.Array]:
    """`stage_step(chunks, q, h, busy, consts, count)`: round q's chunk of a stage's
    layers on `h` where `busy` (with `uneven`, its first `count` slots; the rest are
    empty and skipped), `h` as it is in the bubble (under `lax.cond`, so an idle device
    idles), checkpointed to keep everything but views (`keep_all_but_views`: the weights
    are sliced again in the backward pass rather than kept once per loop step), or with
    `stage_remat` nothing (its inputs alone: `h`, the round and whether it is busy; the
    stage's share is the loop's, not the step's). Each layer's weights are gathered whole
    over the loop's own axes (`manual`) just before it runs.

    `skip=False`: the layers run in the bubble too, on whatever activation the step holds
    there, and their result is dropped (`jnp.where`, so no gradient flows from it). The
    backward `lax.cond` hands out the chunk's weight gradient in a buffer of its own, one
    chunk of memory; without the cond the gradient goes straight into the loop's sum. On
    XLA:CPU (2 stages x 4 data devices, 8 micro-batches, 8 layers of 512 x 512) GPipe's
    compiled temporaries fell from 2.28 stage shares to 1.29, with or without stage
    remat; the circular schedule's did not move (its round's chunk is a dynamic slice of
    the share, whose gradient is a share-sized buffer either way). The price: the device
    computes in the bubble instead of idling.

    `split`: each layer's output kept split so (`pipelined`'s `carry_axis`: sequence
    parallelism between the chunk's layers). XLA:CPU's sharding propagation already
    carries the loop's split into the layers (2 stages x 2 data x 2 model: the same
    compiled temporaries without the constraint); the constraint pins it for compilers
    that would gather it earlier. A layer written under a checkpoint
    (`stage_policy.layer_policy`, found as the loop runs the step) keeps in the step what
    it keeps outside a stage: its input and what its policy saves inside it, not
    everything (`stage_policy.stage_policy`: jax evaluates a checkpoint nested in the
    step's with the step's policy)."""

    def gather_layer(w: Any) -> Any:
        """One layer's weights whole over the loop's own axes (`param_specs`' data
        axes); a dim over an axis left to XLA stays as it is."""
        if param_specs is None:
            return w

        def one(x: jax.Array, spec: tuple[str | None, ...]) -> jax.Array:
            for dim, axis in enumerate(spec):
                if axis in manual:
                    x = lax.all_gather(x, axis, axis=dim, tiled=True)
            return x
        return jax.tree.map(one, w, param_specs)

    def one_layer(w: Any, h: jax.Array, consts: tuple[Any, ...]) -> jax.Array:
        return layer(gather_layer(w), h, *consts)

    # a layer that gathers its weights, checkpointed to keep all but views: the chunk's
    # scan would otherwise keep each layer's gathered weights for its backward pass,
    # stacked (the whole chunk, gathered, in each loop step's backward pass: FSDP's
    # saving gone); so each layer gathers its weights again there, as FSDP does
    gathered_layer = jax.checkpoint(one_layer, policy=keep_all_but_views, prevent_cse=False)

    def gathers(chunk: Any) -> bool:
        if param_specs is None:
            return False
        specs = jax.tree.structure(chunk).flatten_up_to(param_specs)
        return any(axis in manual for spec in specs for axis in spec)

    def run_layers(chunk: Any, h: jax.Array, consts: tuple[Any, ...], count: jax.Array,
                   named: bool = False) -> jax.Array:
        layer_ = gathered_layer if gathers(chunk) else one_layer

        def one_layer_(w: Any, c: jax.Array, consts: tuple[Any, ...]) -> jax.Array:
            return layer_(w, checkpoint_name(c, LAYER_INPUT) if named else c, consts)
        if not uneven:
            return lax.scan(lambda c, w: (_kept_split(one_layer_(w, c, consts), 1, split),
                                          None), h, chunk)[0]
        slots = jax.tree.leaves(chunk)[0].shape[0]

        def slot(c: jax.Array, wj: tuple[Any, jax.Array]) -> tuple[jax.Array, None]:
            w, j = wj
            return _kept_split(lax.cond(j < count, one_layer_, idle, w, c, consts), 1,
                               split), None
        return lax.scan(slot, h, (chunk, jnp.arange(slots)))[0]

    def idle(chunk: Any, h: jax.Array, consts: tuple[Any, ...], *_: Any) -> jax.Array:
        return h

    def stage_step(chunks: Any, q: jax.Array, h: jax.Array, busy: jax.Array,
                   consts: tuple[Any, ...], count: jax.Array, named: bool) -> jax.Array:
        """Round q's chunk of this stage's layers on `h`, or nothing outside the work."""
        chunk = jax.tree.map(lambda c: c[0] if r == 1 else c[q], chunks)
        run = functools.partial(run_layers, named=named)
        if not skip:
            return jnp.where(busy, run(chunk, h, consts, count), h)
        return lax.cond(busy, run, idle, chunk, h, consts, count)

    def checkpointed(chunks: Any, q: jax.Array, h: jax.Array, busy: jax.Array,
                     consts: tuple[Any, ...], count: jax.Array) -> jax.Array:
        if stage_remat:
            policy, named = jax.checkpoint_policies.nothing_saveable, False
        else:
            # the checkpoint the layer is written under, found on one layer as the loop
            # runs it (inside the stage's shard_map: a layer cut from a traced program
            # binds on the stage's manual mesh only)
            inner = layer_policy(one_layer, [jax.tree.map(lambda c: c[0, 0], chunks), h,
                                             consts])
            policy, named = stage_policy(inner), inner is not None
        # inside the loop, CSE across steps cannot happen anyway: no barriers needed
        return jax.checkpoint(functools.partial(stage_step, named=named), policy=policy,
                              prevent_cse=False)(chunks, q, h, busy, consts, count)
    return checkpointed


def _per_stage(stage_step: Callable[..., jax.Array], m: int, r: int, p: int, c: int,
               a: int, split: tuple[int, str] | None = None, skip: bool = True,
               micro_index: bool = False, row_consts: int = 0) -> Callable[..., jax.Array]:
    """What each device of the stage axis runs under `shard_map`: the schedule's loop of
    m r + p - 1 steps over its share of the layers (`local`, [r k, ...]) and the
    micro-batches `xs` [m, ...]. Each step it takes its work item's input (stage 0: a new
    micro-batch, or one back for its next round; the others: what the stage before sent),
    runs `stage_step` on it (chunk q p + s: c layers among the first `a` chunks, else
    c - 1) and sends the result on round the ring; the last stage keeps the finished
    micro-batches, which every stage returns. `split` (a row dim, a mesh axis left to
    XLA): every activation the loop holds or sends is kept split so. Where the bubble is
    not skipped (`skip=False`), a stage's first input is the first micro-batch rather
    than zeros, so the layers it runs in the bubble see activations of a real row (a
    layer with a singular gradient at zero, a norm without an epsilon, would otherwise
    put 0 x NaN into the weights' gradient)."""

    def keep(v: jax.Array, lead: int) -> jax.Array:
        return _kept_split(v, lead, split)

    def per_stage(local: Any, xs: jax.Array, *consts: Any) -> jax.Array:
        s = lax.axis_index(STAGE)
        xs = keep(xs, 2)
        # this stage's chunks: [r, k, ...]
        chunks = jax.tree.map(lambda w: w.reshape(r, w.shape[0] // r, *w.shape[1:]),
                              local)
        steps = m * r + p - 1
        shift = [(i, (i + 1) % p) for i in range(p)]

        def body(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            recv, out, *buf = carry                     # GPipe has no round buffer
            w = i - s                                   # this stage's work item
            b, q = jnp.mod(w, m), jnp.clip(w // m, 0, r - 1)
            # stage 0: a new micro-batch, or one back for its next round
            first = jnp.where(q == 0, xs[b], buf[0][b]) if buf else xs[b]
            h_in = keep(jnp.where(s == 0, first, recv), 1)
            busy = (w >= 0) & (w < m * r)
            # the row consts' rows of this micro-batch; its index, where asked for
            cs = (*consts[:len(consts) - row_consts],
                  *(v[b] for v in consts[len(consts) - row_consts:]))
            h = keep(stage_step(chunks, q, h_in, busy, (*cs, b) if micro_index else cs,
                                c - (q * p + s >= a)), 1)
            done = (s == p - 1) & (q == r - 1) & busy
            out = keep(out.at[b].set(jnp.where(done, h, out[b])), 2)
            recv = keep(lax.ppermute(h, STAGE, shift), 1)
            if not buf:
                return recv, out
            # stage 0 keeps what the last stage finished for that micro-batch's next
            # round
            wl = i - (p - 1)
            back = (s == 0) & (wl >= 0) & (wl < m * (r - 1))
            bl = jnp.mod(wl, m)
            return recv, out, keep(buf[0].at[bl].set(jnp.where(back, recv, buf[0][bl])), 2)

        zeros = keep(jnp.zeros_like(xs), 2)
        # the loop's state differs from stage to stage: say so to shard_map's type check
        init = tuple(lax.pcast(z, (STAGE,), to="varying")
                     for z in (keep(jnp.zeros_like(xs[0]) if skip else xs[0], 1), zeros,
                               *((zeros,) if r > 1 else ())))
        out = lax.fori_loop(0, steps, body, init)[1]
        # the outputs live on the last stage: every stage returns them
        return lax.psum(jnp.where(s == p - 1, out, jnp.zeros_like(out)), STAGE)
    return per_stage


def _check_schedule(mesh: Any, m: int, r: int) -> int:
    """The stage count of `mesh`, checked against the schedule asked for."""
    if STAGE not in mesh.axis_names:
        raise ValueError(f"the mesh has no {STAGE!r} axis (its axes: {mesh.axis_names})")
    p = mesh.shape[STAGE]
    if r > 1 and m < p:
        raise ValueError(f"the circular schedule (repeats={r}) needs at least as many "
                         f"micro-batches as stages: micro_batches={m} < {p} stages")
    return p


__all__ = ["STAGE", "pipelined"]
