"""The call of a compiled step: its arguments placed on the plan's shardings, donated
ones on buffers of their own, the results rebuilt as the step returns them.

Every training step pays this call, so it is built to cost little once a step has run:
`StepCall` keeps what the last call found (the structure, shapes and dtypes of the
arguments, and which sharding of each argument was already right) and a later call whose
arguments are the same reads each leaf's aval and sharding once, compared by identity in
C, instead of deriving the plan's key and checking every leaf in Python again. On a full-
depth ResNet-50 (592 leaves) that per-leaf Python cost auto_shard 2.8 ms a step over
`jax.jit` on an H200's host (`benchmarks/results/step_call_nvidia-h200.md`).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .compile import CompiledStep
from .trace import SHAPE_DTYPE, ArgLayout, flat_arguments, is_process_local, signature


def place(leaf: Any, sharding: NamedSharding, aval: jax.ShapeDtypeStruct) -> Any:
    """Put one argument leaf on its sharding. With several processes, host data cannot be
    `device_put` onto devices of other processes: a process-local batch slice becomes its
    rows of the global array, and state (the same on every process) is sliced per device."""
    if jax.process_count() == 1 or not is_process_local(leaf):
        return jax.device_put(leaf, sharding)
    local = np.asarray(leaf)
    if local.shape != tuple(aval.shape):
        return _from_process_slices(local, sharding, tuple(aval.shape))
    return jax.make_array_from_callback(local.shape, sharding, lambda index: local[index])


def own_buffers(placed: list[Any], given: Sequence[Any], donated: Sequence[int],
                shs: Sequence[NamedSharding]) -> None:
    """Give every donated leaf of `placed` a buffer of its own, in place: XLA refuses to
    donate one buffer twice, or one that another argument also reads, and the same array
    passed at two leaves (an EMA started as `ema = params`, one zeros array reused at two
    paths) is that. A repeat (the same object given, or placed: `device_put` onto an
    array's own sharding returns it, and places two copies of one array over the same
    device's buffer) is copied; the first use is donated, as any donated argument is."""
    if not donated or (all(map(operator.is_, placed, given))
                       and len(set(map(id, placed))) == len(placed)):
        return     # every leaf passed as it was given, no two the same: nothing repeats
    seen: set[int] = set()
    donating = set(donated)
    for i, (x, y) in enumerate(zip(given, placed, strict=True)):
        if i not in donating:
            seen.update((id(x), id(y)))
    for i in donated:
        ids = (id(given[i]), id(placed[i]))
        if seen.isdisjoint(ids):
            seen.update(ids)
        else:
            placed[i] = jax.device_put(placed[i], shs[i], may_alias=False)


class StepCall:
    """The calls of one compiled step (`CompiledStep`, traced as `layout`) for arguments of
    one signature (`trace.signature`'s key): what `auto_shard`'s step runs on every call
    once it has its plan, and what the benchmarks time a step through.

    `leaves_of(args, kwargs)` gives a call's argument leaves, and `None` for its key where
    they are like the last call's (so this call serves them), else their `signature`.
    Calling it with the leaves places each on its sharding (`place`) unless it is already
    there, gives donated ones buffers of their own (`own_buffers`) and runs the step."""

    def __init__(self, compiled: CompiledStep, layout: ArgLayout, key: Any,
                 planned: Any = None) -> None:
        self.compiled, self.layout, self.planned = compiled, layout, planned
        self._treedef, self._names, self._entries = key
        n = len(self._entries)
        # per argument: the aval last seen there, and the sharding object last found right
        # for it (held, so an identity test means the same object); the types of argument
        # a call has run with, every one a jax array type
        self._avals: list[Any] = [None] * n
        self._right: list[Any] = [_UNSET] * n
        self._types: set[type] = set()
        self._donated = frozenset(compiled.donated)

    def leaves_of(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, list[Any]]:
        """(None, leaves) where the arguments have the structure, shapes and dtypes of this
        call's key and are all jax arrays of types it has run with (the key `signature`
        would give is this call's, unread), else `signature(args, kwargs)`."""
        flat = leaves, treedef, names = flat_arguments(args, kwargs)
        if treedef == self._treedef and names == self._names \
                and self._types.issuperset(map(type, leaves)):
            avals = list(map(_AVAL, leaves))
            changed = list(_differ(avals, self._avals))
            if all(SHAPE_DTYPE(avals[i]) == self._entries[i] for i in changed):
                for i in changed:
                    self._avals[i] = avals[i]
                return None, leaves
        return signature(args, kwargs, flat)

    def __call__(self, leaves: Sequence[Any]) -> Any:
        ex = self.compiled
        shs, placed = ex.in_shardings, list(leaves)
        sharding = list(map(getattr, leaves, _SHARDING_NAME, _NONE))
        for i in list(_differ(sharding, self._right)):
            if sharding[i] == shs[i]:      # the state a step returned
                self._right[i] = sharding[i]
            elif i not in self._donated and _laid_out_alike(leaves[i], shs[i]):
                self._right[i] = sharding[i]
            else:
                placed[i] = place(leaves[i], shs[i], self.layout.inputs.avals[i])
        own_buffers(placed, leaves, ex.donated, shs)
        out = jax.tree_util.tree_unflatten(self.layout.out_treedef, ex.compiled(*placed))
        if not self._types:      # the first call that ran: the jax array types it was given
            self._types.update(t for t in set(map(type, leaves)) if issubclass(t, jax.Array))
            self._avals = [getattr(x, "aval", None) for x in leaves]
        return out


def _laid_out_alike(leaf: Any, sharding: NamedSharding) -> bool:
    """Whether a jax array is laid out on its devices as `sharding` lays it out (a batch
    made on the one device of a one-device mesh: `SingleDeviceSharding` there), so the
    compiled step takes it as it is where `device_put` would copy it (0.1-0.4 ms a step
    for ResNet-50-small's batch on this project's CPU). Only for arguments the step does not
    donate: a donated one must be a buffer of the step's own (`own_buffers`)."""
    return isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


def _differ(xs: Sequence[Any], ys: Sequence[Any]) -> Iterator[int]:
    """The positions where xs and ys hold different objects (in C: no Python per item)."""
    return itertools.compress(itertools.count(), map(operator.is_not, xs, ys))


_AVAL = operator.attrgetter("aval")
_SHARDING_NAME, _NONE = itertools.repeat("sharding"), itertools.repeat(None)
_UNSET = object()     # no sharding found right yet (a numpy leaf's is None)


@functools.lru_cache(maxsize=256)
def _rows_held(sharding: NamedSharding, shape: tuple[int, ...]) -> int:
    """How many rows (leading-dim entries) of a `shape` array this process's devices hold
    under `sharding` (cached: every step places its batch)."""
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*(index[0] if index else slice(None)).indices(shape[0])))
    return len(rows)


