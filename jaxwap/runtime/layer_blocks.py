"""The repeated blocks of an unrolled model, found in its loss function's jaxpr.

A model written with a Python loop over its layers (`for block in self.blocks`, a list of
Flax modules, an HF-style `ModuleList`) has no layer scan: its jaxpr is the embedding, the
same run of equations once per layer, and the head. Per-layer rematerialization does not
need a scan, only the layers' bounds: `find_repeated_blocks` finds the longest stretch of
a jaxpr (at the top level of the loss, or inside a `jax.jit` it calls) made of one run of
equations repeated back to back, equal in primitive, shapes and parameters, where each
repeat reads parameter leaves of its own and multiplies by one of them (a layer, not a
repeated elementwise pattern). Where a repeat starts within the period is chosen so that
the fewest activation bytes cross from one repeat into the next: the layer's input (the
residual stream), as a hand-placed `jax.checkpoint` around each block would take it.

`layer_remat.layer_remat_loss` checkpoints each repeat as it checkpoints a scan's
body; the cost model then reads the checkpointed program as it is. What it credits
assumes a backend that schedules each block's recomputation just before that block's
backward pass, as a loop forces for a scan's body. XLA:CPU does not: it computes every
recomputation ahead of the backward pass (and drops the optimization barriers that might
order it), so an unrolled model's checkpointed blocks compile to the peak of the step as
written there, and the planner does not offer them on CPUs (`train_step.ladder`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from jaxwap.analysis.flatten import group_ios, is_value
from jaxwap.analysis.primitives import prim_info
from jaxwap.runtime.layer_scan import (
    CALL_PRIMITIVES,
    LayerScan,
    NoLayerScan,
    called_jaxpr,
    equation_at,
    find_in_jaxpr,
)


@dataclass(frozen=True)
class RepeatedBlocks:
    """Where an unrolled model's layers are: the jaxpr at `path` (equation indices of the
    `jax.jit` calls leading to it; empty: the loss's own) holds `count` repeats of
    `period` equations, the first starting at equation `start`."""

    start: int
    period: int
    count: int
    path: tuple[int, ...] = ()

    def bounds(self) -> list[tuple[int, int]]:
        """(first, past-the-last) equation index of each repeat."""
        return [(self.start + i * self.period, self.start + (i + 1) * self.period)
                for i in range(self.count)]


class _Signatures:
    """Each equation as an int that is equal for equations equal in primitive, input and
    output shapes and dtypes, and parameters (nested jaxprs compared by their own
    equations; callables by type: a custom rule is a new object in every layer)."""

    def __init__(self) -> None:
        self.ids: dict[Any, int] = {}
        self.jaxprs: dict[int, int] = {}

    def of_jaxpr(self, jaxpr: Jaxpr) -> int:
        got = self.jaxprs.get(id(jaxpr))
        if got is None:
            got = self._intern(("jaxpr", tuple(self.of_eqn(e) for e in jaxpr.eqns)))
            self.jaxprs[id(jaxpr)] = got
        return got

    def _param(self, v: Any) -> Any:
        if isinstance(v, ClosedJaxpr):
            return self.of_jaxpr(v.jaxpr)
        if isinstance(v, Jaxpr):
            return self.of_jaxpr(v)
        if isinstance(v, tuple | list):
            return tuple(self._param(x) for x in v)
        if callable(v):
            return type(v).__name__
        return str(v)

    def of_eqn(self, eqn: Any) -> int:
        avals = tuple((tuple(v.aval.shape), str(v.aval.dtype)) if hasattr(v.aval, "shape")
                      else str(v.aval) for v in (*eqn.invars, *eqn.outvars))
        params = tuple(sorted((k, self._param(v)) for k, v in eqn.params.items()))
        return self._intern((eqn.primitive.name, avals, params))

    def _intern(self, key: Any) -> int:
        return self.ids.setdefault(key, len(self.ids))


def _periodic_runs(sig: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, period, periodic length) of each period's longest run of at least two
    repeats: `sig[start:start + length]` equals itself shifted by `period`."""
    n, out = len(sig), []
    for p in range(1, n // 2 + 1):
        same = np.concatenate(([False], sig[:n - p] == sig[p:], [False]))
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if not len(edges):
            continue
        begins, ends = edges[0::2], edges[1::2]
        k = int(np.argmax(ends - begins))
        if ends[k] - begins[k] >= p:
            out.append((int(begins[k]), p, int(ends[k] - begins[k]) + p))
    return out


def _crossing_bytes(jaxpr: Jaxpr, own: set[Any]) -> np.ndarray:
    """Per equation index t: the bytes of values made before equation t (by equations,
    not the jaxpr's inputs) that equation t or a later one reads: what a cut there
    carries. Values computed from parameters alone (`own`: cast weights) are left out,
    as their layer's weights are."""
    n = len(jaxpr.eqns)
    last: dict[Any, int] = {v: n for v in jaxpr.outvars if is_value(v)}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if is_value(v):
                last[v] = max(last.get(v, k), k)
    delta = np.zeros(n + 2)
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            if is_value(v) and v in last and v not in own and last[v] > k:
                size = int(np.prod(v.aval.shape, dtype=np.int64)) * v.aval.dtype.itemsize
                delta[k + 1] += size          # live from t = k + 1 ...
                delta[last[v] + 1] -= size    # ... to its last reader
    return np.cumsum(delta)[:n]


class _BlockSearch:
    """The repeated blocks of each jaxpr in a loss's call tree; the most equations
    covered wins."""

    def __init__(self) -> None:
        self.sigs = _Signatures()
        self.found: list[tuple[int, RepeatedBlocks]] = []
        self.reasons: list[str] = []

    def walk(self, jaxpr: Jaxpr, param_of: dict[Any, int], path: tuple[int, ...]) -> None:
        param_of = dict(param_of)
        own: set[Any] = set()
        for k, eqn in enumerate(jaxpr.eqns):
            ins = [v for v in eqn.invars if is_value(v)]
            if ins and all(v in param_of or v in own for v in ins):
                own.update(eqn.outvars)     # cast / reshaped weights
                if eqn.primitive.name == "convert_element_type":
                    param_of[eqn.outvars[0]] = param_of.get(ins[0], -1)
            if eqn.primitive.name in CALL_PRIMITIVES:
                inner = called_jaxpr(eqn).jaxpr
                self.walk(inner, {i: param_of[o] for o, i in zip(
                    eqn.invars, inner.invars, strict=True) if is_value(o) and o in param_of},
                    (*path, k))
        self.judge(jaxpr, param_of, own, path)

    def judge(self, jaxpr: Jaxpr, param_of: dict[Any, int], own: set[Any],
              path: tuple[int, ...]) -> None:
        eqns = jaxpr.eqns
        if len(eqns) < 2:
            return
        sig = np.array([self.sigs.of_eqn(e) for e in eqns], dtype=np.int64)
        crossing = _crossing_bytes(jaxpr, own)
        layered = [self._is_layer(e, param_of, own) for e in eqns]
        best: tuple[int, RepeatedBlocks] | None = None
        for start, period, length in _periodic_runs(sig):
            if best is not None and length <= best[0]:
                continue
            # where in the period a layer starts: the cut that carries the fewest bytes
            # among those that keep at least all repeats but one
            most = length // period
            phases = [o for o in range(period) if (length - o) // period >= max(2, most - 1)]
            o = min(phases, key=lambda o: (crossing[start + o], o))
            blocks = RepeatedBlocks(start + o, period, (length - o) // period, path)
            if best is not None and blocks.count * period <= best[0]:
                continue
            if all(any(layered[a:b]) for a, b in blocks.bounds()):
                best = (blocks.count * period, blocks)
            else:
                self.reasons.append(f"{blocks.count} repeats of {period} equations that "
                                    f"multiply by no weight of their own")
        if best is not None:
            self.found.append(best)

    @staticmethod
    def _is_layer(eqn: Any, param_of: dict[Any, int], own: set[Any]) -> bool:
        # what makes a repeat a layer: a matmul the primitive table gives a layer rule
        # (it multiplies by a weight), reading a weight of its own
        return prim_info(eqn.primitive.name).layer is not None and any(
            is_value(v) and (v in param_of or v in own) for v in eqn.invars)

    def best(self) -> RepeatedBlocks:
        if self.found:
            return max(self.found, key=lambda x: (x[0], -x[1].period))[1]
        why = self.reasons[0] if self.reasons else "no run of equations repeats"
        raise NoLayerScan(f"the loss function has no repeated blocks ({why})")


def find_repeated_blocks(jaxpr: Jaxpr, n_params: int) -> RepeatedBlocks:
    """The repeated blocks (the layers of an unrolled model) of a loss jaxpr taking
    (param leaves, batch leaves); `NoLayerScan` says why there are none."""
    search = _BlockSearch()
    search.walk(jaxpr, {v: i for i, v in enumerate(jaxpr.invars[:n_params])}, ())
    return search.best()


class _Wiring:
    """Each repeat as a key equal for repeats that compute the same function of their
    inputs: the same equations (primitive, output shapes, parameters) wired the same way
    (each input read as the repeat's k-th input, in first-use order, or as the j-th value
    the repeat made), with equal literals and the same outputs read later. Stricter than
    `_Signatures`, which finds the repeats: there, parameters compare as text and callables
    by type, enough to find where layers are; here two repeats with equal keys may run as
    one traced function, so a callable (a custom derivative rule, a checkpoint policy) or
    a nested jaxpr's constant must be the very same object, and anything unhashable is
    compared by identity. Repeats whose keys differ are simply not shared."""

    def __init__(self) -> None:
        self.jaxprs: dict[int, tuple[Any, Jaxpr]] = {}

    def of_run(self, eqns: Sequence[Any], ins: Sequence[Any], outs: Sequence[Any]
               ) -> tuple[Any, ...]:
        ids: dict[Any, Any] = {v: ("in", i) for i, v in enumerate(ins)}
        made = 0
        key: list[Any] = []
        for e in eqns:
            args = tuple(ids[v] if is_value(v) else self._literal(v) for v in e.invars)
            for v in e.outvars:
                if is_value(v):
                    ids[v], made = made, made + 1
            key.append((e.primitive.name, args,
                        tuple((tuple(v.aval.shape), str(v.aval.dtype))
                              if hasattr(v.aval, "shape") else str(v.aval)
                              for v in e.outvars),
                        tuple(sorted((k, self._param(p)) for k, p in e.params.items()))))
        key.append(tuple(ids[v] if is_value(v) else self._literal(v) for v in outs))
        return tuple(key)

    def _jaxpr(self, jaxpr: Jaxpr) -> Any:
        # kept with its jaxpr, so the id stays that jaxpr's while this lives
        got = self.jaxprs.get(id(jaxpr))
        if got is None:
            got = self.jaxprs[id(jaxpr)] = (
                self.of_run(jaxpr.eqns, [*jaxpr.constvars, *jaxpr.invars], jaxpr.outvars),
                jaxpr)
        return got[0]

    def _param(self, v: Any) -> Any:
        if isinstance(v, ClosedJaxpr):
            return ("closed", self._jaxpr(v.jaxpr), tuple(("id", id(c)) for c in v.consts))
        if isinstance(v, Jaxpr):
            return ("jaxpr", self._jaxpr(v))
        if isinstance(v, tuple | list):
            return (type(v).__name__, tuple(self._param(x) for x in v))
        if callable(v):
            return ("id", id(v))
        try:
            hash(v)
        except TypeError:
            return ("id", id(v))
        return (type(v).__name__, v)

    @staticmethod
    def _literal(v: Any) -> Any:
        val = np.asarray(v.val)
        return ("literal", str(val.dtype), val.shape, val.tobytes())


def alike_repeats(jaxpr: Jaxpr, blocks: RepeatedBlocks,
                  ios: Sequence[tuple[list[Any], list[Any]]] | None = None) -> list[int]:
    """For each repeat of `blocks` in `jaxpr`, the index of the first repeat that computes
    the same function of its inputs (`_Wiring`; itself when none before it does), so a
    rewrite may trace that function once and run it for each of them: JAX's caches of a
    traced function's derivative and transposition then serve every layer, where tracing
    each layer afresh costs seconds at 80 layers. `ios`: each repeat's `group_ios`, where
    the caller has them."""
    bounds = blocks.bounds()
    ios = ios if ios is not None else group_ios(jaxpr, bounds)
    wiring, first_of, out = _Wiring(), {}, []
    for i, ((a, b), (ins, outs)) in enumerate(zip(bounds, ios, strict=True)):
        out.append(first_of.setdefault(wiring.of_run(jaxpr.eqns[a:b], ins, outs), i))
    return out


# each loss jaxpr's layers, kept while the jaxpr lives: the planner asks again for every
# per-layer remat variant of a loss `layer_scan.trace_loss` traced once, and the search
# for repeated blocks walks every equation (a second at 100 layers)
_LAYERS: weakref.WeakKeyDictionary[Jaxpr, dict[tuple[int, int], Any]] = \
    weakref.WeakKeyDictionary()


def find_layers(jaxpr: Jaxpr, n_params: int, batch_size: int) -> LayerScan | RepeatedBlocks:
    """The layers of a loss jaxpr taking (param leaves, batch leaves): its layer scan
    (`find_in_jaxpr`; one that cannot be pipelined but loops over layers is still one to
    checkpoint), else an unrolled model's repeated blocks; `NoLayerScan` gives both
    reasons where there are neither."""
    known = _LAYERS.setdefault(jaxpr, {})
    key = (n_params, batch_size)
    if key not in known:
        try:
            known[key] = _find_layers(jaxpr, n_params, batch_size)
        except NoLayerScan as e:
            known[key] = e
    if isinstance(known[key], NoLayerScan):
        raise NoLayerScan(str(known[key]))
    return known[key]


def _find_layers(jaxpr: Jaxpr, n_params: int, batch_size: int) -> LayerScan | RepeatedBlocks:
    try:
        return find_in_jaxpr(jaxpr, n_params, batch_size, remat=True)
    except NoLayerScan as no_scan:
        try:
            return find_repeated_blocks(jaxpr, n_params)
        except NoLayerScan as no_blocks:
            raise NoLayerScan(f"{no_scan}; {no_blocks}") from None


def saved_dot_bytes(jaxpr: Jaxpr, layers: LayerScan | RepeatedBlocks) -> int:
    """The bytes, at the batch the loss was traced with, of the outputs of the layers'
    matmuls without batch dims (`dot_general` with none: the weight matmuls, not
    attention's), every layer's together: what selective per-layer remat
    (`dots_with_no_batch_dims_saveable`) keeps from the forward pass to the backward one,
    all of it live when the forward pass ends. Top-level equations of a layer only, so a
    lower bound where a layer nests calls."""
    if isinstance(layers, RepeatedBlocks):
        inner = called_jaxpr(equation_at(jaxpr, layers.path)).jaxpr if layers.path else jaxpr
        eqns = [e for a, b in layers.bounds() for e in inner.eqns[a:b]]
        times = 1
    else:
        eqns = list(equation_at(jaxpr, layers.path).params["jaxpr"].jaxpr.eqns)
        times = layers.length
    return sum(_nbytes(e.outvars[0]) for e in eqns if _weight_matmul(e)) * times


def saved_input_bytes(jaxpr: Jaxpr, layers: LayerScan | RepeatedBlocks) -> int:
    """The bytes, at the batch the loss was traced with, of what each layer's checkpoint
    keeps as its input under every per-layer remat policy (its arguments stay with the
    caller): the activation one layer passes the next (a scan's carry, each iteration's;
    the values a repeated block reads from the block before it), every layer's together,
    leaving out a weight matmul's output (`saved_dot_bytes` counts it) and the first
    layer's input, so a lower bound."""
    if isinstance(layers, LayerScan):
        body = equation_at(jaxpr, layers.path).params["jaxpr"].jaxpr
        if any(_weight_matmul(e) for e in body.eqns if set(e.outvars) & set(body.outvars)):
            return 0     # the carry may be a saved matmul output: counted there
        return int(np.prod(layers.carry_shape, dtype=np.int64)
                   * np.dtype(layers.carry_dtype).itemsize) * max(layers.length - 1, 0)
    inner = called_jaxpr(equation_at(jaxpr, layers.path)).jaxpr if layers.path else jaxpr
    bounds = layers.bounds()
    total = 0
    for (a, _), (ins, _) in zip(bounds[1:], group_ios(inner, bounds)[1:], strict=True):
        made = {v: e for e in inner.eqns[a - layers.period:a] for v in e.outvars}
        total += sum(_nbytes(v) for v in ins if v in made and not _weight_matmul(made[v]))
    return total


def _weight_matmul(e: Any) -> bool:
    """A `dot_general` without batch dims: a weight matmul, not attention's."""
    return e.primitive.name == "dot_general" and not e.params["dimension_numbers"][1][0]


def _nbytes(v: Any) -> int:
    return int(np.prod(v.aval.shape, dtype=np.int64)) * v.aval.dtype.itemsize


__all__ = ["RepeatedBlocks", "alike_repeats", "find_layers", "find_repeated_blocks",
           "saved_dot_bytes", "saved_input_bytes"]
