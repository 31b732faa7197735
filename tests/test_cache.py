"""The plan cache: what goes in comes back equal; anything untrustworthy on disk reads as
a miss and is removed; a cache that cannot be written never stops planning; the key
changes with every part and with nothing else, in this process and in another one."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxwap
from jaxwap.core.paths import default_cache_dir
from jaxwap.plans import cache as cache_mod
from jaxwap.plans.cache import CACHE_FORMAT, PlanCache, PlanCacheWarning, plan_key
from jaxwap.plans.fingerprint import jaxpr_fingerprint

TESTS = Path(__file__).resolve().parent


@functools.cache
def tiny_plan() -> jaxwap.Plan:
    """A real plan of a tiny flax MLP. Not verified by compiling (seconds, and the JSON
    round trip of the compiled figures is test_plan_record's): the cache stores whatever
    `Plan.to_dict` gives."""
    step, params, opt_state, batch = models.abstract_setup((16, 8, 4), 16, 8)
    return jaxwap.plan(step, params, opt_state, batch,
                       hardware=jaxwap.Cluster("h100-sxm", 8), verify=0)


@functools.cache
def vgg_sized_plan() -> jaxwap.Plan:
    """The tiny plan grown to VGG size: 40 parameters, 15 candidates."""
    plan = tiny_plan()
    params = tuple(dataclasses.replace(plan.params[i % len(plan.params)],
                                       path=(f"layer_{i}", "kernel"),
                                       keystr=f"['layer_{i}']['kernel']")
                   for i in range(40))
    cands = tuple(plan.candidates[i % len(plan.candidates)] for i in range(15))
    return dataclasses.replace(plan, params=params, candidates=cands)


def mlp_jaxpr(widths=(16, 8, 4)):
    step, params, opt_state, batch = models.abstract_setup(widths, 16, 8)
    return jax.make_jaxpr(step)(params, opt_state, batch)


@functools.cache
def mlp_fingerprint(widths=(16, 8, 4)) -> str:
    return jaxpr_fingerprint(mlp_jaxpr(widths))


KEY = plan_key(test="entry")
OTHER_KEY = plan_key(test="other entry")


# --------------------------------------------------------------------------- round trip
def test_put_then_get_returns_an_equal_plan(tmp_path):
    plan = tiny_plan()
    cache = PlanCache(tmp_path / "c")
    assert cache.get(KEY) is None
    assert not (tmp_path / "c").exists()  # created on the first write, not by a read
    cache.put(KEY, plan)
    got = cache.get(KEY)
    assert got == plan
    assert got.params == plan.params and got.candidates == plan.candidates
    assert got.planning_time_s == plan.planning_time_s
    assert cache.get(OTHER_KEY) is None
    # one file, the entry, with the documented schema; no temporary file left behind
    assert [p.name for p in (tmp_path / "c").iterdir()] == [f"{KEY}.json"]
    doc = json.loads(cache.entry_path(KEY).read_text())
    assert doc == {"format": CACHE_FORMAT, "jaxwap_version": jaxwap.__version__,
                   "key": KEY, "plan": plan.to_dict()}


def test_put_replaces_an_entry(tmp_path):
    cache = PlanCache(tmp_path)
    plan = tiny_plan()
    other = dataclasses.replace(plan, notes=("another",))
    cache.put(KEY, plan)
    cache.put(KEY, other)
    assert cache.get(KEY) == other
    assert len(list(tmp_path.iterdir())) == 1


def test_a_vgg_sized_plan_is_read_back_equal_every_time(tmp_path):
    """A plan with VGG-16's leaves survives the file whole, on every read (how fast a read
    is belongs to benchmarks/planning/plan_time.py, not to a timer here)."""
    cache = PlanCache(tmp_path)
    plan = vgg_sized_plan()
    cache.put(KEY, plan)
    for _ in range(3):
        got = cache.get(KEY)
        assert got == plan


def test_concurrent_puts_and_gets_never_see_a_partial_entry(tmp_path):
    cache = PlanCache(tmp_path)
    plan = tiny_plan()
    seen, errors = [], []

    def work() -> None:
        try:
            for _ in range(15):
                cache.put(KEY, plan)
                seen.append(cache.get(KEY))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(p == plan for p in seen)
    assert [p.name for p in tmp_path.iterdir()] == [f"{KEY}.json"]


# --------------------------------------------------------------------------- bad entries
def write_entry(cache: PlanCache, key: str, content: bytes | str | dict) -> Path:
    path = cache.entry_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, dict):
        content = json.dumps(content)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def good_doc(key: str = KEY) -> dict:
    return {"format": CACHE_FORMAT, "jaxwap_version": jaxwap.__version__, "key": key,
            "plan": tiny_plan().to_dict()}


def test_truncated_entry_is_a_miss_removed_and_rewritten_by_the_next_put(tmp_path):
    cache = PlanCache(tmp_path)
    plan = tiny_plan()
    cache.put(KEY, plan)
    path = cache.entry_path(KEY)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert cache.get(KEY) is None
    assert not path.exists()
    cache.put(KEY, plan)
    assert path.read_bytes() == data
    assert cache.get(KEY) == plan


def stale(field, value):
    doc = good_doc()
    doc[field] = value
    return doc


def broken_plan():
    doc = good_doc()
    del doc["plan"]["candidates"]
    return doc


def other_plan_format():
    doc = good_doc()
    doc["plan"]["format"] = 999
    return doc


BAD_ENTRIES = {
    "empty": lambda: b"",
    "garbage": lambda: b"\x00\xff not json at all {",
    "not utf-8": lambda: b'{"format": 1, "key": "\xff\xfe"}',
    "json list": lambda: "[1, 2, 3]",
    "json null": lambda: "null",
    "no plan": lambda: {k: v for k, v in good_doc().items() if k != "plan"},
    "plan not a dict": lambda: stale("plan", [1]),
    "inner key differs": lambda: good_doc(OTHER_KEY),
    "stale jaxwap version": lambda: stale("jaxwap_version", "0.0.1"),
    "stale cache format": lambda: stale("format", CACHE_FORMAT + 1),
    "plan fields missing": broken_plan,
    "Plan.from_dict refuses": other_plan_format,
}


@pytest.mark.parametrize("name", sorted(BAD_ENTRIES))
def test_an_untrustworthy_entry_is_a_miss_and_is_removed(tmp_path, name):
    cache = PlanCache(tmp_path)
    path = write_entry(cache, KEY, BAD_ENTRIES[name]())
    assert cache.get(KEY) is None
    assert not path.exists()
    cache.put(KEY, tiny_plan())  # and the cache heals
    assert cache.get(KEY) == tiny_plan()


def test_the_good_document_helper_is_a_hit(tmp_path):
    # guards the test above: its entries are bad for the reason named, not for another
    cache = PlanCache(tmp_path)
    write_entry(cache, KEY, good_doc())
    assert cache.get(KEY) == tiny_plan()


def test_stale_version_follows_the_running_jaxwap(tmp_path, monkeypatch):
    cache = PlanCache(tmp_path)
    cache.put(KEY, tiny_plan())
    monkeypatch.setattr(cache_mod, "JAXWAP_VERSION", "99.0.0")
    assert cache.get(KEY) is None
    assert not cache.entry_path(KEY).exists()


def test_keys_are_checked_so_they_cannot_name_other_files(tmp_path):
    cache = PlanCache(tmp_path)
    for bad in ("", "../escape", "a/b", ".hidden", "x" * 129, "key.json"):
        with pytest.raises(ValueError):
            cache.entry_path(bad)


# --------------------------------------------------------------------------- failures
def test_unreadable_directory_is_a_miss(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert PlanCache(blocker / "cache").get(KEY) is None
    assert blocker.read_text() == "not a directory"


def test_put_that_cannot_write_warns_once_and_does_not_raise(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cache = PlanCache(blocker / "cache")
    with pytest.warns(PlanCacheWarning, match="could not write"):
        cache.put(KEY, tiny_plan())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.put(KEY, tiny_plan())  # the second failure is silent
    assert cache.get(KEY) is None


def test_read_only_directory_does_not_raise_and_keeps_its_entries(tmp_path, monkeypatch):
    """A directory the process may not write (a shared, read-only cache). Simulated: the
    temporary file is refused with the PermissionError the OS raises there, because root,
    as in CI's containers, ignores permission bits, and a chmod test would be skipped."""
    import jaxwap.plans.cache as cache_module

    cache = PlanCache(tmp_path)
    old = tiny_plan()
    cache.put(KEY, old)
    before = sorted(p.name for p in tmp_path.iterdir())

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(kwargs.get("dir", tmp_path)))

    monkeypatch.setattr(cache_module.tempfile, "mkstemp", refuse)
    with pytest.warns(PlanCacheWarning, match="could not write"):
        cache.put(KEY, vgg_sized_plan())
    assert cache.get(KEY) == old   # what was there is still read
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_failed_replace_leaves_the_old_entry_and_no_temporary_file(tmp_path, monkeypatch):
    """A disk-full or similar failure mid-write: the old entry stays whole."""
    cache = PlanCache(tmp_path)
    plan = tiny_plan()
    cache.put(KEY, plan)

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_mod.os, "replace", disk_full)
    with pytest.warns(PlanCacheWarning, match="No space left"):
        cache.put(KEY, dataclasses.replace(plan, notes=("newer",)))
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == [f"{KEY}.json"]
    assert cache.get(KEY) == plan


