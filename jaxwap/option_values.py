"""Checking and canonicalising one option's value, before `PlanOptions` keeps it.

Each function here takes what a user may pass for one option (a dict, a bool, a tuple,
a name) and gives back the one form the record keeps, or raises naming the option and
what it accepts. The form kept is plain (ints, strs, tuples of them) and compares by value,
because the record is part of the plan cache's key, and it is accepted again as input,
because `dataclasses.replace` remakes the record from its own fields. Kept apart from
`options.py`, whose record checks what a type test settles and the options against each
other (a `mesh_shape` against `num_devices`, a given plan against the rest).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxwap.core.records import DATA, MODEL, REPLICA, STRATEGY_FAMILIES

# Steps measured per finalist by `measure=True`.
DEFAULT_MEASURE_STEPS = 5
# The keys `pipeline=` may hold, in the order the record keeps them.
PIPELINE_KEYS = ("stages", "micro_batches", "repeats")


def is_number(x: Any) -> bool:
    """A real number, numpy's included; not a bool, which is an int to Python but never
    what a user means by a size in bytes."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def check_int(name: str, value: Any, low: int | None, *, none_ok: bool = False,
              what: str = "", exc: type[Exception] = ValueError) -> None:
    """Refuse a value that is not an int (a bool neither: True is no count) or is below
    `low`, naming the option `name` and, where given, `what` it counts. `exc` is the
    error for a wrong type, ValueError for an int out of range."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise exc(f"{name} must be an int{' or None' if none_ok else ''}"
                  f"{f' ({what})' if what else ''}, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}{f' ({what})' if what else ''}, "
                         f"got {value!r}")


def canonical_measure(measure: Any) -> int:
    """The steps `measure=` asks for per finalist: True is `DEFAULT_MEASURE_STEPS`, False
    none, else a count >= 0."""
    if isinstance(measure, bool):
        return DEFAULT_MEASURE_STEPS if measure else 0
    if isinstance(measure, (int, np.integer)) and measure >= 0:
        return int(measure)
    raise ValueError(f"measure must be a bool or a number of steps >= 0, got {measure!r}")


def canonical_mesh_shape(shape: Any) -> tuple[tuple[str, int], ...]:
    """{"data": d, "model": m} (either may be left out) as ((DATA, d), (MODEL, m)), the
    form the record keeps (and reads again when `dataclasses.replace` remakes it); with
    "replica": r > 1 (HSDP: the data axis's part across nodes), ((REPLICA, r), ...)."""
    if isinstance(shape, tuple) and all(isinstance(x, tuple) and len(x) == 2
                                        and isinstance(x[0], str) for x in shape):
        shape = dict(shape)
    if not isinstance(shape, Mapping):
        raise TypeError(f"mesh_shape must be a dict of axis name -> size such as "
                        f"{{'{DATA}': 2, '{MODEL}': 4}}, got {shape!r}")
    unknown = sorted(set(shape) - {DATA, MODEL, REPLICA})
    if unknown:
        raise ValueError(f"mesh_shape has unknown axis name(s) {unknown}; jaxwap's mesh axes "
                         f"are {REPLICA!r} (optional), {DATA!r} and {MODEL!r}")
    for axis, size in shape.items():
        check_int(f"mesh_shape[{axis!r}]", size, 1)
    axes = (REPLICA, DATA, MODEL) if int(shape.get(REPLICA, 1)) > 1 else (DATA, MODEL)
    return tuple((axis, int(shape.get(axis, 1))) for axis in axes)


def canonical_pipeline(value: Any) -> bool | tuple[tuple[str, int], ...] | None:
    """None / True (weigh pipelines), False (never), or the forced shape as sorted
    (name, value) pairs, checked."""
    if value is None or value is True:
        return None
    if value is False:
        return False
    if isinstance(value, tuple) and all(isinstance(x, tuple) for x in value):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise TypeError(f"pipeline must be None, a bool or a dict such as {{'stages': 4, "
                        f"'micro_batches': 8}}, got {value!r}")
    unknown = sorted(set(value) - set(PIPELINE_KEYS))
    if unknown or "stages" not in value:
        raise ValueError(f"pipeline={dict(value)!r}: "
                         + (f"unknown key(s) {unknown}" if unknown else "'stages' is missing")
                         + f"; its keys are {PIPELINE_KEYS}")
    for k, v in value.items():
        check_int(f"pipeline[{k!r}]", v, 2 if k == "stages" else 1)
    return tuple((k, int(value[k])) for k in PIPELINE_KEYS if k in value)


def canonical_strategies(families: Any) -> tuple[str, ...]:
    """The allowed strategy families, checked, in `STRATEGY_FAMILIES` order."""
    if isinstance(families, str):
        families = (families,)
    try:
        given = set(families)
    except TypeError:
        raise TypeError(f"strategies must be a tuple of names from {STRATEGY_FAMILIES}, got "
                        f"{families!r}") from None
    unknown = sorted(map(str, given - set(STRATEGY_FAMILIES)))
    if unknown or not given:
        raise ValueError(f"strategies={tuple(families)!r}: "
                         + (f"unknown name(s) {unknown}" if unknown else "empty")
                         + f"; choose from {STRATEGY_FAMILIES}")
    return tuple(f for f in STRATEGY_FAMILIES if f in given)


__all__ = ["DEFAULT_MEASURE_STEPS", "PIPELINE_KEYS", "canonical_measure", "canonical_mesh_shape",
           "canonical_pipeline", "canonical_strategies", "check_int", "is_number"]
