"""A step's jaxpr as one flat list of operations on numbered values.

The cost model wants every real operation of the step in program order, each reading and
writing values it can index into arrays. So calls (`jit`, `custom_jvp_call`, `remat`,
whatever the primitive table marks `inline`) are inlined; a `scan` is inlined once with
its ops marked repeated `length` times, so the liveness walk sees one iteration's
temporaries, as the loop allocates them (slicing an iteration's input out of `xs` and
stacking its output into `ys` become the synthetic ops `scan_slice` and `scan_stack`);
`while` and `cond` stay opaque. Operations whose results nothing uses are dropped, as XLA
drops them.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxwap.analysis.primitives import prim_info


@dataclass(frozen=True, slots=True)
class Var:
    """One value of the flat program."""

    shape: tuple[int, ...]
    dtype: Any
    nbytes: int
    size: int
    repeat: int = 1        # iterations of the enclosing (inlined) scans
    on_host: bool = False  # in host memory (a residual offloaded by a remat policy)


@dataclass(frozen=True, slots=True)
class FlatOp:
    """One equation of the flat program; `ins` / `outs` index `FlatProgram.vars`."""

    eqn: Any
    ins: list[int]
    outs: list[int]
    repeat: int = 1
    # the differentiated `jax.checkpoint` (CSE prevented) it runs in, numbered in program
    # order, -1 for none: XLA's barrier on that checkpoint's inputs makes every value it
    # reads there a value of its own (a sharded weight gathered again, say)
    region: int = -1

    @property
    def prim(self) -> str:
        return self.eqn.primitive.name


@dataclass(frozen=True)
class _Prim:
    name: str


@dataclass(frozen=True)
class _Synthetic:
    """Stands in for an equation where a scan is inlined: slicing one iteration's input
    out of the stacked `xs` (an alias), or stacking one iteration's output into `ys`."""

    primitive: _Prim


_SLICE, _STACK = _Synthetic(_Prim("scan_slice")), _Synthetic(_Prim("scan_stack"))


@dataclass(frozen=True)
class FlatProgram:
    """The flat program, with per-value arrays the analysis passes index by value id."""

    vars: tuple[Var, ...]
    ops: tuple[FlatOp, ...]
    in_ids: tuple[int, ...]
    out_ids: tuple[int, ...]
    size: np.ndarray      # [values] elements
    nbytes: np.ndarray    # [values] bytes (float)
    on_host: np.ndarray   # [values] bool


def itemsize_of(dtype: Any) -> int:
    """Bytes per element; extended dtypes (PRNG keys) say their own, else 8."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return getattr(dtype, "itemsize", 8) or 8


def _var(aval: Any, repeat: int) -> Var:
    shape = tuple(int(s) for s in getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    size = math.prod(shape)
    space = getattr(aval, "memory_space", None)
    if space is None:
        host = False
    else:
        name = getattr(space, "name", None)  # (str() of an enum member is slow)
        host = (str(space) if name is None else name).lower().endswith("host")
    return Var(shape, dtype, size * itemsize_of(dtype), size, repeat, host)


def _sub_jaxpr(eqn: Any) -> Any | None:
    """The body of a call the table says to inline, or None (also when it has none)."""
    if not prim_info(eqn.primitive.name).inline:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None and (hasattr(sub, "eqns") or hasattr(sub, "jaxpr")):
            return sub
    return None


def sub_jaxprs(params: Mapping[str, Any]) -> Iterator[Any]:
    """Every jaxpr an equation's params hold (a call's body, a cond's branches, a custom
    rule's function), open: what a walk through nested jaxprs descends into. (By their
    attributes, as `_sub_jaxpr` tells them: this module reads jaxprs without importing
    jax.)"""
    for v in params.values():
        for x in (v if isinstance(v, tuple | list) else (v,)):
            if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):   # closed: its jaxpr
                yield x.jaxpr
            elif hasattr(x, "eqns"):
                yield x


def bodies_one_to_one(eqn: Any) -> list[Any]:
    """The jaxprs `eqn` runs that take its inputs one to one (a jit's or checkpoint's
    body, a custom derivative's function, a scan's body): input k of the equation is
    input k of each, so a walk can follow one input into them."""
    return [j for j in sub_jaxprs(eqn.params) if len(j.invars) == len(eqn.invars)]


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """(consts, carried values) at the head of a `scan` equation's inputs, in either form
    jax writes them: `num_consts`/`num_carry` up to jax 0.10; from jax 0.11 the inputs'
    grouping `ft_in`, a flat tree of (consts, carry, xs) (jax/_src/lax/control_flow/loops.py)."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


