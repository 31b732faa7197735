"""The donation checks of `test_donation.py`, run in a process of their own (not collected):
each passes the step arrays it has donated, which crashed the process before jaxwap
refused them, so no test process may run them itself.

    python donation_worker.py one|eight       # a 1-device or an 8-device (sharded) plan
    JAX_PLATFORMS=cuda python donation_worker.py one     # the 1-device checks on a GPU
    python donation_worker.py two PID PORT    # process PID of 2, 4 CPU devices each

Prints `OK <check>` for each check that holds (and the refusal's message, for the test to
read); any failure raises, and the test reads the exit status and the output.
"""

from __future__ import annotations

import os
import sys

mode = sys.argv[1]
if mode == "one":   # JAX_PLATFORMS=cuda: on a GPU, whose one-device call is unchecked
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
else:
    os.environ["JAX_PLATFORMS"] = "cpu"
from processes import FAST_COMPILE  # noqa: E402 - imports no jax

os.environ["XLA_FLAGS"] = FAST_COMPILE if mode == "two" else \
    f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}"

import jax  # noqa: E402

if mode == "two":
    jax.config.update("jax_num_cpu_devices", 4)
    pid, port = int(sys.argv[2]), int(sys.argv[3])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from models import MLP, make_step  # noqa: E402

import jaxwap  # noqa: E402

PATH = "args[0]['params']['Dense_0']['kernel']"
tag = f"process {jax.process_index()}: " if mode == "two" else ""


def ok(what: str) -> None:
    print(f"{tag}OK {what}", flush=True)


def refused(call, what: str) -> str:
    """The ValueError `call()` raises (printed for the test), or an AssertionError."""
    try:
        call()
    except ValueError as e:
        print(f"{tag}REFUSED {what}: {e}", flush=True)
        return str(e)
    raise AssertionError(f"{what}: the step ran on deleted arrays")


def deleted(tree) -> list[bool]:
    return [x.is_deleted() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def consumed(params, opt) -> bool:
    """Whether the donated leaves, the state the step hands back (the parameters, Adam's
    moments and count), are all deleted."""
    return all(deleted((params, opt)))


model, tx = MLP((64, 64, 10)), optax.adam(1e-2)
rng = np.random.default_rng(0)
x = rng.standard_normal((32, 16)).astype(np.float32)
y = (np.arange(32) % 10).astype(np.int32)
step = make_step(model, tx)
host_params = jax.tree.map(np.asarray, model.init(jax.random.key(0), x[:1]))
host_opt = jax.tree.map(np.asarray, tx.init(host_params))
if mode == "two":
    half = slice(16 * pid, 16 * (pid + 1))
    batch = {"x": x[half], "y": y[half]}
    options = {"num_devices": 8}
elif mode == "one":
    batch = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
    options = {"num_devices": 1}
else:   # every kernel split over 8 devices where its dims allow (FSDP): a sharded plan
    batch = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
    options = {"mesh_shape": {"data": 8, "model": 1}, "strategies": ("fsdp",)}


def fresh_step():
    return jaxwap.auto_shard(step, host_params, cache=False, verify=0, **options)


# the single-device jax.jit steps every run below is compared with
local = jax.local_devices()[0]
want = [(jax.device_put(host_params, local), jax.device_put(host_opt, local))]
for _ in range(3):
    p, o, _ = jax.jit(step)(*want[-1], {"x": x, "y": y})
    want.append((p, o))


def host(tree):
    """The global values of a tree of the step's arrays, on this host."""
    if mode == "two":
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(np.asarray, tree)


def close(want, got) -> None:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=2e-5, atol=2e-6), want, host(got))


def same(got, k: int) -> None:
    close(want[k], got)


# 1. The initial state: host (numpy) arrays are never touched; jax arrays are consumed by
#    the first call on every plan (donated in place, or copied onto the mesh and deleted).
wrapped = fresh_step()
before = jax.tree.map(np.copy, (host_params, host_opt))
p1, o1, _ = wrapped(host_params, host_opt, batch)
jax.tree.map(np.testing.assert_array_equal, before, (host_params, host_opt))
same((p1, o1), 1)
ok("host initial state untouched")
if mode == "two":     # each process's own copy of the state, on its first device
    init_p, init_o = jax.device_put((host_params, host_opt), local)
else:                 # as model.init makes them: on the default device, uncommitted
    init_p, init_o = jax.tree.map(jnp.asarray, (host_params, host_opt))
wrapped = fresh_step()
p1, o1, _ = wrapped(init_p, init_o, batch)
assert consumed(init_p, init_o), deleted((init_p, init_o))
same((p1, o1), 1)
ok("jax initial state consumed")
if mode != "two":     # placed on the plan's shardings first: donated in place
    wrapped = fresh_step()
    wrapped.plan_for(host_params, host_opt, batch)
    placed_p, placed_o = wrapped.shard(host_params, host_opt)
    p1, o1, _ = wrapped(placed_p, placed_o, batch)
    assert consumed(placed_p, placed_o), deleted((placed_p, placed_o))
    same((p1, o1), 1)
    ok("placed initial state consumed")
kept = jaxwap.auto_shard(step, host_params, cache=False, verify=0, donate=False, **options)
init_p, init_o = jax.device_put((host_params, host_opt), local)
p1, o1, _ = kept(init_p, init_o, batch)
p1, o1, _ = kept(init_p, init_o, batch)     # donate=False: the same state, twice
assert not any(deleted((init_p, init_o)))
same((p1, o1), 1)
ok("donate=False keeps the state")

# 2. The state from before the last step, passed again: refused by path, nothing run; the
#    step goes on with the state it returned. Two steps back, and an array deleted by
#    hand, are refused the same way.
p2, o2, _ = wrapped(p1, o1, batch)
message = refused(lambda: wrapped(p1, o1, batch), "state before the last step")
assert PATH in message and "returned by the last step" in message, message
p3, o3, _ = wrapped(p2, o2, batch)
same((p3, o3), 3)
ok("donated state refused by path")
message = refused(lambda: wrapped(p1, o3, batch), "state two steps back")
assert PATH in message, message
ok("older state refused")
opt_only = refused(lambda: wrapped(p3, o2, batch), "optimizer state before the last step")
assert "args[1]" in opt_only and PATH not in opt_only, opt_only
ok("optimizer state refused by path")
if mode != "two":
    gone = jax.tree.map(jnp.copy, p3)
    gone["params"]["Dense_1"]["bias"].delete()
    message = refused(lambda: wrapped(gone, o3, batch), "array deleted by hand")
    assert "args[0]['params']['Dense_1']['bias']" in message, message
    ok("deleted array refused by path")

# 3. One returned array at two donated leaves (Adam's nu started as its mu): the step
#    runs, the repeat given a buffer of its own, as jax.jit of the same arguments does.
adam = o3[0]
twice = (adam._replace(nu=adam.mu), *o3[1:])
ref = jax.jit(step)(*jax.device_put((host(p3), host(twice)), local), {"x": x, "y": y})[0]
p4, o4, _ = wrapped(p3, twice, batch)
close(ref, p4)
ok("one array at two donated leaves")
print(f"{tag}DONE", flush=True)