def test_clear_removes_entries_and_leftovers_only(tmp_path):
    cache = PlanCache(tmp_path)
    assert PlanCache(tmp_path / "absent").clear() == 0
    cache.put(KEY, tiny_plan())
    cache.put(OTHER_KEY, tiny_plan())
    (tmp_path / f".{KEY}.abc123.tmp").write_text("left by a killed writer")
    (tmp_path / "README.txt").write_text("not the cache's")
    assert cache.clear() == 2
    assert cache.get(KEY) is None and cache.get(OTHER_KEY) is None
    assert [p.name for p in tmp_path.iterdir()] == ["README.txt"]


# --------------------------------------------------------------------------- directory
def test_directory_resolution(tmp_path, monkeypatch):
    assert cache_mod.default_cache_dir is default_cache_dir  # where PlanCache() looks
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("JAXWAP_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "jaxwap"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "jaxwap"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "jaxwap"
    monkeypatch.setenv("JAXWAP_CACHE_DIR", "")
    assert default_cache_dir() == tmp_path / "xdg" / "jaxwap"
    monkeypatch.setenv("JAXWAP_CACHE_DIR", str(tmp_path / "env"))
    assert PlanCache().directory == tmp_path / "env"
    assert PlanCache(tmp_path / "explicit").directory == tmp_path / "explicit"


def test_jaxwap_cache_dir_is_where_entries_go(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXWAP_CACHE_DIR", str(tmp_path / "env" / "nested"))
    cache = PlanCache()
    cache.put(KEY, tiny_plan())
    assert (tmp_path / "env" / "nested" / f"{KEY}.json").is_file()
    assert PlanCache().get(KEY) == tiny_plan()


# --------------------------------------------------------------------------- keys
def mesh(order=range(8)):
    devs = jax.devices()
    return jax.sharding.Mesh(np.array([devs[i] for i in order]).reshape(2, 4),
                             ("data", "model"))


def base_parts(**changes):
    """Everything a plan depends on, in the forms make_plan has at hand."""
    m = mesh()
    parts = dict(
        jaxpr=mlp_fingerprint(),
        args=[("args[0]['w']", jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                                    sharding=NamedSharding(m, P("data")))),
              ("args[1]", jax.ShapeDtypeStruct((16,), jnp.int32))],
        specs=[P("data", None), P(None, "model")],
        devices=[d.id for d in jax.devices()],
        hardware=jaxwap.Cluster("h100-sxm", 8),
        objective=jaxwap.Objective("balanced"),
        version="0.1.0",
        memory_budget=72e9,
        num_devices=None,
        verify=3,
    )
    parts.update(changes)
    return parts


def aval_args(shape=(8, 4), dtype=jnp.float32, sharding="default"):
    m = mesh()
    sh = NamedSharding(m, P("data")) if sharding == "default" else sharding
    return [("args[0]['w']", jax.ShapeDtypeStruct(shape, dtype, sharding=sh)),
            ("args[1]", jax.ShapeDtypeStruct((16,), jnp.int32))]


VARIANTS = {
    "jaxpr": lambda: dict(jaxpr=mlp_fingerprint((16, 8, 5))),
    "shape": lambda: dict(args=aval_args(shape=(8, 8))),
    "dtype": lambda: dict(args=aval_args(dtype=jnp.bfloat16)),
    "sharding spec": lambda: dict(args=aval_args(sharding=NamedSharding(mesh(), P("model")))),
    "sharding devices": lambda: dict(
        args=aval_args(sharding=NamedSharding(mesh([1, 0, 2, 3, 4, 5, 6, 7]), P("data")))),
    "no sharding": lambda: dict(args=aval_args(sharding=None)),
    "a PartitionSpec": lambda: dict(specs=[P("data", None), P("model", None)]),
    "device ids": lambda: dict(devices=[d.id for d in jax.devices()][::-1]),
    "fewer devices": lambda: dict(devices=[d.id for d in jax.devices()][:4]),
    "link bandwidth": lambda: dict(hardware=jaxwap.Cluster("h100-sxm", 8,
                                                           link_bandwidth=25e9)),
    "device profile": lambda: dict(hardware=jaxwap.Cluster("a100-sxm", 8)
                                   if "a100-sxm" in jaxwap.builtin_device_names()
                                   else jaxwap.Cluster("h100-sxm", 4)),
    "objective": lambda: dict(objective=jaxwap.Objective("throughput")),
    "objective eta": lambda: dict(objective=jaxwap.Objective("balanced", eta=0.25)),
    "version": lambda: dict(version="0.2.0"),
    "memory budget": lambda: dict(memory_budget=36e9),
    "num devices": lambda: dict(num_devices=4),
    "verify": lambda: dict(verify=0),
    "extra part": lambda: dict(donate=False),
}


def test_key_is_a_stable_sha256_hex_digest():
    k = plan_key(**base_parts())
    assert len(k) == 64 and int(k, 16) >= 0
    assert plan_key(**base_parts()) == k  # rebuilt from fresh objects
    assert plan_key(**base_parts(jaxpr=jaxpr_fingerprint(mlp_jaxpr()))) == k  # traced again
    reordered = dict(reversed(list(base_parts().items())))
    assert plan_key(**reordered) == k  # argument order does not matter
    assert plan_key(**base_parts(devices=jax.devices())) == plan_key(
        **base_parts(devices=list(jax.devices())))


def test_key_changes_when_any_part_changes():
    base = plan_key(**base_parts())
    keys = {name: plan_key(**base_parts(**make())) for name, make in VARIANTS.items()}
    for name, k in keys.items():
        assert k != base, name
    assert len(set(keys.values())) == len(keys)


def test_key_changes_with_the_running_jaxwap_version(monkeypatch):
    base = plan_key(**base_parts())
    monkeypatch.setattr(cache_mod, "JAXWAP_VERSION", "99.0.0")
    assert plan_key(**base_parts()) != base


def test_key_encoding_keeps_types_and_structure_apart():
    distinct = [1, 1.0, True, "1", b"1", [1], {"a": 1}, None, "", [], {}, [[]], ["", ""],
                [""], 0.0, -0.0, float("nan"), {"a": "b"}, {"ab": ""}, jnp.float32]
    keys = [plan_key(x=v) for v in distinct]
    assert len(set(keys)) == len(keys)
    assert plan_key(x=(1, 2)) == plan_key(x=[1, 2])  # a sequence either way
    assert plan_key(x={"a": 1, "b": 2}) == plan_key(x={"b": 2, "a": 1})
    assert plan_key(x={"b", "a"}) == plan_key(x=frozenset(["a", "b"]))
    assert plan_key(x=np.int64(3)) == plan_key(x=3)
    assert plan_key(x=np.float32(0.5)) == plan_key(x=0.5)
    assert plan_key(x=np.dtype(jnp.bfloat16)) == plan_key(x=jnp.bfloat16)
    assert plan_key(x=np.float32) == plan_key(x=jnp.float32) == plan_key(x=np.dtype("float32"))
    key_aval = jax.eval_shape(lambda: jax.random.key(0))
    assert plan_key(x=key_aval) == plan_key(x=jax.ShapeDtypeStruct((), key_aval.dtype))


class Opaque:
    pass


class Leaf:
    def __init__(self, x):
        self.x = x


jax.tree_util.register_pytree_node(Leaf, lambda b: ((b.x,), object()), lambda a, c: Leaf(c[0]))


@pytest.mark.parametrize("value", [
    Opaque(), lambda: 0, {1: "int key"}, [1, [Opaque()]], object(),
    jax.tree_util.tree_structure(Leaf(1)),  # its text would hold <object at 0x...>
], ids=["instance", "function", "int-keyed dict", "nested", "object", "treedef w/ address"])
def test_values_without_a_deterministic_form_are_refused(value):
    with pytest.raises(TypeError, match="plan_key"):
        plan_key(x=value)


def test_plain_treedefs_are_accepted():
    tree = {"b": (1, 2), "a": [3]}
    assert plan_key(t=jax.tree_util.tree_structure(tree)) == plan_key(
        t=jax.tree_util.tree_structure(dict(reversed(tree.items()))))


# --------------------------------------------------------------------------- processes
CHILD = """
import os, sys, json
sys.path.insert(0, {tests!r})
import conftest  # 8 simulated CPU devices, as in this process
import test_cache as t
print(json.dumps([t.jaxpr_fingerprint(t.mlp_jaxpr()), t.plan_key(**t.base_parts())]))
"""


def test_fingerprints_and_keys_are_the_same_in_another_process():
    """A cache on disk is only as good as its keys are reproducible: trace the flax step
    again in a fresh interpreter (another hash seed) and compare."""
    env = dict(os.environ, PYTHONHASHSEED="12345", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # conftest sets it again, as here
    out = subprocess.run([sys.executable, "-c", CHILD.format(tests=str(TESTS))],
                         capture_output=True, text=True, env=env, cwd=TESTS, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    fingerprint, key = json.loads(out.stdout.strip().splitlines()[-1])
    assert fingerprint == jaxpr_fingerprint(mlp_jaxpr())
    assert key == plan_key(**base_parts())


def test_planning_reads_back_a_cached_plan_quickly(tmp_path):
    """Wired into the planner: a second planning of the same step is a cache read (its
    speed is measured in benchmarks/planning/plan_time.py, not asserted with a timer here)."""
    from models import abstract_setup

    from jaxwap.planner import make_plan

    step, params, opt, batch = abstract_setup((64, 64, 10), 32, 16)
    store = jaxwap.PlanCache(tmp_path)
    kw = dict(hardware=jaxwap.Cluster("h100-sxm", 8), cache=store)
    first = jaxwap.plan(step, params, opt, batch, **kw)
    assert len(list(tmp_path.glob("*.json"))) == 1
    planned = make_plan(step, (params, opt, batch), {}, params=None,
                        options=jaxwap.PlanOptions(**kw))
    assert planned.search is None and planned.graph is None  # read back, not searched
    second = planned.plan
    assert second == first and second.param_specs == first.param_specs
    # any change to what the plan depends on misses
    other = jaxwap.plan(step, params, opt, batch, hardware=jaxwap.Cluster("h100-sxm", 8),
                        objective="throughput", cache=store)
    assert len(list(tmp_path.glob("*.json"))) == 2
    assert other.objective != first.objective


def test_a_plan_for_a_described_cluster_is_not_read_back_for_the_devices_present(tmp_path):
    """jaxwap.plan for hardware describing 16 GPUs plans 16 devices; auto_shard with the
    same hardware runs on the 8 present. One key for both read the 16-device plan back
    where 8 devices must run it."""
    step, params, opt_state, batch = models.abstract_setup((256, 256, 10), 64, 256)
    hardware = jaxwap.Cluster("h100-sxm", 16)
    store = PlanCache(tmp_path)
    # a budget only 16 devices meet: on the 8 present nothing fits
    opts = {"hardware": hardware, "verify": 0, "memory_budget": 220e3, "cache": store}
    described = jaxwap.plan(step, params, opt_state, batch, **opts)
    assert described.num_devices > len(jax.devices())
    with pytest.raises(MemoryError, match="no candidate plan fits"):
        jaxwap.auto_shard(step, **opts).plan_for(params, opt_state, batch)


# --------------------------------------------------------------------------- entries checked
@pytest.mark.parametrize("edit, why", [
    (lambda p: {**p, "mesh_shape": {"data": 3, "model": 5}},
     "its mesh data=3 x model=5 needs 15 devices, but 8 are usable here"),
    (lambda p: {**p, "device_ids": [7, *p["device_ids"][1:]]}, "runs on device ids"),
    (lambda p: {**p, "params": [{**p["params"][0], "spec": ["model", "data", None]},
                                *p["params"][1:]]},
     "spec ('model', 'data', None) has 3 entries for 1 dims"),
    (lambda p: {**p, "batch_size": 64}, "made for batch size 64"),
])
def test_an_entry_that_cannot_run_here_is_dropped_naming_the_file_and_planned_afresh(
        tmp_path, edit, why):
    """Valid JSON, a plan `Plan.from_dict` accepts, and wrong for this machine or step (a
    file edited, copied or written by a bug): the step plans afresh, with one warning
    that names the file and what is wrong, instead of failing on every call."""
    step, params, opt_state, batch = models.abstract_setup((16, 8, 4), 16, 8)
    cache = PlanCache(tmp_path)
    first = jaxwap.plan(step, params, opt_state, batch, cache=cache, verify=0)
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    doc["plan"] = edit(doc["plan"])
    path.write_text(json.dumps(doc))
    assert cache.get(path.stem) is not None            # the entry reads back
    with pytest.warns(PlanCacheWarning, match=re.escape(str(path)) + ".*" + re.escape(why)):
        again = jaxwap.plan(step, params, opt_state, batch, cache=cache, verify=0)
    assert again == first                              # planned afresh, the same plan
    assert cache.get(path.stem) == first               # and the entry healed
