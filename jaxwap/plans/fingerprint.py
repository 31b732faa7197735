"""A structural hash of a jaxpr, part of `plan_key`: equal for equal jaxprs in any process
(any hash seed, any addresses), different when what the planner reads differs.

`jaxpr_fingerprint` walks the jaxpr instead of printing it: printing a GPT-2 step takes
ten times as long as tracing it again, and a cached plan should cost little more than the
trace. Params it meets are written in `key_encoding`'s canonical encoding where that
encoding accepts them (shardings, meshes, dtypes), so the key and the walk agree on them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import core as jcore  # Jaxpr, Var, Literal, ShapedArray: no public home
from jax._src import linear_util, literals
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxwap.plans.key_encoding import ADDRESS_RE, encode, is_extended_dtype, qualname

# --------------------------------------------------------------------------- jaxprs
# Types in a value nest (see `_Walker`): each equal only to itself, printed `@name`.
_Tag = enum.Enum("_Tag", "jaxpr closed aval dtype enum array num float true false dict set "
                 "ntuple fields fn prim canon mesh type repr effects")
_Tag.__repr__ = lambda self: "@" + self.name  # type: ignore[method-assign]
(_JAXPR, _CLOSED, _AVAL, _DTYPE, _ENUM, _ARRAY, _NUM, _FLOAT, _TRUE, _FALSE, _DICT, _SET,
 _TUPLE, _FIELDS, _FN, _PRIM, _CANON, _MESH, _TYPE, _REPR, _EFFECTS) = _Tag

_ATOMS = frozenset([type(None), int, str, bytes])  # values that are their own encoding
_DEVICE_MEMORY = jcore.MemorySpace.Device
_Literal, _DropVar = jcore.Literal, jcore.DropVar
_TypedNdArray = getattr(literals, "TypedNdArray", None)
_Handler = Callable[["_Walker", Any], Any]
_DIGESTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # by jaxpr


def jaxpr_fingerprint(closed_jaxpr: Any) -> str:
    """SHA-256 hex digest of a (closed) jaxpr's structure: what the planner reads.

    Per equation: primitive, params (sorted), inputs (variables by number in order of
    binding, literals by value and type), outputs' types (shape, dtype, weak type, and
    where set the sharding spec, varying / unreduced axes, memory space); nested jaxprs
    by their digest. Callables count by name, never by address; closed-over arrays by
    type, not value (a plan depends on shapes only). Jaxprs are immutable, and jax hands
    back the same object for a step traced again: digests are kept while it lives.
    """
    if isinstance(closed_jaxpr, jcore.ClosedJaxpr):
        closed_jaxpr = closed_jaxpr.jaxpr
    elif not isinstance(closed_jaxpr, jcore.Jaxpr):
        raise TypeError(f"jaxpr_fingerprint takes a ClosedJaxpr or a Jaxpr (as "
                        f"jax.make_jaxpr returns), got {qualname(type(closed_jaxpr))}")
    return _Walker().digest(closed_jaxpr)


class _Walker:
    """One fingerprint's state. A jaxpr becomes tables (the types, operations, literals it
    uses, in order of first use) and a stream of ints, hashed once. Table entries are
    value nests: None, int, str, bytes, and tuples, `_Tag`-led for other types (bool and
    float too), whose reprs are canonical and whose == holds only between equal reprs, so
    dicts intern them. `memo`: id -> (object, encoding) of avals (jax shares them: GPT-2
    has 6,000 outputs, 55 avals) and costly params; holding the object keeps its id."""

    __slots__ = ("memo",)

    def __init__(self) -> None:
        self.memo: dict[int, tuple[Any, Any]] = {}

    def digest(self, jaxpr: Any) -> str:
        return _DIGESTS.get(jaxpr) or _DIGESTS.setdefault(jaxpr, self.jaxpr(jaxpr))

    def jaxpr(self, jaxpr: Any) -> str:
        """Hash of the tables and the stream: the binders' types; per equation its
        operation (whose table entry has its arity), its inputs (a variable's number, or
        -1 - i for literal i), its outputs' types (-1 - i when dropped); the outputs."""
        num: dict[Any, int] = {}  # variable -> number, in order of binding
        types: dict[Any, int] = {}  # aval's encoding -> index in this jaxpr's table
        local: dict[int, int] = {}  # id(aval) -> the same index
        ops: dict[Any, int] = {}  # operation's encoding -> index
        seen: dict[Any, int] = {}  # operation as found (params by ==, types) -> index
        lits: dict[Any, int] = {}
        conv, atom, type_of, atoms, exact = self.conv, self.atom, self.type_of, _ATOMS, _EQ_EXACT
        binders = (*jaxpr.constvars, *jaxpr.invars)
        stream: list[int] = [type_of(v.aval, types, local) for v in binders]
        num.update((v, i) for i, v in enumerate(binders))
        append = stream.append
        for e in jaxpr.eqns:  # inlined by hand: this loop is most of the time
            p, ins, outs = e.params, e.invars, e.outvars
            raw = op = None
            if not e.effects:  # params as found, with their types
                try:  # TypeError: unhashable, e.g. a tuple holding a list
                    op = seen.get(raw := (e.primitive, len(ins), len(outs), *p.items(),
                                          *map(type, p.values())))
                except TypeError:
                    raw = None
            if op is None:
                key: tuple[Any, ...] = (e.primitive.name, len(ins), len(outs), tuple([
                    (k, v if v.__class__ in atoms else conv(v)) for k, v in sorted(p.items())]))
                if e.effects:
                    key += (self.effects(e.effects),)
                op = ops.setdefault(key, len(ops))
                if raw is not None and exact.issuperset(raw[3 + len(p):]):
                    seen[raw] = op  # equal params of these types have equal encodings
            append(op)
            try:
                stream += [num[a] if a.__class__ is not _Literal else atom(a, num, types, local,
                                                                           lits) for a in ins]
            except KeyError:  # a variable bound nowhere (not expected)
                stream += [atom(a, num, types, local, lits) for a in ins]
            for v in outs:
                num[v] = len(num)
                i = local.get(id(v.aval))
                if i is None:
                    i = type_of(v.aval, types, local)
                append(i if v.__class__ is not _DropVar else -1 - i)
        stream += [atom(a, num, types, local, lits) for a in jaxpr.outvars]
        data = np.asarray(stream, "<i4").tobytes()  # OverflowError past 2**31 variables
        head = repr((_JAXPR, len(jaxpr.constvars), len(jaxpr.invars), len(jaxpr.eqns),
                     len(jaxpr.outvars), self.effects(jaxpr.effects) if jaxpr.effects else None,
                     list(types), list(ops), list(lits))).encode("utf-8", "surrogatepass")
        return hashlib.sha256(b"%d:%s%s" % (len(head), head, data)).hexdigest()

    def atom(self, a: Any, num: dict[Any, int], types: dict[Any, int],
             local: dict[int, int], lits: dict[Any, int]) -> int:
        """A variable's number (new if unbound, not expected), or -1 - the literal's index
        in the jaxpr's table of (value, type)."""
        if a.__class__ is not _Literal:
            return num[a] if a in num else num.setdefault(a, len(num))
        v, aval = a.val, a.aval
        fast = v.__class__ is _TypedNdArray and v.dtype is aval.dtype and v.shape == aval.shape
        value = v.tobytes() if fast else self.conv(v)  # fast: dtype and shape in the type
        i = local.get(id(aval))
        key = (value, i if i is not None else self.type_of(aval, types, local))
        return -1 - lits.setdefault(key, len(lits))

    def type_of(self, a: Any, types: dict[Any, int], local: dict[int, int]) -> int:
        """a's index in the jaxpr's table of types (by value), added if new."""
        i = local[id(a)] = types.setdefault(self.memoised(a, self.aval), len(types))
        return i

    def aval(self, a: Any) -> tuple[Any, ...]:
        """Shape, dtype, weak type, and where set what else `str(aval)` shows: sharding
        spec (and mesh), memory space (host offload), varying / unreduced axes."""
        if a.__class__ is not jcore.ShapedArray:  # tokens, refs, ...: rare and short
            return (_AVAL, qualname(type(a)), ADDRESS_RE.sub(" at 0x?", str(a)))
        code = (a.shape, _dtype_name(a.dtype), _TRUE if a.weak_type else _FALSE)
        sharding = _sharding_extra(a.sharding)
        mat, ms = a.manual_axis_type, a.memory_space
        if sharding is not None or ms is not _DEVICE_MEMORY or not mat.empty:
            code += (sharding, None if ms is _DEVICE_MEMORY else ms.name, None if mat.empty
                     else tuple(tuple(sorted(s)) for s in (mat.varying, mat.unreduced,
                                                           mat.reduced)))
        return code

    def effects(self, effects: Any) -> tuple[Any, ...]:
        return (_EFFECTS, tuple(sorted((self.conv(e) for e in effects), key=repr)))

    def conv(self, v: Any) -> Any:
        """A param value as a value nest (see the class docstring)."""
        t = type(v)
        if t in _ATOMS:
            return v
        handler = _HANDLERS.get(t)
        if handler is None:
            handler, exact = _resolve(t, v)
            _HANDLERS[t] = handler
            if exact:
                _EQ_EXACT.add(t)
        return handler(self, v)

    def memoised(self, v: Any, make: Callable[[Any], Any]) -> Any:
        hit = self.memo.get(id(v))
        if hit is None:
            hit = self.memo[id(v)] = (v, make(v))
        return hit[1]


