"""A pipelined step's memory: jaxwap's prediction against XLA's compiled figure.

    .venv/bin/python -m benchmarks.pipelines.pipeline_memory

A stack of 8 MLP blocks (d 256 -> 1024 -> 256) under `lax.scan`, an embedding and a head,
Adam, batch 64, on the 8 simulated CPU devices. For each forced pipeline shape (stages,
micro-batches, repeats), with the blocks as written and each under `jax.checkpoint`,
`jaxwap.plan(..., verify=1, num_devices=8)` plans it and compiles
the chosen candidate through `verify.compile_candidate`, the function `auto_shard`
compiles through; the table sets the **predicted** peak memory per device beside XLA:CPU's
**compiled** one (argument + output + temporaries - aliased). Writes
`benchmarks/results/pipeline_memory/cpu.{json,md}`.
"""

from __future__ import annotations

import itertools
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxwap  # noqa: E402
from benchmarks import harness  # noqa: E402

RESULTS = harness.results_dir("pipeline_memory")
L, D, B, V = 8, 256, 64, 512
# (stages, micro-batches, repeats, layout families: None = the planner's choice, which
# here is FSDP inside the stages; "zero1" keeps each stage's share whole; "tp" on a fixed
# stage mesh (data, model) splits the layers over the model axis inside the stages)
SHAPES = [(2, 2, 1, None, None), (2, 8, 1, None, None), (4, 4, 1, None, None),
          (2, 4, 2, None, None), (4, 8, 2, None, None), (2, 4, 1, ("zero1",), None),
          (4, 8, 2, ("zero1",), None), (2, 4, 1, ("tp",), (2, 2)),
          (4, 8, 2, ("tp",), (1, 2)), (2, 4, 1, ("tp", "fsdp"), (2, 2))]


def held(step: jaxwap.StepVariant) -> str:
    """How a stage holds its layers, in words."""
    ways = [w for w, on in (("tensor-parallel", step.stage_tensor_parallel),
                            ("sharded (FSDP)", step.stage_sharded)) if on]
    return " + ".join(ways) or "whole"


def make_loss(checkpointed: bool):
    """The loss, its blocks as written or each under `jax.checkpoint` (per-layer full
    recompute, as Megatron and MaxText write them)."""
    def loss(params, batch):
        h = jnp.take(params["embed"], batch["x"], axis=0).mean(1)

        def layer(h, w):
            return h + jnp.tanh(h @ w["w1"] + w["b1"]) @ w["w2"], None

        h, _ = jax.lax.scan(jax.checkpoint(layer) if checkpointed else layer, h,
                            params["blocks"])
        logits = h @ params["head"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                             batch["y"][:, None], 1))
    return loss


def setup():
    s = jax.ShapeDtypeStruct
    f32 = jnp.float32
    params = {"embed": s((V, D), f32), "head": s((D, V), f32),
              "blocks": {"w1": s((L, D, 4 * D), f32), "b1": s((L, 4 * D), f32),
                         "w2": s((L, 4 * D, D), f32)}}
    batch = {"x": s((B, 4), jnp.int32), "y": s((B,), jnp.int32)}
    return params, batch


def main() -> None:
    params, batch = setup()
    rows = []
    for (p, m, r, families, mesh), checkpointed in itertools.product(SHAPES, (False, True)):
        step = jaxwap.make_train_step(make_loss(checkpointed), optax.adam(1e-3))
        opt = jax.eval_shape(step.init, params)
        # all 8 devices: a stage mesh of 8 / p, or the one given
        where = ({"num_devices": 8} if mesh is None else
                 {"mesh_shape": {"data": mesh[0], "model": mesh[1]}})
        plan = jaxwap.plan(step, params, opt, batch, cache=False, verify=1,
                           pipeline={"stages": p, "micro_batches": m, "repeats": r},
                           strategies=families, **where)
        predicted = plan.predicted.peak_memory_bytes
        compiled = plan.compiled.memory_bytes
        rows.append({"stages": p, "micro_batches": m, "repeats": r,
                     "layers_checkpointed": checkpointed,
                     "strategies": families, "held": held(plan.step),
                     "mesh": dict(plan.mesh_shape), "predicted_bytes": predicted,
                     "compiled_bytes": compiled,
                     "error": predicted / compiled - 1})
        print(rows[-1], flush=True)
    head = ("Peak memory per device of a forced pipeline, **predicted** by jaxwap beside "
            "XLA:CPU's **compiled** figure (8 simulated CPU devices; "
            f"{L} blocks of {D} -> {4 * D} -> {D} under lax.scan, each as written or under "
            "`jax.checkpoint`, batch {B}, f32, Adam). "
            "Command: `.venv/bin/python -m benchmarks.pipelines.pipeline_memory`.\n\n"
            "Layouts: the planner's, or asked for (`strategies=`; the tensor-parallel rows "
            "on a fixed stage mesh, `mesh_shape=`); a stage holds its layers sharded over "
            "data (FSDP inside the stage, gathered in the loop), split over the model axis "
            "(tensor-parallel, XLA partitions them inside the loop), both, or whole.\n\n"
            "| stages | micro-batches | repeats | blocks | layouts asked | stage's layers | "
            "mesh | predicted MB | compiled MB | error |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    table = "".join(
        f"| {x['stages']} | {x['micro_batches']} | {x['repeats']} | "
        f"{'checkpointed' if x['layers_checkpointed'] else 'as written'} | "
        f"{'/'.join(x['strategies']) if x['strategies'] else 'planner'} | "
        f"{x['held']} | {x['mesh']} | "
        f"{x['predicted_bytes'] / 1e6:.1f} | {x['compiled_bytes'] / 1e6:.1f} | "
        f"{x['error']:+.0%} |\n" for x in rows)
    errs = np.abs([x["error"] for x in rows])
    tail = f"\n|error| median {np.median(errs):.0%}, worst {errs.max():.0%}.\n"
    harness.write_record(RESULTS / "cpu", {
        "jax": jax.__version__, "command": "python -m benchmarks.pipelines.pipeline_memory",
        "rows": rows}, head + table + tail, newline=False)
    print(head + table + tail)


if __name__ == "__main__":
    sys.exit(main())
