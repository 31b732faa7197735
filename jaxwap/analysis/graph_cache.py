"""The traces and analyses of the steps a plan weighs, kept for the last few.

Planning a step again (under another memory budget or objective; the published layout
priced beside the plan found) would analyse it all again: the step as written, each
variant jaxwap restructures it into (`make_train_step`'s, a pipeline stage's: a new
function each time it is built, so jax's trace cache never serves them), the
fused-attention counterfactual, and the loss traces the rewrites start from. `kept` keys
each on what determines it: the trace jax hands back for the step as written (the same
object for the same function and shapes), or the loss, optimizer, variant and layout a
restructured step is built from; for the last `KEPT` keys, within `KEPT_BYTES` of arrays
and traces (a deep model's liveness rows and traces are hundreds of MB). A loss whose
Python reads state that changes between plans is not seen to change, as under
`jax.jit`'s own cache; `clear` forgets them all.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import jax
import numpy as np
import scipy.sparse
from jax.extend.core import ClosedJaxpr, Jaxpr

from jaxwap.analysis.flatten import sub_jaxprs
from jaxwap.analysis.live_matrix import LiveRows

T = TypeVar("T")

KEPT = 24
KEPT_BYTES = 1 << 30
_KEPT: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()


#: what one equation of a kept jaxpr is counted as (its vars, avals and params: Python
#: objects, near enough)
EQN_BYTES = 2048


def _equations(jaxpr: Jaxpr) -> int:
    """The equations of `jaxpr` and of every jaxpr its equations call, each once."""
    seen: set[int] = set()
    count, todo = 0, [jaxpr]
    while todo:
        j = todo.pop()
        if id(j) in seen:
            continue
        seen.add(id(j))
        count += len(j.eqns)
        for e in j.eqns:
            todo.extend(sub_jaxprs(e.params))
    return count


def array_bytes(x: Any) -> int:
    """The bytes `x` keeps alive, near enough: its numpy and scipy arrays, and its jaxprs
    at `EQN_BYTES` an equation, in its dataclass fields, tuples, lists and dicts, through
    any depth."""
    if isinstance(x, np.ndarray | LiveRows):
        return int(x.nbytes)
    if isinstance(x, ClosedJaxpr | Jaxpr):
        return EQN_BYTES * _equations(x.jaxpr if isinstance(x, ClosedJaxpr) else x)
    if scipy.sparse.issparse(x):
        return sum(int(getattr(x, a).nbytes) for a in ("data", "indices", "indptr", "row",
                                                       "col") if hasattr(x, a))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return sum(array_bytes(getattr(x, f.name)) for f in dataclasses.fields(x))
    if isinstance(x, tuple | list):
        return sum(array_bytes(v) for v in x)
    if isinstance(x, dict):
        return sum(array_bytes(v) for v in x.values())
    return 0


def abstract_key(tree: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], str], ...]]:
    """`tree`'s structure and its leaves' shapes and dtypes: what of a step's abstract
    arguments a trace follows from, hashable."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def kept(key: tuple[Any, ...], build: Callable[[], T],
         keep: Callable[[T], bool] = lambda _: True) -> T:
    """`build()`, or what it gave for an equal `key` (the context mesh joins it: a
    trace follows the mesh it is made in). The oldest are forgotten past `KEPT` keys or
    `KEPT_BYTES` of arrays and traces; not kept at all where the key does not hash or
    compare (a loss function that cannot be a key), where `keep` refuses what was built
    (a trace that closes over another trace's values), or the value alone holds more
    than `KEPT_BYTES`."""
    full = (*key, jax.sharding.get_abstract_mesh())
    try:
        hit = full in _KEPT
    except Exception:  # noqa: BLE001 - a key that cannot be hashed or compared: not kept
        return build()
    if hit:
        _KEPT.move_to_end(full)
        return _KEPT[full][0]
    got = build()
    if not keep(got):
        return got
    size = array_bytes(got)
    if size > KEPT_BYTES:
        return got
    _KEPT[full] = (got, size)
    held = sum(n for _, n in _KEPT.values())
    while len(_KEPT) > KEPT or held > KEPT_BYTES:
        held -= _KEPT.popitem(last=False)[1][1]
    return got


def clear() -> None:
    """Forget every analysis kept (a loss whose Python changed under the same object)."""
    _KEPT.clear()


__all__ = ["EQN_BYTES", "KEPT", "KEPT_BYTES", "abstract_key", "array_bytes", "clear", "kept"]