# --------------------------------------------------------------------------- values
@functools.cache  # hashing a dtype is cheaper than printing it
def _dtype_name(dtype: Any) -> str:
    return str(dtype)


def _sharding_extra(s: Any) -> Any:
    """None for an aval's default sharding (no named axes), else its spec and mesh."""
    spec = getattr(s, "spec", None)
    if isinstance(s, NamedSharding) and isinstance(spec, PartitionSpec):
        if (all(e is None for e in spec) and not spec.unreduced and not spec.reduced
                and s.memory_kind is None):
            return None
        return (_canon(spec), _mesh(s.mesh), s.memory_kind)
    return (_REPR, qualname(type(s)), ADDRESS_RE.sub(" at 0x?", repr(s)))


def _canon(x: Any) -> tuple[Any, bytes]:
    buf: list[bytes] = []
    encode(x, buf.append)
    return (_CANON, b"".join(buf))


def _mesh(m: Any) -> tuple[Any, ...]:
    """As `key_encoding.canonical_object` has a NamedSharding's mesh (device ids if it has
    them)."""
    ids = (tuple(int(d.id) for d in m.devices.flat if d is not None)  # Mesh(): a None
           if isinstance(m, Mesh) else None)
    return (_MESH, tuple(m.axis_names), tuple(m.axis_sizes),
            tuple(str(t) for t in m.axis_types), ids)


