"""One process of a 2-process CPU run (started by test_multiprocess.py, not collected).

Each process owns 4 CPU devices and passes its own half of the global batch as numpy; the
auto-sharded step runs over all 8 devices and must equal one process's plain jax.jit step
on the whole batch.
"""

from __future__ import annotations

import os
import sys

from processes import FAST_COMPILE  # imports no jax

os.environ["XLA_FLAGS"] = FAST_COMPILE
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
pid, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=60)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402
from models import MLP, make_step  # noqa: E402

import jaxwap  # noqa: E402

model, tx = MLP((64, 64, 10)), optax.sgd(0.1, momentum=0.9)
rng = np.random.default_rng(0)
x = rng.standard_normal((32, 16)).astype(np.float32)
y = (np.arange(32) % 10).astype(np.int32)
local = jax.local_devices()[0]
params = jax.device_put(model.init(jax.random.key(0), x[:1]), local)
opt = jax.device_put(tx.init(params), local)
step = make_step(model, tx)

ref_p, ref_o = params, opt
for _ in range(3):
    ref_p, ref_o, _ = jax.jit(step)(ref_p, ref_o, {"x": x, "y": y})

half = slice(16 * pid, 16 * (pid + 1))
batch = {"x": x[half], "y": y[half]}
sharded = jaxwap.auto_shard(step, params, hardware=jaxwap.Cluster("h100-sxm", 8),
                            num_devices=8, objective="throughput")
p, o = jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, opt)
for _ in range(3):
    p, o, m = sharded(p, o, batch)
assert sharded.plan.batch_size == 32, sharded.plan.batch_size
assert sharded.plan.num_devices == 8
got = multihost_utils.process_allgather(p, tiled=True)
jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                     rtol=2e-5, atol=2e-6), ref_p, got)
print(f"process {pid}: OK mesh={dict(sharded.plan.mesh_shape)}", flush=True)

# The same step on the two processes as two nodes of 4 (the layout detected), tensor
# parallelism forced over a model axis of 4 through the public knobs (Megatron's pair
# pinned: whether it gains on so small a model follows from the host's cores): that axis
# must stay inside each process, and the numbers must still be the single-device ones.
detected = jaxwap.auto_shard(step, params, objective="throughput", cache=False,
                             mesh_shape={"data": 2, "model": 4},
                             strategies=("replicate", "tp"),
                             constraints={"Dense_0/kernel": PartitionSpec(None, "model"),
                                          "Dense_1/kernel": PartitionSpec("model", None)})
p, o = jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, opt)
for _ in range(3):
    p, o, m = detected(p, o, batch)
plan = detected.plan
assert plan.hardware.devices_per_node == 4, plan.hardware
assert plan.hardware.num_nodes == 2, plan.hardware
assert any(q.strategy.startswith("tp") for q in plan.params), [q.strategy for q in plan.params]
for row in detected.mesh.devices:   # one data index: the model axis's devices
    assert len({d.process_index for d in row}) == 1, [(d.id, d.process_index) for d in row]
assert "data axis spans 2 nodes" in plan.explain(), plan.explain()
got = multihost_utils.process_allgather(p, tiled=True)
jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                     rtol=2e-5, atol=2e-6), ref_p, got)
print(f"process {pid}: OK hierarchical mesh={dict(plan.mesh_shape)}", flush=True)

# Hybrid sharding across the two processes as two nodes: FSDP over each process's 4
# devices, the two processes replicas of each other (HSDP). Each replica's devices are one
# process's, and the numbers are still the single-device ones.
hybrid = jaxwap.auto_shard(step, params, objective="throughput", cache=False,
                           mesh_shape={"replica": 2, "data": 4}, strategies=("fsdp",))
p, o = jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, opt)
for _ in range(3):
    p, o, m = hybrid(p, o, batch)
plan = hybrid.plan
assert dict(plan.mesh_shape) == {"replica": 2, "data": 4, "model": 1}, plan.mesh_shape
assert hybrid.mesh.axis_names == ("replica", "data", "model"), hybrid.mesh.axis_names
for replica in hybrid.mesh.devices:   # one replica: one process's devices
    assert len({d.process_index for d in replica.flat}) == 1, replica
assert all(q.strategy == "fsdp" and "data" in q.spec for q in plan.params
           if q.path[-1] == "kernel"), [(q.path, q.strategy, q.spec) for q in plan.params]
assert "HSDP" in plan.explain(), plan.explain()
# XLA's own program: the only collectives across the processes reduce over the replicas
assert plan.compiled is not None
assert any(c.axes == ("replica",) and c.group_size == 2 for c in plan.compiled.collectives)
assert all(c.axes in (("data",), ("replica",), ("replica", "data"))
           for c in plan.compiled.collectives), plan.compiled.collectives
got = multihost_utils.process_allgather(p, tiled=True)
jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                     rtol=2e-5, atol=2e-6), ref_p, got)
print(f"process {pid}: OK hsdp mesh={dict(plan.mesh_shape)}", flush=True)

# Pipeline stages across the two processes: a make_train_step step whose loss scans 4
# stacked layers, forced to 2 stages x data 4 (GPipe, 4 micro-batches). Each stage's
# devices are one process's, so the stage-to-stage sends cross between the processes;
# the numbers are still the single-device ones.
import jax.numpy as jnp  # noqa: E402


def stacked_loss(params, batch):
    h = batch["x"] @ params["inp"]

    def layer(h, w):
        return h + jnp.tanh(h @ w["w"] + w["b"]), None

    h, _ = jax.lax.scan(layer, h, params["blocks"])
    return jnp.mean((h @ params["out"] - batch["t"]) ** 2)


