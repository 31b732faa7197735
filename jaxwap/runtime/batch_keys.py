"""A batch's PRNG keys, drawn apart per micro-batch.

A `make_train_step` loss takes `(params, batch)`, so a dropout key travels in the batch.
Split into micro-batches, the batch's rows are cut and every other leaf goes whole to
each micro-batch: a key too. Each micro-batch would then draw the same randomness (the
same dropout mask for its rows as the first micro-batch's), a correlation the step as
written does not have. So a key leaf that is not cut is folded with the micro-batch's
index (`jax.random.fold_in`): each micro-batch draws its own, from the same distribution
as the whole batch's. (Not the same numbers: a draw for a micro-batch's shape is not a
slice of the whole batch's draw, whatever the keys.)

A typed key (`jax.random.key`) says what it is. Raw key data (`jax.random.PRNGKey`,
uint32[2], or [4] for rbg, or a stack of them) is a plain array, so it counts as a key
only where the loss's trace wraps it as one (`random_wrap`: what `wrap_key_data` and
every `jax.random` function given raw data bind), with the implementation it names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Jaxpr

from jaxwap.analysis.flatten import bodies_one_to_one, is_value
from jaxwap.analysis.roles import is_key_dtype

#: a key leaf: typed (None) or raw data wrapped with this implementation's name
KeyKind = str | None


def maybe_raw_key(aval: Any) -> bool:
    """Whether a value could be raw key data: uint32 with a trailing dim of 2 (threefry)
    or 4 (rbg); only a `random_wrap` reading it says it is (`wrapped_keys`)."""
    return str(getattr(aval, "dtype", "")) == "uint32" and np.ndim(aval) > 0 \
        and np.shape(aval)[-1] in (2, 4)


def wrapped_keys(jaxpr: Jaxpr, targets: dict[Any, int]) -> dict[int, str]:
    """Which of `targets` (values of `jaxpr`, by an index of the caller's) a `random_wrap`
    reads as raw key data, with the implementation it names: looked for through calls
    whose body takes their inputs one to one (jit, checkpoint, custom derivatives, a
    scan's body)."""
    found: dict[int, str] = {}

    def walk(jaxpr: Jaxpr, targets: dict[Any, int]) -> None:
        for eqn in jaxpr.eqns:
            ins = [targets[v] for v in eqn.invars if is_value(v) and v in targets]
            if not ins:
                continue
            if eqn.primitive.name == "random_wrap":
                found.setdefault(ins[0], eqn.params["impl"].name)
                continue
            for inner in bodies_one_to_one(eqn):
                walk(inner, {i: targets[o] for o, i in zip(eqn.invars, inner.invars,
                                                           strict=True)
                             if is_value(o) and o in targets})
    walk(jaxpr, targets)
    return found


def key_leaves(trace: Callable[[], Any], leaves: Sequence[Any],
               whole: Sequence[bool]) -> list[KeyKind | bool]:
    """For each batch leaf, how it is a key that goes whole to every micro-batch
    (`whole[i]`): None for a typed key, the implementation's name for raw key data the
    loss wraps, False for anything else. `trace()` gives the loss's closed jaxpr taking
    (parameter leaves, batch leaves); it is called only where a whole leaf could be raw
    key data (uint32 with a trailing dim of 2 or 4)."""
    kinds: list[KeyKind | bool] = [False] * len(leaves)
    raw = {}
    for i, (x, w) in enumerate(zip(leaves, whole, strict=True)):
        dtype = getattr(x, "dtype", None)
        if not w or dtype is None:
            continue
        if is_key_dtype(dtype):
            kinds[i] = None
        elif maybe_raw_key(x):
            raw[i] = x
    if raw:
        jaxpr = trace().jaxpr
        first = len(jaxpr.invars) - len(leaves)
        for i, impl in wrapped_keys(jaxpr, {jaxpr.invars[first + i]: i for i in raw}).items():
            kinds[i] = impl
    return kinds


def fold_micro(x: Any, index: Any, kind: KeyKind) -> Any:
    """Key leaf `x` (typed: `kind` None; raw data of implementation `kind`) with the
    micro-batch `index` folded into each of its keys, in the form it came in."""
    keys = x if kind is None else jax.random.wrap_key_data(x, impl=kind)
    flat = keys.reshape(-1)
    folded = jax.vmap(lambda k: jax.random.fold_in(k, index))(flat).reshape(keys.shape)
    return folded if kind is None else jax.random.key_data(folded)


__all__ = ["KeyKind", "fold_micro", "key_leaves", "maybe_raw_key", "wrapped_keys"]
