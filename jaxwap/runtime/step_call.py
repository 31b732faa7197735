"""The call of a compiled step: its arguments placed on the plan's shardings, donated
ones on buffers of their own, the results rebuilt as the step returns them.

Every training step pays this call, so once a step has run it costs what `jax.jit`'s own
call costs: the compiled program is called directly and jax's C++ dispatch flattens the
user's pytrees, checks each leaf's aval and sharding, places host or uncommitted data
itself and builds the results. On one device it is given the pytrees as they are
(`_on_pytrees`). On a mesh, jax takes a deleted (donated) array, or one array at two
donated leaves, as it takes any other and XLA then crashes the process inside the call
(jax 0.10.2: "Buffer has been deleted or donated", exit 139), where on one device it
refuses them before anything runs; so there the leaves are flattened once and checked
first, in C (each one's `is_deleted`, a set of their ids), and the flat program called.

jaxwap's Python runs only where jax would refuse or place wrongly: a deleted array
(refused by path, `ValueError`), a committed array off the plan's sharding (jax refuses
it, nothing having run; it is placed here and the call made again), process-local host
data in a multi-process run (`place`), the same array at a donated leaf and another one
(`own_buffers`), and arguments of other shapes (`OtherArguments`: the step plans again).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxwap.analysis.trace import SHAPE_DTYPE, ArgLayout, is_process_local, leaf_entries, signature
from jaxwap.runtime.compile import CompiledStep


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


class Arguments(NamedTuple):
    """A call's arguments as the user passed them: positional, and keyword."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class OtherArguments(Exception):  # noqa: N818 (a signal to the caller, not a failure)
    """Raised by a `StepCall` for arguments of another structure, shapes or dtypes than the
    ones it was compiled for; `key` is their `trace.signature` key, which the caller plans
    (or finds a compiled step) for. Nothing has run and no argument was touched."""

    def __init__(self, key: Any) -> None:
        super().__init__("arguments of another signature")
        self.key = key