srng = np.random.default_rng(1)
sparams = {"inp": (srng.standard_normal((16, 32)) / 4).astype(np.float32),
           "blocks": {"w": (srng.standard_normal((4, 32, 32)) / 6).astype(np.float32),
                      "b": np.zeros((4, 32), np.float32)},
           "out": (srng.standard_normal((32, 4)) / 6).astype(np.float32)}
t = srng.standard_normal((32, 4)).astype(np.float32)
sstep = jaxwap.make_train_step(stacked_loss, optax.adam(1e-2))
sopt = sstep.init(sparams)
want = jax.jit(sstep)(jax.device_put(sparams, local), jax.device_put(sopt, local),
                      {"x": x, "t": t})[0]
staged = jaxwap.auto_shard(sstep, objective="throughput", cache=False, num_devices=8,
                           pipeline={"stages": 2, "micro_batches": 4, "repeats": 1})
got_p, _, _ = staged(sparams, sopt, {"x": x[half], "t": t[half]})
plan = staged.plan
assert dict(plan.mesh_shape) == {"stage": 2, "data": 4, "model": 1}, plan.mesh_shape
for stage in staged.mesh.devices:   # one stage: one process's devices
    assert len({d.process_index for d in stage.flat}) == 1, stage
assert plan.step.stages == 2 and "pipeline" in plan.explain()
got = multihost_utils.process_allgather(got_p, tiled=True)
jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                     rtol=2e-5, atol=2e-6), want, got)
print(f"process {pid}: OK pipeline mesh={dict(plan.mesh_shape)}", flush=True)

# The measured choice across the two processes (`measure=`): the finalists run on devices
# of both processes, so every process must run as many steps of each (a collective left
# waiting for a peer's extra step would hang) and decide on the same figures (different
# choices would compile different programs). All the finalists' figures agree to the bit
# on every process, and the step it chooses gives the single-device numbers.
measured = jaxwap.auto_shard(step, params, hardware=jaxwap.Cluster("h100-sxm", 8),
                             num_devices=8, objective="throughput", measure=2, cache=False)
p, o = jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, opt)
for _ in range(3):
    p, o, m = measured(p, o, batch)
plan = measured.plan
timed = [c for c in plan.candidates if c.measured is not None]
assert len(timed) >= 2, [(c.label, c.measured) for c in plan.candidates]
mine = np.array([[c.measured.step_time_s, c.measured.energy_per_step_j, c.measured.steps]
                 for c in timed], np.float32)
every = np.asarray(multihost_utils.process_allgather(mine))
assert (every == every[0]).all(), every
assert all("median over the 2 processes" in c.measured.note for c in timed), timed
chosen = np.array([i for i, c in enumerate(plan.candidates) if c.chosen], np.int32)
assert (np.asarray(multihost_utils.process_allgather(chosen)) == chosen).all()
got = multihost_utils.process_allgather(p, tiled=True)
jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                     rtol=2e-5, atol=2e-6), ref_p, got)
print(f"process {pid}: OK measured choice mesh={dict(plan.mesh_shape)}", flush=True)

# Left free, the planner would run this small step on one device (the energy objective
# takes 1 of the 8 on one process); but each process passes its own slice of the batch,
# so a step that runs must hold devices of both: it plans for all 8 and gives the
# single-device numbers. A device count that leaves a process out is refused up front,
# by name, with the user's arrays untouched.
frugal = jaxwap.auto_shard(step, params, objective="energy", cache=False)
p, o = jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, opt)
for _ in range(3):
    p, o, m = frugal(p, o, batch)
assert frugal.plan.num_devices == 8, frugal.plan.mesh_shape
assert jaxwap.plan(step, params, opt, batch, objective="energy", cache=False,
                   verify=0).num_devices < 8   # advice alone may still weigh fewer
got = multihost_utils.process_allgather(p, tiled=True)
jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                     rtol=2e-5, atol=2e-6), ref_p, got)
before = jax.tree.map(np.copy, p)
try:
    jaxwap.auto_shard(step, params, num_devices=4, cache=False)(p, o, batch)
except ValueError as e:
    assert "num_devices=4" in str(e) and "every process" in str(e), e
else:
    raise AssertionError("a 4-device plan of process 0 alone ran under 2 processes")
jax.tree.map(np.testing.assert_array_equal, before, p)
print(f"process {pid}: OK every process mesh={dict(frugal.plan.mesh_shape)}", flush=True)

# Tensor parallelism across the two processes (a model axis of 8, no data axis): the batch
# is replicated on every device, so each process's half must reach the other's devices
# too. The halves are laid out split by process and moved onto the plan's sharding; the
# numbers are still the single-device ones.
across = jaxwap.auto_shard(step, params, hardware=jaxwap.Cluster("h100-sxm", 8),
                           objective="throughput", cache=False,
                           mesh_shape={"data": 1, "model": 8}, strategies=("tp",))
p, o = jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, opt)
for _ in range(3):
    p, o, m = across(p, o, batch)
plan = across.plan
assert dict(plan.mesh_shape)["data"] == 1 and plan.num_devices == 8, plan.mesh_shape
assert any(q.strategy.startswith("tp") for q in plan.params), [q.strategy for q in plan.params]
assert len({d.process_index for d in across.mesh.devices.flat}) == 2
got = multihost_utils.process_allgather(p, tiled=True)
jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                     rtol=2e-5, atol=2e-6), ref_p, got)
print(f"process {pid}: OK batch replicated across processes mesh={dict(plan.mesh_shape)}",
      flush=True)
