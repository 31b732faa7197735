"""A `fori_loop` over layers, as the layer scan it is.

`lax.fori_loop(0, L, lambda i, h: layer(w[i], h), x)` over parameters stacked [L, ...]
traces to a `scan` that closes over each whole stack and slices layer i from it by its
counter (a `dynamic_slice` at i, behind `w[i]`'s index normalization or inside
`dynamic_index_in_dim`'s jitted call). It computes what a scan over the stacks computes,
which jaxwap pipelines and checkpoints layer by layer. `as_layer_scans` rewrites each
such loop of a loss's trace (at its top level, and in the jit calls it makes) as a
`lax.scan` taking the stacks as per-layer inputs, and its counter as a per-layer integer
(a layer may read it: a flag by parity), carrying the rest; the traced loss then goes on
as the user's scan would (`layer_scan.trace_loss`).

Only where the loop reads each stack as one layer's slice at the iteration it is in, every
read and every iteration checked (`_indices`: the slice's start computed from the counter
for each of the L iterations, through the casts, wraps of negative indices and
arithmetic that compute it): `w[L - 1 - i]`, `w[i // 2]` or a stack read whole leave the
loop as it is, and the layer-scan search says why it cannot be pipelined."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr

from jaxwap.analysis.flatten import REMAT_PRIMITIVES, bind, evaluate, is_value, scan_counts

# calls a stack may be passed into (their bodies take their inputs one to one); a custom
# derivative's is not followed: its rule may read the stack otherwise
_CALLS = frozenset({"jit", "pjit", "closed_call"}) | REMAT_PRIMITIVES

# the integer arithmetic an index is computed with, per iteration (numpy on [L] vectors)
_OPS = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "neg": np.negative,
    "max": np.maximum, "min": np.minimum, "rem": np.fmod, "lt": np.less,
    "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
    "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or,
    "not": np.logical_not,
    "div": lambda a, b: np.trunc(np.divide(a, b)).astype(np.result_type(a, b)),
    "clamp": lambda lo, x, hi: np.clip(x, lo, hi),
    "select_n": lambda p, *cases: np.choose(np.asarray(p, int), cases),
}


@dataclass(frozen=True)
class _Loop:
    """A scan found to be a loop over indexed stacks: the carry position of its counter,
    the counter's first value, and the positions among its consts of the stacks."""

    counter: int
    lower: int
    stacks: tuple[int, ...]


class _Slice:
    """A stack inside the rewritten body, standing for one layer's slice of it: reading
    it at the iteration's index gives that slice."""

    def __init__(self, value: Any) -> None:
        self.value = value