def _from_process_slices(local: np.ndarray, sharding: NamedSharding,
                         shape: tuple[int, ...]) -> jax.Array:
    """The global array of a batch leaf that each process passes its own slice of (in
    process order), on `sharding`. Where the sharding gives each process as many rows as it
    passed (a data axis that spans the processes) those are its rows. Where it holds more
    on a process (a mesh whose data axis stays inside a process, e.g. tensor parallelism
    across the processes: the batch is replicated there), the slices first make an array
    split by process over the same devices, which then moves onto `sharding` (a collective
    in which every process receives the others' rows)."""
    if _rows_held(sharding, shape) == local.shape[0]:
        return jax.make_array_from_process_local_data(sharding, local, shape)
    devices = sorted(sharding.mesh.devices.flat, key=lambda d: (d.process_index, d.id))
    processes = len({d.process_index for d in devices})
    if len(devices) % processes:
        raise ValueError(f"a batch slice per process needs as many devices in each of the "
                         f"{processes} processes of the mesh; it has {len(devices)} devices")
    by_process = Mesh(np.array(devices).reshape(processes, -1), ("process", "local"))
    split = jax.make_array_from_process_local_data(
        NamedSharding(by_process, PartitionSpec("process")), local, shape)
    return _reshard(sharding)(split)


@functools.lru_cache(maxsize=64)
def _reshard(sharding: NamedSharding) -> Callable[[jax.Array], jax.Array]:
    """A compiled identity that moves an array onto `sharding` (cached per sharding)."""
    return jax.jit(lambda x: x, out_shardings=sharding)


__all__ = ["StepCall", "own_buffers", "place"]
