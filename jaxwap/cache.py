"""The plan cache: a plan made once is read back, not searched for again.

Planning a large step (trace, cost analysis, search over meshes and strategies) takes
seconds; the same step on the same hardware asks the same question every run. A plan is
a pure function of what the planner reads, so it is stored under a key that hashes all
of it, and a later run with the same key reads the plan back in about a millisecond.

The key (`plan_key`) is a SHA-256 over a canonical encoding of the parts the caller names
(the step's jaxpr via `jaxpr_fingerprint`, the arguments' paths, shapes, dtypes and
shardings, the devices, the hardware profile, the objective, the memory budget, ...),
plus jaxwap's and jax's versions, which `plan_key` adds itself. Any change to a part
gives another key, so a stale plan is never found: it is simply not looked up.

Storage (`PlanCache`) is one JSON file per key. The cache must never make planning worse
than no cache: an entry that cannot be read back exactly (truncated, not JSON, another
schema, another jaxwap) is treated as absent and removed, and a cache that cannot be
written (read-only, disk full) only warns, once. Writes go to a temporary file that is
then renamed over the entry, so readers, threads and processes see either the old entry,
the new one, or none, never a partial one; that is all the locking it needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from . import __version__ as JAXWAP_VERSION
from .hardware import Cluster, DeviceSpec
from .objective import Objective
from .plan import Plan

# Version of the entry file's layout. Bump it when the layout or the meaning of a key
# changes, so entries written by an older jaxwap read as stale rather than as wrong.
CACHE_FORMAT = 1
# Version of `plan_key`'s encoding; part of every key, so a change to the encoding cannot
# make an old key collide with a new one.
KEY_FORMAT = 1

ENV_VAR = "JAXWAP_CACHE_DIR"

# Entry names are used as file names: keep them to a safe alphabet (no separators, no
# dots, so no "..", no hidden files), which plan_key's hex digests satisfy.
_KEY_RE = re.compile(r"[0-9A-Za-z_-]{1,128}")
# ` at 0x7f...` is how Python's default repr shows an object's address; jax already masks
# it in jaxpr parameters, and jaxpr_fingerprint masks any that slips through elsewhere.
_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+")


class PlanCacheWarning(UserWarning):
    """The plan cache could not be written; planning goes on without it."""


# --------------------------------------------------------------------------- keys
def jaxpr_fingerprint(closed_jaxpr: Any) -> str:
    """SHA-256 hex digest of the step's jaxpr text.

    The text is what the planner reads (ops, shapes, dtypes, literals, nested jaxprs in
    full) and nothing that varies between runs: variables are named in order of
    appearance, callables by their name, and jax masks object addresses in equation
    parameters (`<function f at 0xXXXX>`). Checked on jax 0.10.2 with flax MLP and VGG-16
    train steps traced in two processes with different hash seeds: identical text.
    Addresses anywhere else are masked here too, as a safeguard. The values of closed-over
    arrays are not part of the text (only their shapes; scalars appear as literals),
    which is right: the plan depends on shapes, not values.
    """
    text = _ADDRESS_RE.sub(" at 0x?", str(closed_jaxpr))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def plan_key(**parts: Any) -> str:
    """SHA-256 hex digest identifying a planning question; equal parts give equal keys in
    any process, any part that differs gives another key.

    Name every input the plan depends on, e.g. (as `make_plan` would)::

        plan_key(jaxpr=jaxpr_fingerprint(closed),
                 args=list(zip(layout.inputs.paths, layout.inputs.avals,
                               layout.inputs.roles)),  # paths, avals with shardings, roles
                 params=layout.params,                 # paths name the plan's entries
                 devices=devs, hardware=cluster, objective=obj,
                 memory_budget=budget, num_devices=num_devices, verify=verify,
                 donate=donate, compiler_options=compiler_options,
                 xla_flags=os.environ.get("XLA_FLAGS"))  # verify compiles: flags count

    The jaxpr alone is not enough: it has no argument names (the plan records each
    parameter's path) nor which leaves are parameters. jaxwap's, jax's and jaxlib's
    versions are added here, so callers need not pass them.

    Values may be:
      - None, bool, int, float, str, bytes, numpy scalars; list / tuple (the same
        sequence either way), dict with str keys (order ignored), set / frozenset;
      - `jaxwap.Cluster`, `jaxwap.Objective`, `jaxwap.DeviceSpec` (by `to_dict()`);
        other dataclass instances by their compared fields (e.g. planner records such as
        `LeafRole`, `ParamInfo`); enum members by class and name;
      - dtypes (`np.dtype`, `jnp.float32`, extended dtypes such as PRNG keys);
      - `jax.ShapeDtypeStruct` (shape, dtype, weak_type, sharding), `PartitionSpec`,
        `NamedSharding` (mesh axis names, sizes, types, device ids in mesh order, spec,
        memory kind: its repr omits the device ids, so it is not used),
        `SingleDeviceSharding`, `jax.Device` (id, platform, kind, process);
      - `PyTreeDef`, by its text, unless that text holds an object address.
    Anything else raises TypeError: a repr such as `<object at 0x...>` differs between
    runs and would make every key new (or, reused, wrong), so it is refused rather than
    guessed at. Convert such values to the above first.

    Numbers keep their type: 1 and 1.0 give different keys, so pass resolved values
    (e.g. the memory budget as the float the planner uses). A miss costs one planning,
    a false hit a wrong plan, so the encoding errs on the side of misses.
    """
    h = hashlib.sha256()
    _encode({"key_format": KEY_FORMAT, "jaxwap": JAXWAP_VERSION, "jax": jax.__version__,
             "jaxlib": jaxlib.__version__, "parts": parts}, h.update)
    return h.hexdigest()


def _encode(x: Any, out: Callable[[bytes], object]) -> None:
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
        _encode(x.item(), out)
    elif isinstance(x, (list, tuple)):
        out(b"l%d[" % len(x))
        for item in x:
            _encode(item, out)
        out(b"]")
    elif isinstance(x, dict):
        for k in x:
            if not isinstance(k, str):
                raise TypeError(f"plan_key: dict keys must be str, got {type(k).__name__} "
                                f"key {k!r}")
        out(b"d%d{" % len(x))
        for k in sorted(x):
            _blob(b"s", k.encode("utf-8"), out)
            _encode(x[k], out)
        out(b"}")
    elif isinstance(x, (set, frozenset)):
        # element order varies with the hash seed: sort the elements' encodings instead
        items = []
        for item in x:
            buf: list[bytes] = []
            _encode(item, buf.append)
            items.append(b"".join(buf))
        out(b"S%d{" % len(items) + b"".join(sorted(items)) + b"}")
    else:
        tag, data = _canonical_object(x)
        _blob(b"o", tag.encode(), out)
        _encode(data, out)


def _blob(tag: bytes, data: bytes, out: Callable[[bytes], object]) -> None:
    out(tag + b"%d:" % len(data) + data)


def _canonical_object(x: Any) -> tuple[str, Any]:
    """(type tag, plain data) for the non-builtin types plan_key accepts."""
    if isinstance(x, (Cluster, Objective, DeviceSpec)):
        return type(x).__name__, x.to_dict()
    if isinstance(x, enum.Enum):
        return "enum", (_qualname(type(x)), x.name)
    if isinstance(x, np.dtype) or _is_extended_dtype(x):
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
        if _ADDRESS_RE.search(text):
            raise TypeError(f"plan_key: this PyTreeDef's text holds an object address, "
                            f"which differs between runs: {text[:200]}")
        return "treedef", text
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return "dataclass:" + _qualname(type(x)), {
            f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.compare}
    raise TypeError(
        f"plan_key cannot encode a {_qualname(type(x))} ({_short_repr(x)}): pass str, "
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


def _is_extended_dtype(x: Any) -> bool:
    if isinstance(x, (np.dtype, type)):
        return False
    try:
        return bool(jax.dtypes.issubdtype(x, jax.dtypes.extended))
    except Exception:  # noqa: BLE001 - arbitrary objects: "not a dtype" is the answer
        return False


def _qualname(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _short_repr(x: Any) -> str:
    try:
        r = repr(x)
    except Exception:  # noqa: BLE001 - only for an error message
        r = "<unrepresentable>"
    return r if len(r) <= 80 else r[:77] + "..."


# --------------------------------------------------------------------------- storage
def default_cache_dir() -> Path:
    """`$JAXWAP_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxwap`, else `~/.cache/jaxwap`.

    Empty variables count as unset, and a relative XDG_CACHE_HOME is ignored, as the XDG
    base-directory specification says.
    """
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "jaxwap"
    return Path.home() / ".cache" / "jaxwap"


class PlanCache:
    """Plans on disk, one `<key>.json` per key, in `directory` (see `default_cache_dir`).

    The directory is resolved once, at construction, and created on the first `put`.
    Nothing is held in memory: every `get` reads the file, so several processes (or a
    person deleting files) share one cache without any coordination.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = (Path(directory).expanduser() if directory is not None
                          else default_cache_dir())
        self._warned = False

    def __repr__(self) -> str:
        return f"PlanCache({str(self.directory)!r})"

    def entry_path(self, key: str) -> Path:
        """Where the entry for `key` lives (whether or not it exists)."""
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(f"plan cache keys are 1-128 characters of [0-9A-Za-z_-] (as "
                             f"plan_key returns), got {key!r}")
        return self.directory / f"{key}.json"

    def get(self, key: str) -> Plan | None:
        """The plan stored under `key`, or None.

        None too for an entry that cannot be trusted: truncated, not JSON, another schema,
        written for another key, by another cache format or jaxwap version, or one that
        `Plan.from_dict` refuses. Such a file is removed (the next `put` rewrites it);
        it is never repaired or partly used. A plan read back has no params treedef, so
        its `param_specs` is a nested dict until the caller puts the treedef back with
        `dataclasses.replace(plan, _treedef=...)`.
        """
        path = self.entry_path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
                stat = os.fstat(f.fileno())
        except OSError:  # absent, or the directory cannot be read: a miss either way
            return None
        try:
            doc = json.loads(data)
            if (not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT
                    or doc.get("jaxwap_version") != JAXWAP_VERSION or doc.get("key") != key
                    or not isinstance(doc.get("plan"), dict)):
                raise ValueError("not a current plan cache entry for this key")
            return Plan.from_dict(doc["plan"])
        except Exception:  # noqa: BLE001 - whatever is wrong with the file, it is not used
            self._discard(path, stat)
            return None

    def put(self, key: str, plan: Plan) -> None:
        """Store `plan` under `key`, replacing any entry.

        Written to a temporary file in the same directory and renamed over the entry
        (`os.replace` is atomic), so no reader ever sees a partial entry, and concurrent
        writers of one key leave one complete entry. There is no fsync: an entry lost or
        cut short by a crash is read as corrupt and dropped, which costs one planning.
        A failure to write (read-only directory, disk full, ...) warns once per cache
        and is otherwise ignored: the cache must not stop a plan from being used.
        """
        path = self.entry_path(key)
        doc = {"format": CACHE_FORMAT, "jaxwap_version": JAXWAP_VERSION, "key": key,
               "plan": plan.to_dict()}
        data = json.dumps(doc, separators=(",", ":")).encode("utf-8")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            if not self._warned:
                self._warned = True
                warnings.warn(f"jaxwap could not write its plan cache in {self.directory} "
                              f"({e}); planning is unaffected but plans will not be reused. "
                              f"Set {ENV_VAR} to a writable directory.",
                              PlanCacheWarning, stacklevel=2)

    def clear(self) -> int:
        """Remove every entry (and temporary files left by interrupted writes); returns
        how many entries were removed. Files that are not the cache's are left alone.

        A `put` running at the same moment in another process may then fail to land,
        which only warns there.
        """
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return 0
        removed = 0
        for name in names:
            is_entry = name.endswith(".json") and _KEY_RE.fullmatch(name[:-5]) is not None
            is_tmp = name.startswith(".") and name.endswith(".tmp")
            if not (is_entry or is_tmp):
                continue
            try:
                os.unlink(self.directory / name)
            except FileNotFoundError:  # removed by someone else meanwhile
                continue
            removed += 1 if is_entry else 0
        return removed

    def _discard(self, path: Path, stat: os.stat_result) -> None:
        """Remove a bad entry, unless it has been replaced since it was read (another
        process may just have written a good one in its place)."""
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_dev) == (stat.st_ino, stat.st_dev):
                os.unlink(path)
        except OSError:
            pass


__all__ = ["CACHE_FORMAT", "ENV_VAR", "KEY_FORMAT", "PlanCache", "PlanCacheWarning",
           "default_cache_dir", "jaxpr_fingerprint", "plan_key"]
