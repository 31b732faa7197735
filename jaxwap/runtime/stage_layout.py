"""How a layer stack and a batch are laid out for a pipeline's stages (`schedule.pipelined`).

A stack whose layers do not divide into p x r chunks is split as evenly as it goes (126
layers over 16 stages: 14 stages of 8 and 2 of 7): every chunk gets c = ceil(L / (p r))
slots, the first L - p r (c - 1) chunks c layers and the rest c - 1 and an empty slot
(`to_stages` pads the stack with a zero layer there), and a stage skips its empty slot
under `lax.cond`. A loop step waits for its slowest stage anyway, so the step takes c
layers' time per loop step whichever chunks hold fewer; the layers outside the stack
(embedding, head, loss) run on every stage, split over its rows, so no stage has other
work to weigh against its layers.

Micro-batch i holds rows i, i+m, i+2m, ... of the batch (`micro_split`), so a batch
sharded over the data axis in contiguous blocks splits without moving data.

The loop keeps the activations it holds split over the model axis along the first row
dim that divides (`carry_split_dim`), where the mesh has one. The staged parameters enter
the loop split over the stage axis, and beyond it as the plan lays out a stage's share
(`staged_in_specs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxwap.core.records import STAGE


def data_axes(data_axis: str | Sequence[str] | None) -> tuple[str, ...]:
    """A pipeline's data axes as names: what it splits each micro-batch over (a name, a
    tuple of names, or None for none), and, with the stage axis, what its loop runs by
    hand."""
    if data_axis is None:
        return ()
    return (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)


def chunking(num_layers: int, stages: int, repeats: int = 1) -> tuple[int, int]:
    """(c, a): the slots of each of the p x r chunks, and how many of the chunks (the
    first, in layer order) fill all c with layers; the others hold c - 1 and an empty
    slot. a = p r where the layers divide evenly."""
    chunks = stages * repeats
    if num_layers < chunks:
        raise ValueError(f"{num_layers} layers cannot be split into {stages} stages x "
                         f"{repeats} repeats of at least one layer each")
    c = -(-num_layers // chunks)
    return c, num_layers - chunks * (c - 1)


def stage_order(num_layers: int, stages: int, repeats: int = 1) -> list[int]:
    """The layer order along the stage-sharded dim (what `to_stages` makes of the stack):
    stage s's share (its contiguous block once split over `stages`) holds its chunks
    round by round, chunk q p + s in round q; -1 marks an empty slot (`chunking`)."""
    c, a = chunking(num_layers, stages, repeats)
    starts = [min(i, a) * c + max(0, i - a) * (c - 1) for i in range(stages * repeats)]
    return [starts[q * stages + s] + j if j < c - (q * stages + s >= a) else -1
            for s in range(stages) for q in range(repeats) for j in range(c)]


def to_stages(stacked: Any, stages: int, repeats: int = 1) -> Any:
    """Stacked parameters [L, ...] laid out so that splitting their leading dim over
    the stage axis gives each stage its chunks (`stage_order`): padded with a zero layer
    at the end of each chunk one short (`chunking`; none where the layers divide), and
    reordered round by round for the circular schedule.

    Written as reshapes, a pad and a transpose, not as a gather by `stage_order`: on a
    stacked dim sharded over the stage axis XLA makes the transpose one all-to-all of
    the layers that change stage, where the gather became a collective-permute of the
    whole share plus an all-reduce of it (and, on 4 stages, a temporary of the whole
    stack on every device)."""
    chunks = stages * repeats

    def one(x: jax.Array) -> jax.Array:
        c, a = chunking(x.shape[0], stages, repeats)
        rest = x.shape[1:]
        if a < chunks:
            short = x[a * c:].reshape(chunks - a, c - 1, *rest)
            short = jnp.pad(short, [(0, 0), (0, 1)] + [(0, 0)] * len(rest))
            x = jnp.concatenate([x[:a * c].reshape(a, c, *rest), short]).reshape(
                chunks * c, *rest)
        if repeats == 1:
            return x
        per = x.reshape(repeats, stages, c, *rest)
        return jnp.swapaxes(per, 0, 1).reshape(chunks * c, *rest)
    return jax.tree.map(one, stacked)


def micro_split(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [m, B/m, ...], micro-batch i holding rows i, i+m, ...: a batch sharded
    in contiguous blocks over the data axis splits without moving data."""
    if x.shape[0] % m:
        raise ValueError(f"batch {x.shape[0]} is not divisible by micro_batches={m}")
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def micro_join(xs: jax.Array) -> jax.Array:
    """The inverse of `micro_split`."""
    return jnp.swapaxes(xs, 0, 1).reshape(xs.shape[0] * xs.shape[1], *xs.shape[2:])


def carry_split_dim(row: Sequence[int], ways: int) -> int | None:
    """The dim of a carried activation's row (its dims after the batch) that a pipeline's
    loop keeps split `ways` ways (`pipelined`'s `carry_axis`): the first that divides;
    None where none does, or `ways` is 1."""
    if ways <= 1:
        return None
    return next((i for i, n in enumerate(row) if n % ways == 0), None)


def staged_in_specs(params: Any, param_specs: Any, mesh: Mesh | None, here: Any,
                    manual: frozenset[str]) -> tuple[Any, Any]:
    """The staged parameters and their `shard_map` in-specs: split over the stage axis
    along the layer dim; with `param_specs`, the layout asked for is pinned where the loop
    takes the weights in, and the in-specs name the loop's own axes only, the rest
    reaching it as they are (XLA's to partition)."""
    if param_specs is None:
        return params, P(STAGE)
    _check_specs(params, param_specs, here)
    params = jax.tree.map(
        lambda x, spec: lax.with_sharding_constraint(x, _named(mesh, P(STAGE, *spec))),
        params, param_specs)
    specs = jax.tree.map(
        lambda _, spec: P(STAGE, *(a if a in manual else None for a in spec)),
        params, param_specs)
    return params, specs


def _named(mesh: Mesh | None, spec: P) -> Any:
    """`spec` on `mesh`, or on the context's mesh (a bare spec) when None."""
    return spec if mesh is None else jax.sharding.NamedSharding(mesh, spec)


def _check_specs(params: Any, param_specs: Any, mesh: Any) -> None:
    """Each stacked parameter's `param_specs` entry names axes of `mesh` that divide it."""
    leaves, treedef = jax.tree.flatten(params)
    specs = treedef.flatten_up_to(param_specs)
    for i, (x, spec) in enumerate(zip(leaves, specs, strict=True)):
        if len(spec) != x.ndim - 1:
            raise ValueError(f"stacked parameter {i} with shape {x.shape}: its stage spec "
                             f"{spec} must name {x.ndim - 1} dims (all but the layer dim)")
        for dim, axis in enumerate(spec, start=1):
            if axis is None:
                continue
            if axis not in mesh.axis_names or axis == STAGE:
                raise ValueError(f"stacked parameter {i}: stage spec {spec} names axis "
                                 f"{axis!r}, not a non-stage axis of the mesh "
                                 f"{mesh.axis_names}")
            if x.shape[dim] % mesh.shape[axis]:
                raise ValueError(f"stacked parameter {i} with shape {x.shape}: dim {dim} "
                                 f"does not divide over {axis!r} of size "
                                 f"{mesh.shape[axis]}")


__all__ = ["carry_split_dim", "chunking", "data_axes", "micro_join", "micro_split", "stage_order",
           "staged_in_specs", "to_stages"]
