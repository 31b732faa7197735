"""The host's Python work on a step's pytrees, each call: counted, and priced per call.

Every call of an `auto_shard` step reads its arguments' structure (`trace.signature`:
one flatten of them) and builds its results' (`out_treedef.unflatten`). Plain containers
(dicts, lists, tuples) are flattened in C++; a custom pytree node runs Python for each
node each way, and Flax NNX's states and variables run a good deal of it: on this
project's 2-core CPU GPT-2-small's 87 leaves make 1,226 calls, 0.23 ms a call of a step
of about 4.5 ms (ResNet-50-small's 108 leaves in plain dicts: 227 calls, 0.05 ms). The
per-array dispatch jax does in C++ is `DeviceSpec.call_cost`'s; this is the rest.

The work is counted, not timed, when planning: the Python function calls (and the C
functions they call) that a call's pytree work makes, on placeholder leaves
(`tree_calls`), is a fact of the step's pytrees that a plan can be re-made from, where a
timing would differ on every planning. The calibration prices one call
(`python_call_seconds`: a reference structure's time over its count, 170-260 ns here
across runs; the zoo's own calls took 190-240 ns in a run where it read 200;
`DeviceSpec.python_call_s`), and a step's call costs its count times that.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxwap.analysis.trace import ArgLayout, signature
from jaxwap.calibration.timing import time_it


def _counted(work: Callable[[], Any]) -> int:
    """How many Python and C function calls `work()` makes (after one call of it, so
    that caches it fills are filled), counted in a thread of its own: a profile function
    is per thread, so whatever profiler the caller's thread runs (cProfile's, which
    `sys.setprofile` could not put back: its hook is C's) is left as it was."""
    count = 0
    failed: list[BaseException] = []

    def counter(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    def counted() -> None:
        try:
            work()
            sys.setprofile(counter)
            try:
                work()
            finally:
                sys.setprofile(None)
        except BaseException as e:     # raised in the caller's thread below
            failed.append(e)
    thread = threading.Thread(target=counted, name="jaxwap-tree-calls")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return count


def _call_work(args: Any, kwargs: dict[str, Any], out_treedef: Any) -> Callable[[], Any]:
    """A call's pytree work: its arguments read as `signature` reads them and its results
    built (`out_treedef`), with one jax scalar at every result leaf."""
    results = [jnp.zeros((), jnp.float32)] * out_treedef.num_leaves

    def work() -> None:
        signature(args, kwargs)
        out_treedef.unflatten(results)
    return work


def tree_calls(layout: ArgLayout) -> int:
    """Python function calls a call of the step makes on its pytrees (`_call_work`), with
    one jax scalar at every leaf (a real call's leaves are jax arrays, which `signature`
    reads directly)."""
    leaf = jnp.zeros((), jnp.float32)
    args, kw = layout.args_treedef.unflatten([leaf] * layout.args_treedef.num_leaves)
    return _counted(_call_work(args, dict(zip(layout.kw_names, kw, strict=True)),
                               layout.out_treedef))


@jax.tree_util.register_pytree_node_class
class _Node:
    """A custom pytree node as libraries write a module's state: its children by name,
    flattened in sorted order and rebuilt by its class on unflatten."""

    def __init__(self, children: dict[str, Any], name: str) -> None:
        self.children, self.name = children, name

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[str, tuple[str, ...]]]:
        keys = tuple(sorted(self.children))
        return tuple(self.children[k] for k in keys), (self.name, keys)

    @classmethod
    def tree_unflatten(cls, aux: tuple[str, tuple[str, ...]], children: Any) -> _Node:
        name, keys = aux
        return cls(dict(zip(keys, children, strict=True)), name)


@jax.tree_util.register_pytree_node_class
class _Variable:
    """A custom pytree node as libraries write a variable: one value and its metadata,
    which unflatten checks and copies."""

    def __init__(self, value: Any, **metadata: Any) -> None:
        self.value, self.metadata = value, dict(metadata)

    def tree_flatten(self) -> tuple[tuple[Any], tuple[tuple[str, Any], ...]]:
        return (self.value,), tuple(sorted(self.metadata.items()))

    @classmethod
    def tree_unflatten(cls, aux: tuple[tuple[str, Any], ...], children: Any) -> _Variable:
        if not isinstance(aux, tuple):
            raise TypeError(f"bad metadata {aux!r}")
        return cls(children[0], **dict(aux))


def python_call_seconds(nodes: int = 64, repeats: int = 51) -> float:
    """Seconds per counted call of a call's pytree work on this host: a reference step's
    (`nodes` custom module nodes of two variable nodes each, in a dict, as arguments and
    as results) median time over its count."""
    leaf = jnp.zeros((), jnp.float32)
    tree = {f"n{i}": _Node({"w": _Variable(leaf, kind="param"),
                            "b": _Variable(leaf, kind="param")}, f"n{i}")
            for i in range(nodes)}
    work = _call_work((tree,), {}, jax.tree_util.tree_structure(tree))
    return time_it(work, repeats) / _counted(work)


__all__ = ["python_call_seconds", "tree_calls"]
