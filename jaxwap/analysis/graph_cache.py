"""The analyses of the steps jaxwap builds, kept for the last few.

A step jaxwap restructures (`make_train_step`'s variants, a pipeline stage's step) is a
new function each time it is built, so jax's trace cache never serves it: every plan of
the same step traced and analysed the same variants again, which is most of planning it
anew (under another memory budget or objective, or the published layout priced beside
the plan found). `kept` keys an analysis on what determines it, for the last
`KEPT` keys. A loss whose Python reads state that changes between plans is not seen to
change, as under `jax.jit`'s cache; `clear` forgets them all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import jax

T = TypeVar("T")

KEPT = 24
_KEPT: OrderedDict[Hashable, Any] = OrderedDict()


def kept(key: tuple[Any, ...], build: Callable[[], T]) -> T:
    """`build()`, or what it gave for an equal `key` (the context mesh joins it: a
    trace follows the mesh it is made in). Not kept where the key does not hash (a loss
    function that cannot be a key)."""
    full = (*key, jax.sharding.get_abstract_mesh())
    try:
        hash(full)
    except TypeError:
        return build()
    if full in _KEPT:
        _KEPT.move_to_end(full)
        return _KEPT[full]
    got = build()
    _KEPT[full] = got
    while len(_KEPT) > KEPT:
        _KEPT.popitem(last=False)
    return got


def clear() -> None:
    """Forget every analysis kept (a loss whose Python changed under the same object)."""
    _KEPT.clear()


__all__ = ["KEPT", "clear", "kept"]
