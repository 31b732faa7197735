"""Pipeline stages: a stack of identical layers split over a "stage" mesh axis.

`pipelined(layer, mesh, ...)` turns `layer(params_l, h) -> h`, applied to every slice of
stacked parameters in turn (what `lax.scan` over a layer stack computes), into the same
function run as a pipeline: each device of the stage axis holds a contiguous share of the
layers, micro-batches flow from stage to stage with `ppermute`, and the backward pass is
the forward loop differentiated (GPipe: every micro-batch forward, then backward).

With `repeats` r > 1 the schedule is circular (interleaved): the layers are cut into
p x r chunks, stage s holding chunks s, p + s, 2p + s, ..., and each micro-batch passes
round the ring of stages r times, which shrinks the bubble to (p - 1) / (m r + p - 1) of
the loop at the price of r times the sends. A micro-batch back at stage 0 for its next
round waits in a buffer until its turn, so the circular schedule needs at least as many
micro-batches as stages.

This module is the execution half of pipelining (issue 12); the planner does not choose
it yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

STAGE = "stage"


def stage_order(num_layers: int, stages: int, repeats: int = 1) -> list[int]:
    """The layer order along the stage-sharded dim: stage s's share (its contiguous block
    of the stacked dim once split over `stages`) holds its chunks round by round."""
    _check(num_layers, stages, repeats)
    k = num_layers // (stages * repeats)
    return [(q * stages + s) * k + j for s in range(stages) for q in range(repeats)
            for j in range(k)]


def to_stages(stacked: Any, stages: int, repeats: int = 1) -> Any:
    """Stacked parameters [L, ...] reordered so that splitting their leading dim over
    the stage axis gives each stage its chunks (`stage_order`); the identity for GPipe."""
    def one(x: jax.Array) -> jax.Array:
        return x if repeats == 1 else x[jnp.asarray(stage_order(x.shape[0], stages, repeats))]
    return jax.tree.map(one, stacked)


def pipelined(layer: Callable[[Any, jax.Array], jax.Array], mesh: Mesh, *,
              micro_batches: int, repeats: int = 1, data_axis: str | None = None
              ) -> Callable[[Any, jax.Array], jax.Array]:
    """`f(staged_params, x)`: `x` [B, ...] through every layer of the stack, pipelined
    over the mesh's "stage" axis. `staged_params` are the stacked parameters [L, ...]
    reordered by `to_stages` (and sharded over the stage axis along their leading dim);
    the batch is cut into `micro_batches` along its leading dim, each split over
    `data_axis` when given."""
    p = mesh.shape[STAGE]
    m, r = micro_batches, repeats
    if m < 1 or r < 1:
        raise ValueError(f"micro_batches={m} and repeats={r} must be at least 1")
    if r > 1 and m < p:
        raise ValueError(f"the circular schedule (repeats={r}) needs at least as many "
                         f"micro-batches as stages: micro_batches={m} < {p} stages")
    batch_spec = P(None, data_axis) if data_axis else P()

    def run_layers(chunk: Any, h: jax.Array) -> jax.Array:
        return lax.scan(lambda c, w: (layer(w, c), None), h, chunk)[0]

    def per_stage(local: Any, xs: jax.Array) -> jax.Array:
        s = lax.axis_index(STAGE)
        # this stage's chunks: [r, k, ...]
        chunks = jax.tree.map(lambda w: w.reshape(r, w.shape[0] // r, *w.shape[1:]), local)
        steps = m * r + p - 1
        shift = [(i, (i + 1) % p) for i in range(p)]

        def body(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            recv, buf, out = carry
            w = i - s                                   # this stage's work item
            b, q = jnp.mod(w, m), jnp.clip(w // m, 0, r - 1)
            first = jnp.where(q == 0, xs[b], buf[b])    # stage 0: a new round's input
            h = run_layers(jax.tree.map(lambda c: c[q], chunks),
                           jnp.where(s == 0, first, recv))
            done = (s == p - 1) & (q == r - 1) & (w >= 0) & (w < m * r)
            out = out.at[b].set(jnp.where(done, h, out[b]))
            recv = lax.ppermute(h, STAGE, shift)
            # stage 0 keeps what the last stage finished for that micro-batch's next round
            wl = i - (p - 1)
            keep = (s == 0) & (wl >= 0) & (wl < m * (r - 1))
            bl = jnp.mod(wl, m)
            buf = buf.at[bl].set(jnp.where(keep, recv, buf[bl]))
            return recv, buf, out

        zeros = jnp.zeros_like(xs)
        # the loop's state differs from stage to stage: say so to shard_map's type check
        init = tuple(lax.pcast(z, (STAGE,), to="varying")
                     for z in (jnp.zeros_like(xs[0]), zeros, zeros))
        _, _, out = lax.fori_loop(0, steps, body, init)
        # the outputs live on the last stage: every stage returns them
        return lax.psum(jnp.where(s == p - 1, out, jnp.zeros_like(out)), STAGE)

    staged = jax.shard_map(per_stage, mesh=mesh, in_specs=(P(STAGE), batch_spec),
                           out_specs=batch_spec)

    def f(params: Any, x: jax.Array) -> jax.Array:
        if x.shape[0] % m:
            raise ValueError(f"batch {x.shape[0]} is not divisible by micro_batches={m}")
        xs = x.reshape(m, x.shape[0] // m, *x.shape[1:])
        return staged(params, xs).reshape(x.shape)

    return f


def _check(num_layers: int, stages: int, repeats: int) -> None:
    if num_layers % (stages * repeats):
        raise ValueError(f"{num_layers} layers cannot be split into {stages} stages x "
                         f"{repeats} repeats of equal chunks")


__all__ = ["STAGE", "pipelined", "stage_order", "to_stages"]