def _repr_fallback(w: _Walker, v: Any) -> Any:
    """Any other object: type and repr, addresses masked, so that an unknown param still
    fingerprints the same in every run (rare: see `_resolve`)."""
    return w.memoised(v, lambda x: (_REPR, qualname(type(x)),
                                    ADDRESS_RE.sub(" at 0x?", repr(x))))


def _seq(w: _Walker, v: Any) -> Any:
    if _ATOMS.issuperset(map(type, v)):  # most: shapes, axes, ...
        return v if type(v) is tuple else tuple(v)
    return tuple([w.conv(x) for x in v])  # a list and a tuple alike, as in plan_key


def _fn_name(v: Any) -> Any:
    if isinstance(v, functools.partial):
        return (_fn_name(v.func), len(v.args), tuple(sorted(v.keywords)))
    name = getattr(v, "__qualname__", None) or getattr(v, "__name__", None)
    return name if isinstance(name, str) else qualname(type(v))


def _function(w: _Walker, v: Any) -> Any:
    """By name only: a closure's identity differs between traces, and what it computes is
    in the jaxprs beside it (the thunks of custom_jvp_call / custom_vjp_call)."""
    return (_FN, qualname(type(v)), _fn_name(v))


def _dtype(w: _Walker, v: Any) -> Any:
    return (_DTYPE, _dtype_name(v))


def _canonical(w: _Walker, v: Any) -> Any:
    try:  # canonical_object refuses e.g. a class, a PyTreeDef whose text holds an address
        return w.memoised(v, _canon)
    except (TypeError, AttributeError):
        return _repr_fallback(w, v)