def as_layer_scans(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with each loop over indexed stacks (`_loop`) rewritten as a scan over
    them; `closed` itself where there is none (nothing is traced again)."""
    if not _has_loop(closed.jaxpr):
        return closed
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *a: evaluate(closed.jaxpr, closed.consts, a, run=_run))(
        *args)


def _has_loop(jaxpr: Jaxpr) -> bool:
    """Whether `jaxpr` runs a loop over indexed stacks, at its top level or in a call."""
    return any(_loop(e) is not None if e.primitive.name == "scan"
               else e.primitive.name in _CALLS - REMAT_PRIMITIVES
               and _has_loop(called_jaxpr(e).jaxpr) for e in jaxpr.eqns)


def called_jaxpr(eqn: Any) -> ClosedJaxpr:
    """The closed jaxpr a call equation (a jit, a closed call, a checkpoint, whose body is
    open: closed over nothing) runs."""
    j = eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]
    return j if isinstance(j, ClosedJaxpr) else ClosedJaxpr(j, ())


def _run(k: int, eqn: Any, ins: list[Any]) -> list[Any]:
    """The loss evaluated again: its loops over indexed stacks as scans over them, the
    calls that hold one inlined."""
    name = eqn.primitive.name
    if name == "scan" and (loop := _loop(eqn)) is not None:
        return _scan_over_stacks(eqn, ins, loop)
    if name in _CALLS - REMAT_PRIMITIVES and _has_loop(called_jaxpr(eqn).jaxpr):
        inner = called_jaxpr(eqn)
        return evaluate(inner.jaxpr, inner.consts, ins, run=_run)
    return bind(eqn, ins)


def _loop(eqn: Any) -> _Loop | None:
    """The scan `eqn` as a loop over indexed stacks, or None: it runs forward, one of its
    carries starts at an integer literal and goes up by one each iteration (the counter),
    and some of its consts have the loop's length leading and are read only as the slice
    at the iteration (their start the counter less its first value, at every iteration)."""
    p = eqn.params
    if p.get("reverse", False):
        return None
    nc, ncarry = scan_counts(p)
    length, body = int(p["length"]), p["jaxpr"].jaxpr
    made = {o: e for e in body.eqns for o in e.outvars}
    for c in range(ncarry):
        init, var = eqn.invars[nc + c], body.invars[nc + c]
        step = made.get(body.outvars[c])
        if (is_value(init) or not np.issubdtype(np.asarray(init.val).dtype, np.integer)
                or step is None or not _plus_one(step, var)):
            continue
        lower = int(init.val)
        candidates = {body.invars[k]: k for k in range(nc)
                      if is_value(eqn.invars[k]) and np.ndim(eqn.invars[k].aval) >= 1
                      and eqn.invars[k].aval.shape[0] == length}
        known = {var: np.arange(length, dtype=np.int64) + lower}
        stacks = _indices(body, known, dict(candidates), length)
        if stacks:
            return _Loop(c, lower, tuple(sorted(candidates[v] for v in stacks)))
    return None


def _plus_one(eqn: Any, var: Any) -> bool:
    """Whether `eqn` is `var + 1` (either way round)."""
    if eqn.primitive.name != "add":
        return False
    a, b = eqn.invars
    return any(x is var and not is_value(y) and np.asarray(y.val).item() == 1
               for x, y in ((a, b), (b, a)))


def _indices(jaxpr: Jaxpr, known: dict[Any, Any], stacks: dict[Any, int], length: int
             ) -> set[Any]:
    """The stacks (of `stacks`: values of `jaxpr` with the loop's length leading) that
    `jaxpr` reads only as the slice at the iteration: a `dynamic_slice` of one row whose
    start is the iteration (0 .. length - 1) at every iteration and 0 in the other dims,
    or passed into a call (`_CALLS`) that reads it so. `known`: the integer values
    computed from the counter, each as its [length] values (or a constant), extended as
    the walk goes."""
    bad: set[Any] = set()

    def value(v: Any) -> Any:
        return np.asarray(v.val) if not is_value(v) else known.get(v)

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        held = [v for v in eqn.invars if is_value(v) and v in stacks]
        if name == "dynamic_slice" and held[:1] == [eqn.invars[0]] and len(held) == 1:
            v, starts = eqn.invars[0], [value(s) for s in eqn.invars[1:]]
            ok = (tuple(eqn.params["slice_sizes"]) == (1, *v.aval.shape[1:])
                  and all(s is not None for s in starts)
                  and np.array_equal(np.broadcast_to(starts[0], (length,)),
                                     np.arange(length))
                  and all(not np.any(s) for s in starts[1:]))
            if not ok:
                bad.add(v)
            continue
        if name in _CALLS and held:
            inner = called_jaxpr(eqn).jaxpr
            pairs = list(zip(eqn.invars, inner.invars, strict=True))
            fine = _indices(inner, {i: known[o] for o, i in pairs if is_value(o) and o in known},
                            {i: 0 for o, i in pairs if is_value(o) and o in stacks}, length)
            bad.update(o for o, i in pairs if is_value(o) and o in stacks and i not in fine)
            continue
        bad.update(held)
        _compute(eqn, [value(v) for v in eqn.invars], known)
    bad.update(v for v in jaxpr.outvars if is_value(v) and v in stacks)
    return {v for v in stacks if v not in bad}


def _compute(eqn: Any, ins: Sequence[Any], known: dict[Any, Any]) -> None:
    """`known` extended by `eqn`'s result where it is integer (or boolean) scalar
    arithmetic (`_OPS`, a cast) on known values."""
    name = eqn.primitive.name
    out = eqn.outvars[0] if len(eqn.outvars) == 1 else None
    if out is None or not is_value(out) or np.ndim(out.aval) != 0 or any(
            x is None for x in ins):
        return
    dtype = np.dtype(out.aval.dtype)
    if not (np.issubdtype(dtype, np.integer) or dtype == np.bool_):
        return
    if name == "convert_element_type":
        known[out] = np.asarray(ins[0]).astype(dtype)
    elif name in _OPS:
        with np.errstate(all="ignore"):
            known[out] = np.asarray(_OPS[name](*ins)).astype(dtype)


def _scan_over_stacks(eqn: Any, ins: list[Any], loop: _Loop) -> list[Any]:
    """The loop `eqn` run as a scan over its stacks (and its counter, as a per-layer
    integer), its other inputs as they were; its outputs as the loop's (the counter's
    last value a constant)."""
    p = eqn.params
    nc, ncarry = scan_counts(p)
    length, body = int(p["length"]), p["jaxpr"]
    consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    counter_dtype = eqn.invars[nc + loop.counter].aval.dtype
    rest = [x for c, x in enumerate(carry) if c != loop.counter]

    def step(h: list[Any], per_layer: tuple[list[Any], Any, list[Any]]
             ) -> tuple[list[Any], list[Any]]:
        slices, i, x = per_layer
        given = dict(zip(loop.stacks, slices, strict=True))
        cs = [_Slice(given[k]) if k in given else c for k, c in enumerate(consts)]
        h = list(h)
        h.insert(loop.counter, i)
        outs = evaluate(body.jaxpr, body.consts, [*cs, *h, *x], run=_sliced)
        new = [o for c, o in enumerate(outs[:ncarry]) if c != loop.counter]
        return new, outs[ncarry:]

    counts = jnp.arange(length, dtype=counter_dtype) + jnp.asarray(loop.lower, counter_dtype)
    last, ys = lax.scan(step, rest, ([consts[k] for k in loop.stacks], counts, list(xs)),
                        length=length, unroll=p.get("unroll", 1))
    last = list(last)
    last.insert(loop.counter, jnp.asarray(loop.lower + length, counter_dtype))
    return [*last, *ys]


def _sliced(k: int, eqn: Any, ins: list[Any]) -> list[Any]:
    """The loop's body evaluated with its stacks as this iteration's slices: a read of
    one (`dynamic_slice` at the iteration, as `_indices` checked) is the slice; a call
    that takes one is evaluated inline, a checkpoint made again around its body."""
    name = eqn.primitive.name
    if not any(isinstance(x, _Slice) for x in ins):
        return bind(eqn, ins)
    if name == "dynamic_slice":
        return [lax.expand_dims(ins[0].value, (0,))]
    inner = called_jaxpr(eqn)

    def run(*xs: Any) -> list[Any]:
        return evaluate(inner.jaxpr, inner.consts, xs, run=_sliced)
    if name in REMAT_PRIMITIVES:
        values = [x.value if isinstance(x, _Slice) else x for x in ins]
        at = [j for j, x in enumerate(ins) if isinstance(x, _Slice)]

        def remat(*xs: Any) -> list[Any]:
            return run(*[_Slice(x) if j in at else x for j, x in enumerate(xs)])
        return jax.checkpoint(remat, policy=eqn.params.get("policy"),
                              prevent_cse=eqn.params.get("prevent_cse", True))(*values)
    return run(*ins)


__all__ = ["as_layer_scans", "called_jaxpr"]