class _Flattener:
    """Walks nested jaxprs, numbering values and appending ops in program order."""

    def __init__(self) -> None:
        self.vars: list[Var] = []
        self.ops: list[FlatOp] = []
        self.repeat = 1
        self.region, self.regions = -1, 0     # the checkpoint being inlined; how many
        # each inlined loop's carried values: (its body's carry-in ids, carry-out ids)
        self.carries: list[tuple[list[int], list[int]]] = []
        # a Var is a function of (aval, repeat) alone: the blocks of a deep model share
        # their values' avals, so each distinct one is described once
        self._described: dict[tuple[Any, int], Var] = {}

    def new(self, aval: Any, repeat: int | None = None) -> int:
        key = (aval, self.repeat if repeat is None else repeat)
        try:
            var = self._described.get(key)
            if var is None:
                var = self._described[key] = _var(aval, key[1])
        except TypeError:  # an aval that cannot be hashed: described afresh
            var = _var(aval, key[1])
        self.vars.append(var)
        return len(self.vars) - 1

    def op(self, eqn: Any, ins: list[int], outs: list[int]) -> None:
        self.ops.append(FlatOp(eqn, ins, outs, self.repeat, self.region))

    def scan(self, eqn: Any, ins: list[int]) -> list[int]:
        """Inline a scan's body once, its ops repeated `length` times."""
        p = eqn.params
        body, (nc, nk) = p["jaxpr"], scan_counts(p)
        inner = body.jaxpr if hasattr(body, "jaxpr") else body
        outer = self.repeat
        self.repeat = outer * max(int(p["length"]), 1)
        slices = []
        for x, v in zip(ins[nc + nk:], inner.invars[nc + nk:], strict=True):
            slices.append(self.new(v.aval))
            self.op(_SLICE, [x], [slices[-1]])
        outs = self.run(body, list(ins[: nc + nk]) + slices)
        if int(p["length"]) > 1:
            self.carries.append((list(ins[nc: nc + nk]), list(outs[:nk])))
        ys = []
        for y, v in zip(outs[nk:], eqn.outvars[nk:], strict=True):
            ys.append(self.new(v.aval, repeat=outer))  # the stacked ys: outside the loop
            self.op(_STACK, [y], [ys[-1]])
        self.repeat = outer
        return list(outs[:nk]) + ys

    def atom(self, a: Any, env: dict[Any, int]) -> int:
        if type(a).__name__ == "Literal":
            return self.new(a.aval)  # a fresh constant, never batched or owned
        return env[a]

    def run(self, jaxpr: Any, in_ids: Sequence[int]) -> list[int]:
        inner = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr
        env: dict[Any, int] = {v: self.new(v.aval) for v in inner.constvars}
        for v, i in zip(inner.invars, in_ids, strict=True):
            env[v] = i
        for eqn in inner.eqns:
            ins = [self.atom(a, env) for a in eqn.invars]
            sub = _sub_jaxpr(eqn)
            if sub is not None and _barriered(eqn):
                outer, self.region = self.region, self.regions
                self.regions += 1
                outs = self.run(sub, ins)
                self.region = outer
            elif sub is not None:
                outs = self.run(sub, ins)
            elif eqn.primitive.name == "scan":
                outs = self.scan(eqn, ins)
            else:
                outs = [self.new(v.aval) for v in eqn.outvars]
                self.op(eqn, ins, outs)
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o
        return [self.atom(a, env) for a in inner.outvars]


# `jax.checkpoint`, as jax names its primitive (jax 0.10: "checkpoint"; older: "remat2")
REMAT_PRIMITIVES = frozenset({"checkpoint", "remat2"})


def _barriered(eqn: Any) -> bool:
    """Whether `eqn` is a differentiated `jax.checkpoint` whose inputs jax lowers through
    an optimization barrier (`prevent_cse`): its recomputation reads values of its own."""
    p = eqn.params
    if eqn.primitive.name not in REMAT_PRIMITIVES or not p.get("differentiated"):
        return False
    cse = p.get("prevent_cse", False)
    return any(cse) if isinstance(cse, tuple) else bool(cse)