def _number(w: _Walker, x: Any) -> Any:
    """A subclass of int, float, ...: jax's TypedInt, TypedFloat (with a dtype)."""
    base = next(b for b in (int, float, complex, str, bytes) if isinstance(x, b))
    return (_NUM, qualname(type(x)), w.conv(base(x)), _dtype_name(getattr(x, "dtype", None)))


def _resolve(t: type, v: Any) -> tuple[_Handler, bool]:
    """The handler for values of type t, and whether equal (==) values of type t always
    have equal encodings, as `_EQ_EXACT` records (not so for floats: -0.0 == 0.0)."""
    if issubclass(t, tuple) and hasattr(t, "_fields"):  # ConvDimensionNumbers, ...
        return (lambda w, x: w.memoised(x, lambda y: (
            _TUPLE, qualname(type(y)), tuple(y._fields), _seq(w, y)))), True
    for kinds, handler, exact in _KINDS:
        if issubclass(t, kinds):
            return handler, exact
    if is_extended_dtype(v):
        return _dtype, True
    if dataclasses.is_dataclass(t):  # e.g. checkpoint policies, effects
        return (lambda w, x: w.memoised(x, lambda y: (_FIELDS, qualname(type(y)), tuple(
            (f.name, w.conv(getattr(y, f.name))) for f in dataclasses.fields(y)
            if f.compare)))), False
    if t.__name__ == "UnspecifiedValue":  # jax's stateless "no sharding given" marker
        return (lambda w, x: (_TYPE, qualname(type(x)))), True
    if callable(v) and isinstance(getattr(v, "__name__", None), str):
        return _function, True
    return _repr_fallback, False


_KINDS: tuple[tuple[Any, _Handler, bool], ...] = (  # in order: the first that matches
    (jcore.ClosedJaxpr, lambda w, x: (_CLOSED, w.digest(x.jaxpr)), True),  # consts: types
    (jcore.Jaxpr, lambda w, x: (_JAXPR, w.digest(x)), True),
    (enum.Enum, lambda w, x: (_ENUM, qualname(type(x)), x.name), True),  # IntEnum: an int
    ((np.integer, np.bool_), lambda w, x: w.conv(x.item()), True),
    (np.generic, lambda w, x: w.conv(x.item()), False),
    (np.ndarray, lambda w, x: (_ARRAY, _dtype_name(x.dtype), x.shape,
                               x.tobytes() if x.nbytes <= 4096 else None), False),  # small
    (np.dtype, _dtype, True),
    ((tuple, list), _seq, False),
    (dict, lambda w, x: (_DICT, tuple(sorted(
        ((w.conv(k), w.conv(y)) for k, y in x.items()), key=lambda ky: repr(ky[0])))), False),
    ((set, frozenset), lambda w, x: (_SET, tuple(sorted(map(w.conv, x), key=repr))), False),
    ((int, float, complex, str, bytes), _number, False),
    ((type, PartitionSpec, NamedSharding, SingleDeviceSharding, jax.Device,  # np.float32:
      jax.ShapeDtypeStruct, jax.tree_util.PyTreeDef), _canonical, True),  # a dtype
    (jcore.Primitive, lambda w, x: (_PRIM, x.name), True),
    (jcore.AbstractValue, lambda w, x: w.aval(x), False),
    ((Mesh, jax.sharding.AbstractMesh), lambda w, x: w.memoised(x, _mesh), True),
    ((types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial,
      linear_util.WrappedFun), _function, True),
)
_HANDLERS: dict[type, _Handler] = {
    tuple: _seq, list: _seq, bool: lambda w, x: _TRUE if x else _FALSE,
    float: lambda w, x: (_FLOAT, float.hex(x))}
# Param types whose == implies equal encodings, given the type (True == 1 is told apart by
# type). Tuples compare items by ==, so (1,) and (1.0,) would share an encoding within one
# jaxpr: jax's tuple params hold ints, bools and strs, never floats.
_EQ_EXACT: set[type] = {type(None), bool, int, str, bytes, tuple}


__all__ = ["jaxpr_fingerprint"]