class StepCall:
    """The calls of one compiled step (`CompiledStep`, traced as `layout`) for arguments of
    one signature (`trace.signature`'s key): what `auto_shard`'s step runs on every call
    once it has its plan, and what the benchmarks time a step through.

    `call(Arguments(args, kwargs))` runs the step and returns its outputs in the step's
    own pytrees, or raises `OtherArguments` for arguments that are not of this call's
    signature. A call whose leaves jax's dispatch can take as they are (the state the last
    step returned, a fresh batch as jax or numpy arrays) goes straight to the compiled
    program; the first call, and any call jax refuses, is placed here first (`place`,
    `own_buffers`). `fallbacks` counts the calls placed here.

    With donation, the first call consumes the state it is given on every plan: a jax
    array at a donated leaf (`compile.donated_leaves`: a parameter, its optimizer state,
    batch statistics, what else the step hands back) that the plan takes as it
    is (on its sharding already) is donated, one that has to be copied onto the mesh is
    deleted once the step has run, so a model's initial state never stays in memory
    beside the plan's copy (a large model would not fit twice). Host (numpy) data is never
    touched. The calls after are given the state the step returned, which is on the
    plan's shardings: donated, as `jax.jit` donates."""

    def __init__(self, compiled: CompiledStep, layout: ArgLayout, key: Any,
                 planned: Any = None) -> None:
        self.compiled, self.layout, self.planned, self.key = compiled, layout, planned, key
        self._entries = key[2]
        self._program = compiled.compiled      # jax's compiled program, on flat leaves
        self._in_tree = _call_treedef(layout)  # (args, kwargs) as a call flattens them
        self._out_tree = layout.out_treedef
        self._donated = tuple(compiled.donated)
        self._multiprocess = jax.process_count() > 1
        # one device: XLA refuses a donated or repeated buffer before it runs anything, so
        # jax's dispatch may see the user's pytrees unread (`_on_pytrees`); on several it
        # crashes instead, and the leaves are checked here first
        self._tree = _on_pytrees(compiled.compiled, layout) \
            if compiled.mesh.devices.size == 1 else None
        # whether the next call goes to the compiled program directly: not the first (the
        # user's initial state is consumed as the class says), nor, with several
        # processes, one after a call that placed process-local data (a batch slice:
        # every step has one, and jax would refuse each first)
        self._direct = False
        self.fallbacks = 0

    def leaves_of(self, args: Sequence[Any], kwargs: dict[str, Any]
                  ) -> tuple[None, Arguments]:
        """(None, the call's `Arguments`): what to call this with; whether they are of
        its signature, the call finds out (kept for callers that ask first)."""
        return None, Arguments(tuple(args), kwargs)

    def __call__(self, given: Arguments) -> Any:
        args, kwargs = given
        if self._direct and self._tree is not None:
            try:       # jax flattens, checks and places; nothing runs if it refuses
                return self._tree(*args, **kwargs)
            except Exception as error:
                return self._recover(given, error)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        self._same_structure(given, treedef)
        if self._direct and not _any_deleted(leaves) \
                and (not self._donated or len(set(map(id, leaves))) == len(leaves)):
            try:
                outs = self._program(*leaves)
            except Exception as error:   # jax refused them, or the step failed
                return self._recover(given, error, leaves)
            return jax.tree_util.tree_unflatten(self._out_tree, outs)
        return self._placed_call(given, leaves)

    # ------------------------------------------------------------------ jaxwap's own path
    def _placed_call(self, given: Arguments, leaves: list[Any]) -> Any:
        """The call placed here: deleted arrays refused by path, arguments of another
        signature handed back, leaves jax would refuse placed, repeats copied."""
        self._refuse_deleted(given, leaves)
        if not self._like_key(leaves):
            self._refuse_other(given)
        placed, moved = self._placed(leaves)
        self._direct = not (moved and self._multiprocess)
        return self._run_placed(placed, leaves)

    def _recover(self, given: Arguments, error: Exception,
                 leaves: list[Any] | None = None) -> Any:
        """After jax refused a call (nothing ran): hand back arguments of another
        signature, say which array was deleted, or place what jax refused (or give a
        repeated array a copy) and call again. Where none of these is the cause, the
        error is the step's own and is raised as it was."""
        if leaves is None:
            leaves, treedef = jax.tree_util.tree_flatten(tuple(given))
            self._same_structure(given, treedef)
        self._refuse_deleted(given, leaves, error)
        if not self._like_key(leaves):
            self._refuse_other(given)
        placed, moved = self._placed(leaves)
        repeats = bool(self._donated) and len(set(map(id, leaves))) != len(leaves)
        if not (moved or repeats):
            raise error
        self._direct = not (moved and self._multiprocess)
        return self._run_placed(placed, leaves)

    def _run_placed(self, placed: list[Any], leaves: list[Any]) -> Any:
        ex = self.compiled
        own_buffers(placed, leaves, self._donated, ex.in_shardings)
        outs = self._program(*placed)
        self.fallbacks += 1
        for i in self._donated:      # the state given is consumed (the class docstring)
            x = leaves[i]
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        return jax.tree_util.tree_unflatten(self._out_tree, outs)

    def _placed(self, leaves: list[Any]) -> tuple[list[Any], bool]:
        """The leaves with each one jax's dispatch would refuse placed on its sharding (a
        committed array elsewhere; with several processes, process-local data), and
        whether any was. Host and uncommitted data jax places itself."""
        shs, avals = self.compiled.in_shardings, self.layout.inputs.avals
        placed, moved = list(leaves), False
        for i, x in enumerate(leaves):
            array = isinstance(x, jax.Array)
            if array and (x.sharding == shs[i] or _laid_out_alike(x, shs[i])):
                continue                   # taken as it is
            if not self._multiprocess and not (array and x.committed):
                continue                   # host or uncommitted data: jax places it
            placed[i], moved = place(x, shs[i], avals[i]), True
        return placed, moved

    # ------------------------------------------------------------------ refusals
    def _same_structure(self, given: Arguments, treedef: Any) -> None:
        """Raise `OtherArguments` for arguments of another structure than this call's
        (a first call whose structure `_call_treedef` could not rebuild reads the key)."""
        if treedef != self._in_tree:
            self._refuse_other(given)
            self._in_tree = treedef

    def _like_key(self, leaves: list[Any]) -> bool:
        """Whether the leaves have this call's shapes and dtypes (read in C where they are
        arrays; `signature` decides for anything else)."""
        try:
            return tuple(map(SHAPE_DTYPE, leaves)) == self._entries
        except AttributeError:    # a Python scalar leaf
            return False

    def _refuse_other(self, given: Arguments) -> None:
        """Raise `OtherArguments` for arguments whose signature is not this call's."""
        key = signature(given.args, given.kwargs)[0]
        if key != self.key:
            raise OtherArguments(key)

    def _refuse_deleted(self, given: Arguments, leaves: list[Any],
                        cause: BaseException | None = None) -> None:
        """A `ValueError` naming every argument leaf that is a deleted array: jax would
        crash on it (a sharded program) or fail inside XLA, naming none."""
        dead = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.is_deleted()]
        if not dead:
            return
        entries = leaf_entries(given.args, given.kwargs)[0]
        paths = [f"{entries[i][0]}{jax.tree_util.keystr(tuple(entries[i][1]))}" for i in dead]
        more = f" (and {len(paths) - 3} more)" if len(paths) > 3 else ""
        plural = "s" if len(paths) > 1 else ""
        raise ValueError(
            f"{', '.join(paths[:3])}{more}: deleted or donated array{plural} passed to the "
            f"step. The step donates the state it is given (donate=True): "
            f"the arrays passed in are gone once it has run, so pass the state returned by "
            f"the last step (params, opt_state, ... = step(params, opt_state, batch)), not "
            f"an earlier one; to keep a copy, copy it first (jax.tree.map(jnp.copy, tree)) "
            f"or use donate=False") from cause


