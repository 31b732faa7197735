"""A checkpoint that survives a change of plan: train under one plan, save with orbax,
re-plan for fewer devices, restore straight onto the new plan, train on.

Run from the repository root (on CPU: 8 simulated devices, a few seconds):

    .venv/bin/python examples/checkpoint_replan.py
    .venv/bin/python examples/checkpoint_replan.py --ckpt-dir /tmp/ckpt --steps 5

The loop a preempted job goes through when it comes back on a different slice:

1. plan A on 8 devices: tensor parallel on a 2 x 4 (data x model) mesh; train, save
   `{"params", "opt_state"}` with `orbax.checkpoint.StandardCheckpointer`;
2. plan B on 4 devices: ZeRO-1 on a 4-way data mesh (weights whole on each device, Adam
   moments split four ways), planned from shapes alone;
3. `step_b.abstract_state(params, opt_state)` gives the restore target: shapes, dtypes and
   plan B's shardings, no data. orbax reads each device's shard straight onto that layout,
   so no device ever holds a full copy of state it does not keep, and the step runs on
   the restored state with no resharding;
4. train on under plan B; the losses continue those of an uninterrupted run under plan A
   (checked at the end, to float32 rounding: the two meshes sum in different orders).

The layouts are forced (`mesh_shape=`, `strategies=`) so the change of plan is visible on
a CPU, where the planner, seeing 8 simulated devices share two cores, would rightly pick
one device. On real accelerators leave them out and let each job plan for what it got.
"""

import common  # first: no jax import at module level, so setup_devices() can still act

common.setup_devices()  # sets XLA_FLAGS before anything imports jax

import argparse  # noqa: E402 - after setup_devices(), like the imports that need it
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import jaxwap  # noqa: E402

WIDTHS = (64, 256, 256, 16)
BATCH = 64


def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
    """Mean squared error of a relu MLP, plain jax: a step written for one device."""
    x = batch["x"]
    names = sorted(params)
    for name in names[:-1]:
        x = jax.nn.relu(x @ params[name]["kernel"] + params[name]["bias"])
    out = x @ params[names[-1]]["kernel"] + params[names[-1]]["bias"]
    return jnp.mean((out - batch["y"]) ** 2)


def init(seed: int) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """Parameters (N(0, 1/fan_in) kernels, zero biases) and one regression batch whose
    targets a linear map of the inputs makes learnable."""
    rng = np.random.default_rng(seed)
    params = {f"layer{i}": {
        "kernel": jnp.asarray(rng.standard_normal((n, m), np.float32) / np.sqrt(n)),
        "bias": jnp.zeros(m, jnp.float32)}
        for i, (n, m) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:], strict=True))}
    x = rng.standard_normal((BATCH, WIDTHS[0]), np.float32)
    y = x @ (rng.standard_normal((WIDTHS[0], WIDTHS[-1]), np.float32) / 8)
    return params, {"x": jnp.asarray(x), "y": jnp.asarray(y)}


def train(step: Any, params: Any, opt_state: Any, batch: Any, steps: int, first: int
          ) -> tuple[Any, Any, list[float]]:
    """`steps` steps on the same batch; the returned state is fed back (it was donated)."""
    losses = []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
        print(f"  step {first + i:2d}  loss {losses[-1]:.6f}")
    return params, opt_state, losses


def describe(plan: jaxwap.Plan) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh_shape.items())
    kinds = sorted({p.strategy for p in plan.params})
    return f"{len(plan.device_ids)} devices, mesh {mesh}, layouts {', '.join(kinds)}"


def where(leaf: jax.Array) -> str:
    """A leaf's layout and what one device holds of it."""
    shard = leaf.addressable_shards[0].data.shape
    return (f"{leaf.sharding.spec} on {len(leaf.sharding.device_set)} devices, "
            f"{tuple(shard)} per device")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="steps before and after the restore")
    p.add_argument("--ckpt-dir", default=None,
                   help="where to save (a new directory; default: a temporary one, removed)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    t0 = time.perf_counter()
    root = Path(args.ckpt_dir or tempfile.mkdtemp(prefix="jaxwap-ckpt-")).resolve()
    path = root / f"step{args.steps}"

    step = jaxwap.make_train_step(loss_fn, optax.adam(1e-3))
    params, batch = init(args.seed)
    opt_state = step.init(params)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, opt_state))

    # 1. plan A: 8 devices, tensor parallel; train and save
    step_a = jaxwap.auto_shard(step, verify=0, mesh_shape={"data": 2, "model": 4},
                               strategies=("tp",))
    print(f"plan A: {describe(step_a.plan_for(params, opt_state, batch))}")
    p_a, o_a, losses = train(step_a, params, opt_state, batch, args.steps, 1)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, {"params": p_a, "opt_state": o_a})
    checkpointer.wait_until_finished()   # the next step donates p_a and o_a
    print(f"saved params + opt_state to {path}\n"
          f"  layer1 kernel under plan A: {where(p_a['layer1']['kernel'])}")
    # the reference: plan A carrying on as if nothing happened
    _, _, uninterrupted = train(step_a, p_a, o_a, batch, args.steps, args.steps + 1)
    print("  (plan A, uninterrupted: the reference for the resumed run)")

    # 2. plan B: the job comes back on 4 devices; plan from shapes alone
    step_b = jaxwap.auto_shard(step, devices=jax.devices()[:4], verify=0,
                               mesh_shape={"data": 4}, strategies=("zero1",))
    print(f"plan B: {describe(step_b.plan_for(*shapes, batch))}")

    # 3. restore straight onto plan B's layout
    target_params, target_opt = step_b.abstract_state(*shapes)
    restored = checkpointer.restore(path, {"params": target_params, "opt_state": target_opt})
    p_b, o_b = restored["params"], restored["opt_state"]
    print(f"restored onto plan B\n"
          f"  layer1 kernel: {where(p_b['layer1']['kernel'])}\n"
          f"  its Adam moment: {where(o_b[0].mu['layer1']['kernel'])}")

    # 4. train on under plan B
    _, _, resumed = train(step_b, p_b, o_b, batch, args.steps, args.steps + 1)
    gap = max(abs(a - b) / abs(a) for a, b in zip(uninterrupted, resumed, strict=True))
    print(f"summary: loss {losses[0]:.6f} -> {resumed[-1]:.6f}; resumed on plan B vs "
          f"uninterrupted on plan A: largest relative loss difference {gap:.1e} "
          f"(float32 rounding); {time.perf_counter() - t0:.1f} s")
    if args.ckpt_dir is None:
        shutil.rmtree(root)
    if gap > 1e-4:
        raise SystemExit("the resumed run left the uninterrupted one: the restore was wrong")


if __name__ == "__main__":
    main()
