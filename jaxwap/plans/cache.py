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
import hashlib
import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import jax
import jaxlib

from jaxwap.core.paths import ENV_VAR, default_cache_dir
from jaxwap.core.version import __version__ as JAXWAP_VERSION
from jaxwap.plans.key_encoding import encode
from jaxwap.plans.plan import Plan

# Version of the entry file's layout. Bump it when the layout or the meaning of a key
# changes, so entries written by an older jaxwap read as stale rather than as wrong.
CACHE_FORMAT = 1
# Version of `plan_key`'s encoding; part of every key, so a change to the encoding cannot
# make an old key collide with a new one. 2: the `jaxpr` part, `jaxpr_fingerprint`, is now
# a hash of the jaxpr's structure (fingerprint.py), no longer of its printed text; a part
# whose meaning changes gets a new format, so no key made under the old meaning can match.
# 3: plans made before column splits XLA does not keep were withheld (`Graph.tp_leaks`),
# unpaired row-parallel layers refused, and leaf roles settled by what the step hands
# back may hold layouts and roles this planner no longer makes: they are planned again.
# 4: the memory model counts the optimizer's update in place and the combined gradient
# reduction's copy, and the time model the convolution kernels' layout changes: plans
# made before hold other predictions (and, under memory pressure, other layouts).
# 5: fused elementwise ops and reductions move only what crosses a fusion's edge,
# narrow convolutions have a rate of their own, and compiled figures count library calls
# (XLA:GPU): plans made before were ranked on other times.
# 6: on XLA:CPU a reduction is priced at what it reduces wherever its input was made, a
# kernel-gradient convolution's operand copies are priced, and so are the slower path of
# matmuls contracting both operands' leading dims and a generic-loop convolution at the
# kernel a device holds; max pooling and its gradient are priced on every backend:
# other times again.
# 7: a bias is split with its column-parallel kernel (`tp_chain.biases_follow`): plans made
# before left it whole, which XLA gathers after every update.
# 8: a data-sharded parameter is priced at every gather XLA makes of it and of the values
# computed from it (`fsdp_gathers.fsdp_gathers`), a norm's scale gathered first; XLA:CPU's copies
# around batched matmuls are priced (`grad_reductions.dot_relayouts`): other times again.
KEY_FORMAT = 8

# Entry names are used as file names: keep them to a safe alphabet (no separators, no
# dots, so no "..", no hidden files), which plan_key's hex digests satisfy.
_KEY_RE = re.compile(r"[0-9A-Za-z_-]{1,128}")


class PlanCacheWarning(UserWarning):
    """The plan cache could not be written, or held an entry that cannot be used here;
    planning goes on without it."""


# --------------------------------------------------------------------------- keys
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
    encode({"key_format": KEY_FORMAT, "jaxwap": JAXWAP_VERSION, "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "parts": parts}, h.update)
    return h.hexdigest()


# --------------------------------------------------------------------------- storage
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

    def drop(self, key: str, why: str) -> None:
        """Remove the entry for `key`, which reads back but cannot be used (`why`: what is
        wrong with it, e.g. a mesh larger than the devices present), warning once per entry
        with its file, so the caller plans afresh and the next `put` replaces it."""
        path = self.entry_path(key)
        warnings.warn(f"jaxwap dropped the plan cache entry {path}: {why}; planning afresh",
                      PlanCacheWarning, stacklevel=3)
        with contextlib.suppress(OSError):
            os.unlink(path)

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
           "default_cache_dir", "plan_key"]