def _call_treedef(layout: ArgLayout) -> Any:
    """The structure of `(args, kwargs)` as a call of the step flattens them (keyword
    arguments in a dict, so by sorted name: the order of the layout's leaves). None where
    a node cannot be rebuilt around placeholder leaves: the first call then reads it."""
    marks = [object() for _ in range(layout.args_treedef.num_leaves)]
    try:
        a, k = jax.tree_util.tree_unflatten(layout.args_treedef, marks)
        return jax.tree_util.tree_structure((tuple(a),
                                             dict(zip(layout.kw_names, k, strict=True))))
    except Exception:    # a custom node whose unflatten reads its leaves
        return None


def _on_pytrees(program: Any, layout: ArgLayout) -> Callable[..., Any] | None:
    """The compiled flat program as one called with the step's own arguments and giving
    its own results: jax's `Compiled` rebuilt around the same executable with the
    step's argument and result structures (jax has no public way to say them), so its
    C++ dispatch flattens the user's pytrees, checks each leaf and places host and
    uncommitted data itself, as it does for `jax.jit` of the step, and builds the results.
    Each argument leaf keeps the flat program's donation. None where this jax's
    `Compiled` is not built so (the flat program is called on flattened leaves then)."""
    try:
        from jax._src import stages

        infos = jax.tree_util.tree_leaves(program.args_info)
        a, k = jax.tree_util.tree_unflatten(layout.args_treedef, infos)
        args_info = (tuple(a), dict(zip(layout.kw_names, k, strict=True)))
        params = program._params
        tree = stages.Compiled(program._executable, params.const_args, args_info,
                               layout.out_treedef, params.no_kwargs)
        if tree.in_tree.num_leaves != len(infos):
            return None
        return tree
    except Exception:    # another jax's internals
        return None


@functools.cache
def _is_deleted() -> Callable[[Any], bool]:
    """`is_deleted` of jax's array type, unbound: called in C over a list of leaves (it
    raises TypeError on a leaf of another type)."""
    return type(jax.numpy.zeros(())).is_deleted


def _any_deleted(leaves: list[Any]) -> bool:
    """Whether a leaf is a deleted jax array (in C over the leaves: about 30 ns a leaf)."""
    test = _is_deleted()
    try:
        return any(map(test, leaves))
    except TypeError:      # a leaf that is not a jax array: numpy, a Python number
        arrays = itertools.compress(leaves, map(isinstance, leaves,
                                                itertools.repeat(jax.Array)))
        return any(x.is_deleted() for x in arrays)


def _laid_out_alike(leaf: Any, sharding: NamedSharding) -> bool:
    """Whether a jax array is laid out on its devices as `sharding` lays it out (a batch
    made on the one device of a one-device mesh: `SingleDeviceSharding` there), so the
    compiled step takes it as it is where `device_put` would copy it. A donated one is
    donated in place: either way the array given is consumed (`StepCall`)."""
    return isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


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


__all__ = ["Arguments", "OtherArguments", "StepCall", "own_buffers", "place"]
