"""The canonical encoding behind `plan_key`: any value a planning question names, written
as a self-delimiting, type-tagged byte string that is equal for equal inputs in any
process (any hash seed, any addresses) and differs for different ones.

Apart from `fingerprint.py` (the jaxpr's structural hash), which uses it for the params
it can encode: the cache key and the jaxpr walk are two concepts sharing one encoding. A
low module: of jaxwap it imports hardware and objective (`canonical_object`).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxwap.core.objective import Objective
from jaxwap.hardware.cluster import Cluster
from jaxwap.hardware.device import DeviceSpec

__all__ = ["ADDRESS_RE", "canonical_object", "encode", "is_extended_dtype", "qualname"]

# ` at 0x7f...`: an object's address in Python's default repr, which differs between runs
ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+")


def encode(x: Any, out: Callable[[bytes], object]) -> None:
    """Write x as a self-delimiting, type-tagged byte string: no two different values (of
    the types accepted) share an encoding, and equal values always have the same one."""
    if x is None:
        out(b"N")
    elif isinstance(x, bool):
        out(b"T" if x else b"F")
    elif isinstance(x, int):
        out(b"i%d;" % x)
    elif isinstance(x, float):
        out(b"f" + float.hex(x).encode() + b";")  # exact; nan/inf spelled out
    elif isinstance(x, str):
        _blob(b"s", x.encode("utf-8"), out)
    elif isinstance(x, bytes):
        _blob(b"b", x, out)
    elif isinstance(x, np.generic):
        encode(x.item(), out)
    elif isinstance(x, (list, tuple)):
        out(b"l%d[" % len(x))
        for item in x:
            encode(item, out)
        out(b"]")
    elif isinstance(x, dict):
        for k in x:
            if not isinstance(k, str):
                raise TypeError(f"plan_key: dict keys must be str, got {type(k).__name__} "
                                f"key {k!r}")
        out(b"d%d{" % len(x))
        for k in sorted(x):
            _blob(b"s", k.encode("utf-8"), out)
            encode(x[k], out)
        out(b"}")
    elif isinstance(x, (set, frozenset)):
        # element order varies with the hash seed: sort the elements' encodings instead
        items = []
        for item in x:
            buf: list[bytes] = []
            encode(item, buf.append)
            items.append(b"".join(buf))
        out(b"S%d{" % len(items) + b"".join(sorted(items)) + b"}")
    else:
        tag, data = canonical_object(x)
        _blob(b"o", tag.encode(), out)
        encode(data, out)


def _blob(tag: bytes, data: bytes, out: Callable[[bytes], object]) -> None:
    out(tag + b"%d:" % len(data) + data)


def canonical_object(x: Any) -> tuple[str, Any]:
    """(type tag, plain data) for the non-builtin types plan_key accepts."""
    if isinstance(x, (Cluster, Objective, DeviceSpec)):
        return type(x).__name__, x.to_dict()
    if isinstance(x, enum.Enum):
        return "enum", (qualname(type(x)), x.name)
    if isinstance(x, np.dtype) or is_extended_dtype(x):
        return "dtype", str(x)
    if isinstance(x, type) and (issubclass(x, np.generic) or hasattr(x, "dtype")):
        try:  # scalar types: np.float32, jnp.bfloat16
            return "dtype", str(np.dtype(x))
        except TypeError:
            pass
    if isinstance(x, jax.ShapeDtypeStruct):
        return "aval", {"shape": tuple(int(d) for d in x.shape), "dtype": str(x.dtype),
                        "weak_type": bool(getattr(x, "weak_type", False)),
                        "sharding": x.sharding}
    if isinstance(x, PartitionSpec):
        return "spec", {"partitions": tuple(_spec_entry(e) for e in x),
                        "unreduced": frozenset(x.unreduced), "reduced": frozenset(x.reduced)}
    if isinstance(x, NamedSharding):
        mesh = x.mesh
        ids = [int(d.id) for d in mesh.devices.flat] if isinstance(mesh, Mesh) else None
        return "named_sharding", {
            "axis_names": tuple(mesh.axis_names), "axis_sizes": tuple(mesh.axis_sizes),
            "axis_types": tuple(str(t) for t in mesh.axis_types), "device_ids": ids,
            "spec": x.spec, "memory_kind": x.memory_kind}
    if isinstance(x, SingleDeviceSharding):
        (device,) = x.device_set
        return "single_device_sharding", {"device": device, "memory_kind": x.memory_kind}
    if isinstance(x, jax.Device):
        return "device", {"id": int(x.id), "platform": x.platform, "kind": x.device_kind,
                          "process_index": int(x.process_index)}
    if isinstance(x, jax.tree_util.PyTreeDef):
        text = str(x)
        if ADDRESS_RE.search(text):
            raise TypeError(f"plan_key: this PyTreeDef's text holds an object address, "
                            f"which differs between runs: {text[:200]}")
        return "treedef", text
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return "dataclass:" + qualname(type(x)), {
            f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.compare}
    raise TypeError(
        f"plan_key cannot encode a {qualname(type(x))} ({_short_repr(x)}): pass str, "
        f"numbers, None, bools, lists/tuples, dicts with str keys, jaxwap.Cluster / "
        f"Objective, dataclasses, dtypes, ShapeDtypeStruct, PartitionSpec, NamedSharding "
        f"or devices, or convert it to one of those (see plan_key's docstring)")


def _spec_entry(e: Any) -> Any:
    if e is None or isinstance(e, str):
        return e
    if isinstance(e, tuple):
        return tuple(e)
    if e is PartitionSpec.UNCONSTRAINED:
        return ("UNCONSTRAINED",)  # a 1-tuple of this text cannot be a real entry
    raise TypeError(f"plan_key: unexpected PartitionSpec entry {e!r}")


def is_extended_dtype(x: Any) -> bool:
    """Whether x is one of jax's extended dtypes (a PRNG key's): numpy does not know
    them, so they are told apart by asking jax, and anything jax refuses is not one."""
    if isinstance(x, (np.dtype, type)):
        return False
    try:
        return bool(jax.dtypes.issubdtype(x, jax.dtypes.extended))
    except Exception:  # noqa: BLE001 - arbitrary objects: "not a dtype" is the answer
        return False


def qualname(t: type) -> str:
    """A type by module and qualified name: stable across runs, unlike its repr's id."""
    return f"{t.__module__}.{t.__qualname__}"


def _short_repr(x: Any) -> str:
    try:
        r = repr(x)
    except Exception:  # noqa: BLE001 - only for an error message
        r = "<unrepresentable>"
    return r if len(r) <= 80 else r[:77] + "..."