def bind(eqn: Any, ins: Sequence[Any]) -> list[Any]:
    """Run one equation on `ins` (values or tracers): its primitive bound with its params,
    its results as a list."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    # jax 0.10 returns the params (call primitives add `subfuns` to them); older versions
    # returned (subfuns, params)
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    outs = eqn.primitive.bind(*subfuns, *ins, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def group_ios(jaxpr: Any, bounds: Sequence[tuple[int, int]]
              ) -> list[tuple[list[Any], list[Any]]]:
    """For each run of equations `(first, past)` in `bounds`: the values equations
    `first:past` of `jaxpr` read from before them, and those they make that a later
    equation or the jaxpr's outputs read, each in first-use order (the inputs and
    outputs of that run as one function). One pass over the jaxpr says what is read last
    where: an unrolled model's 100 layers, each asking what every equation after it
    reads, would read the jaxpr 100 times."""
    end = len(jaxpr.eqns)
    last: dict[Any, int] = {v: end for v in jaxpr.outvars if is_value(v)}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if is_value(v) and last.get(v, -1) < k:
                last[v] = k
    out = []
    for first, past in bounds:
        made: set[Any] = set()
        ins: dict[Any, None] = {}
        for eqn in jaxpr.eqns[first:past]:
            for v in eqn.invars:
                if is_value(v) and v not in made:
                    ins.setdefault(v)
            made.update(eqn.outvars)
        outs = [v for e in jaxpr.eqns[first:past] for v in e.outvars
                if is_value(v) and last.get(v, -1) >= past]
        out.append((list(ins), outs))
    return out


def is_value(v: Any) -> bool:
    """Whether an equation's input or output is a value (not a literal, not dropped):
    only values are read, written, or traced through. (By class name: this module reads
    jaxprs without importing jax.)"""
    return type(v).__name__ not in ("Literal", "DropVar")


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
             run: Callable[[int, Any, list[Any]], list[Any]] | None = None,
             groups: Mapping[int, tuple[int, Callable[[list[Any]], list[Any]]]] | None = None
             ) -> list[Any]:
    """A jaxpr (not closed) run on `args`, equation by equation: `run(index, eqn, inputs)`
    gives each equation's results (`bind` by default). How every jaxwap evaluator of a
    traced step runs it again (`stack` restructuring it, `pins` constraining values inside
    it). `groups` maps a first equation index to `(past, fn)`: equations `first:past` are
    computed at once by `fn` on `group_ios`' inputs, giving its outputs (a checkpointed
    layer of an unrolled model). Equations bind outside their recorded context
    (`eqn.ctx`): it holds the mesh of the trace that made them, not the one they run in."""
    env: dict[Any, Any] = {}
    groups = groups or {}

    def read(v: Any) -> Any:
        return v.val if type(v).__name__ == "Literal" else env[v]

    for v, x in (*zip(jaxpr.constvars, consts, strict=True),
                 *zip(jaxpr.invars, args, strict=True)):
        env[v] = x
    firsts = sorted(groups)
    ios = dict(zip(firsts, group_ios(jaxpr, [(k, groups[k][0]) for k in firsts]),
                   strict=True)) if groups else {}
    k = 0
    while k < len(jaxpr.eqns):
        if k in groups:
            past, fn = groups[k]
            ins, outs = ios[k]
            env.update(zip(outs, fn([env[v] for v in ins]), strict=True))
            k = past
            continue
        eqn = jaxpr.eqns[k]
        ins = [read(v) for v in eqn.invars]
        outs = bind(eqn, ins) if run is None else run(k, eqn, ins)
        for v, x in zip(eqn.outvars, outs, strict=True):
            if type(v).__name__ != "DropVar":
                env[v] = x
        k += 1
    return [read(v) for v in jaxpr.outvars]


def _dce(ops: list[FlatOp], out_ids: Sequence[int],
         carries: Sequence[tuple[list[int], list[int]]] = ()) -> list[FlatOp]:
    """Drop ops whose results reach no output and that have no effects. A loop's body is
    inlined once, so what it carries to its next iteration reads as unused where the
    loop's last carry is: a carried value is needed wherever the body reads its carry-in
    (`carries`), to a fixed point. (Without it, the forward pass a checkpointed stack runs
    again for its backward one was dropped whole: only its carry-ins are stacked for the
    backward scan, so the layers computing the next carry read as dead.)"""
    roots = set(out_ids)
    while True:
        needed = set(roots)
        keep = []
        for op in reversed(ops):
            if getattr(op.eqn, "effects", None) or any(o in needed for o in op.outs):
                keep.append(op)
                needed.update(op.ins)
        more = {o for ins, outs in carries for i, o in zip(ins, outs, strict=True)
                if i in needed and o not in needed}
        if not more:
            keep.reverse()
            return keep
        roots |= more


#: flat programs by the jaxpr they were made from: the analysis and the attention advice
#: flatten the same traced step. A cache, dropped with the jaxpr; its arrays read-only.
_FLAT: weakref.WeakKeyDictionary[Any, FlatProgram] = weakref.WeakKeyDictionary()


def flatten(closed_jaxpr: Any) -> FlatProgram:
    """The step's (closed) jaxpr as a flat, dead-code-free program."""
    try:
        hit = _FLAT.get(closed_jaxpr)
    except TypeError:                  # not weakly referenceable: made each time
        hit = None
    if hit is not None:
        return hit
    fl = _Flattener()
    in_ids = [fl.new(v.aval) for v in closed_jaxpr.jaxpr.invars]
    out_ids = fl.run(closed_jaxpr, in_ids)
    ops = _dce(fl.ops, out_ids, fl.carries)
    V = fl.vars
    prog = FlatProgram(
        vars=tuple(V), ops=tuple(ops), in_ids=tuple(in_ids), out_ids=tuple(out_ids),
        size=np.array([v.size for v in V], dtype=np.int64),
        nbytes=np.array([v.nbytes for v in V], dtype=np.float64),
        on_host=np.array([v.on_host for v in V], dtype=bool))
    for a in (prog.size, prog.nbytes, prog.on_host):
        a.setflags(write=False)
    try:
        _FLAT[closed_jaxpr] = prog
    except TypeError:
        pass
    return prog
