"""Shared code for the example scripts: device set-up, flags, data, train step, loop.

The examples make one point: a training step written for a single device runs unchanged
under `jaxwap.auto_shard`. So everything here is ordinary single-device JAX/Flax/Optax code,
and the two paths of `main` differ only in how `step` is built and where the data is put
beforehand; the training loop (`train`) is one and the same.

Reading order: `setup_devices` (must run before jax is imported), flags, synthetic data,
model/optimizer/train step, the loop, `main`.

This module imports no jax at module level, on purpose: `setup_devices` sets `XLA_FLAGS`,
which XLA reads once when its backend starts, so the scripts import this module, call
`setup_devices()`, and only then let anything import jax.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # annotations only; importing jax here would defeat setup_devices
    import flax.linen as nn
    import jax
    import optax

# --------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------

#: Simulated CPU devices when no accelerator is present: enough for jaxwap to have real
#: data/model mesh choices to make (the 8 GPUs of one HGX box) while running on a laptop/CI.
CPU_DEVICE_COUNT = 8
PLATFORM_ENV = "JAXWAP_EXAMPLE_PLATFORM"

_platform: str | None = None


def setup_devices() -> str:
    """Choose the platform and, on CPU, split the host into 8 XLA devices. Call before jax.

    Returns "gpu" or "cpu" (also remembered for `platform()`, which picks flag defaults).

    The platform is taken from `$JAXWAP_EXAMPLE_PLATFORM` (``cpu`` or ``gpu``) if set;
    otherwise a GPU is assumed present when `nvidia-smi` is on PATH or `/dev/nvidia0`
    exists. This deliberately avoids importing jax to ask it: once jax has started a
    backend the device count is fixed, and the whole point is to set it first.

    On CPU, appends ``--xla_force_host_platform_device_count=8`` to `XLA_FLAGS` (keeping
    whatever flags were there) and sets ``JAX_PLATFORMS=cpu`` so jax neither probes for
    absent GPU plugins nor warns about them. On GPU it changes nothing.
    """
    global _platform
    choice = os.environ.get(PLATFORM_ENV, "").strip().lower()
    if choice not in ("", "cpu", "gpu"):
        raise ValueError(f"${PLATFORM_ENV} must be 'cpu' or 'gpu', got {choice!r}")
    if not choice:
        has_gpu = shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidia0")
        choice = "gpu" if has_gpu else "cpu"
    if choice == "cpu":
        if "jax" in sys.modules:
            # Not fatal (XLA reads the flag when the backend starts, which may be later),
            # but it usually means the import order in the calling script is wrong.
            print("warning: setup_devices() called after jax was imported; "
                  "the simulated device count may not take effect", file=sys.stderr)
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            flag = f"--xla_force_host_platform_device_count={CPU_DEVICE_COUNT}"
            os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
    _platform = choice
    return choice


def platform() -> str:
    """The platform chosen by `setup_devices` (which is run now if it has not been)."""
    return _platform if _platform is not None else setup_devices()


# --------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------

OBJECTIVES = ("throughput", "energy", "balanced")


def parse_args(
    description: str, *, cpu_image_size: int, gpu_image_size: int = 224,
    argv: list[str] | None = None,
) -> argparse.Namespace:
    """The flags both scripts take; defaults depend on the platform.

    On GPU the defaults are the real workload (224 px, bfloat16, 20 steps). On CPU they are
    shrunk (small images, float32 since CPUs have no fast bfloat16 matmul, 8 steps) so a
    run finishes in about a minute on two cores; the model itself is unchanged.
    """
    on_gpu = platform() == "gpu"
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--auto", action="store_true",
                   help="shard the step with jaxwap.auto_shard instead of jax.jit on 1 device")
    p.add_argument("--batch-size", type=int, default=128, help="global batch size")
    p.add_argument("--image-size", type=int, default=gpu_image_size if on_gpu else cpu_image_size,
                   help="square image side in pixels")
    p.add_argument("--steps", type=int, default=20 if on_gpu else 8,
                   help="training steps (the first one includes compilation)")
    p.add_argument("--objective", choices=OBJECTIVES, default="balanced",
                   help="what jaxwap optimises for (--auto only)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   default="bfloat16" if on_gpu else "float32",
                   help="compute dtype; parameters stay float32")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-5, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hardware", default=None,
                   help="plan as if for this built-in device profile (e.g. h100-sxm), with "
                        "as many devices as are present (--auto only); default: detect")
    p.add_argument("--frontier", metavar="PATH", default=None,
                   help="after training, print the candidates' time/energy Pareto frontier "
                        "and plot it as a PNG at PATH (needs matplotlib; --auto only)")
    p.add_argument("--memory-budget-gib", type=float, default=None,
                   help="plan for this much memory per device (--auto only): a tight budget "
                        "shows the memory planning (ZeRO-1, FSDP, optimizer state in host "
                        "memory); default: the device's memory less 10%%")
    p.add_argument("--verify", type=int, default=None, metavar="N",
                   help="compile the best candidates until N fit by XLA's memory analysis "
                        "and choose on XLA's figures; 0 trusts the model (--auto only); "
                        "default: auto_shard's")
    args = p.parse_args(argv)
    if args.frontier and not args.auto:
        p.error("--frontier needs --auto")
    if args.memory_budget_gib is not None and (not args.auto or args.memory_budget_gib <= 0):
        p.error("--memory-budget-gib needs --auto and a positive size")
    if args.verify is not None and (not args.auto or args.verify < 0):
        p.error("--verify needs --auto and a count of candidates, 0 or more")
    if args.steps < 1 or args.batch_size < 1 or args.image_size < 1:
        p.error("--steps, --batch-size and --image-size must be positive")
    return args


# --------------------------------------------------------------------------------------
# Synthetic, learnable ImageNet-shaped data
# --------------------------------------------------------------------------------------

#: Distinct batches generated up front and then cycled. A small fixed pool keeps data
#: generation out of the timed loop and lets the model fit it within a few steps.
POOL_BATCHES = 4
#: Labels are drawn from this many classes (of the model's num_classes outputs). With all
#: 1000 ImageNet classes a pool of 512 images holds each class about once, so the only thing
#: a few steps could learn is to memorise single images; with 32 each class has ~16 images
#: sharing its template, and the loss falls from ln(1000) within a few steps.
DATA_CLASSES = 32
#: Side of the per-class template before it is upsampled to the image size. Coarse
#: (blocky) templates make the class signal survive the strided first convolution.
TEMPLATE_SIDE = 8
NOISE_STD = 0.5


def synthetic_batches(
    *, batch_size: int, image_size: int, num_classes: int, seed: int,
    pool_batches: int = POOL_BATCHES, data_classes: int = DATA_CLASSES,
) -> list[dict[str, np.ndarray]]:
    """A fixed pool of ImageNet-shaped batches whose labels can actually be learned.

    Each class has a fixed random low-resolution template (TEMPLATE_SIDE^2 x 3, upsampled
    by pixel repetition); an image is its class's template plus Gaussian noise, and labels
    are drawn uniformly from the first min(num_classes, data_classes) classes. Pure noise
    with random labels would train at the same speed, but its loss would never fall, and a
    falling loss is the cheap end-to-end check that the sharded step computes the same
    thing as the single-device one.

    Returns `pool_batches` dicts {"image": float32 NHWC, "label": int32 [batch]} (numpy).
    Templates are made only for classes that occur, so they stay cheap at 224 px.
    """
    rng = np.random.default_rng(seed)
    high = min(num_classes, data_classes)
    labels = rng.integers(0, high, size=(pool_batches, batch_size), dtype=np.int32)
    used = np.unique(labels)
    coarse = rng.standard_normal((len(used), TEMPLATE_SIDE, TEMPLATE_SIDE, 3), dtype=np.float32)
    reps = -(-image_size // TEMPLATE_SIDE)  # ceil: upsample past the size, then crop
    templates = coarse.repeat(reps, axis=1).repeat(reps, axis=2)[:, :image_size, :image_size]
    index = np.searchsorted(used, labels)  # label -> row of `templates`
    pool = []
    for b in range(pool_batches):
        images = rng.standard_normal((batch_size, image_size, image_size, 3), dtype=np.float32)
        images *= NOISE_STD
        images += templates[index[b]]
        pool.append({"image": images, "label": labels[b]})
    return pool


def cycle(pool: list[Any]) -> Iterator[Any]:
    """Yield the pool's batches round-robin, forever."""
    while True:
        yield from pool


# --------------------------------------------------------------------------------------
# Optimizer and train step
# --------------------------------------------------------------------------------------


def make_optimizer(lr: float) -> optax.GradientTransformation:
    """Adam, whose per-parameter state (two mirrors of every parameter) the planner must
    place along with the parameters, the realistic case for memory.

    Tested on CPU (see the examples' defaults): at lr 3e-5 the loss of both nets falls
    steadily from step 1; at 1e-4 and above the first Adam steps, which move every weight
    by about lr at once, overshoot on these nets without normalisation and the loss rises
    before it falls. SGD with momentum diverged at the rates that made it learn in 8 steps.
    """
    import optax

    return optax.adam(lr)


def make_loss(model: nn.Module) -> Callable[[Any, dict[str, jax.Array]],
                                            tuple[jax.Array, jax.Array]]:
    """`loss_fn(params, batch) -> (loss, accuracy)`: softmax cross-entropy on integer labels,
    a mean over the batch (so micro-batching it changes nothing but rounding)."""
    import jax.numpy as jnp
    import optax

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        logits = model.apply(params, batch["image"])
        labels = batch["label"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        accuracy = (jnp.argmax(logits, axis=-1) == labels).mean()
        return loss, accuracy

    return loss_fn


def make_train_step(
    model: nn.Module, tx: optax.GradientTransformation,
) -> Callable[[Any, Any, dict[str, jax.Array]], tuple[Any, Any, dict[str, jax.Array]]]:
    """A plain single-device training step: `(params, opt_state, batch) -> (params, opt_state,
    metrics)`, with softmax cross-entropy on integer labels.

    `params` is the whole Linen variables dict returned by `model.init` (here just
    {"params": ...}: the models have no batch-norm state). Nothing in it knows about
    devices or sharding; that is what jaxwap adds from outside.
    """
    import jax
    import optax

    loss_fn = make_loss(model)

    def train_step(
        params: Any, opt_state: Any, batch: dict[str, jax.Array],
    ) -> tuple[Any, Any, dict[str, jax.Array]]:
        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "accuracy": accuracy}

    return train_step


# --------------------------------------------------------------------------------------
# Loop
# --------------------------------------------------------------------------------------


def train(
    step: Callable[..., Any], params: Any, opt_state: Any, batches: Iterator[Any], *,
    steps: int, batch_size: int, on_first_step: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run `steps` steps and time each one; the same code for jax.jit and auto_shard.

    Each step is timed to `jax.block_until_ready` of all its outputs, so the time is the
    step's real device time rather than dispatch time. The first step includes tracing and
    XLA compilation, so throughput is reported over the remaining steps. The returned state
    is always used for the next step: with buffer donation the inputs of a step are invalid
    after it.
    """
    import jax

    losses: list[float] = []
    times: list[float] = []
    for i in range(steps):
        batch = next(batches)
        t0 = time.perf_counter()
        params, opt_state, metrics = step(params, opt_state, batch)
        jax.block_until_ready((params, opt_state, metrics))
        dt = time.perf_counter() - t0
        loss, acc = float(metrics["loss"]), float(metrics["accuracy"])
        losses.append(loss)
        times.append(dt)
        note = "  (includes compile)" if i == 0 else ""
        print(f"step {i + 1:3d}/{steps}  loss {loss:7.4f}  acc {acc:6.3f}  "
              f"{dt * 1e3:9.1f} ms  {batch_size / dt:9.1f} img/s{note}", flush=True)
        if i == 0 and on_first_step is not None:
            on_first_step()
    steady = times[1:]
    images_per_s = batch_size * len(steady) / sum(steady) if steady else float("nan")
    return {"losses": losses, "times": times, "images_per_s": images_per_s,
            "params": params, "opt_state": opt_state}


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------


def print_frontier(plan: Any, path: str) -> None:
    """Print the plan's time/energy Pareto frontier and plot it (with every candidate) to
    `path`; without matplotlib, print the frontier and say how to get the plot."""
    print("Pareto frontier (step time vs energy per sample; fastest first):")
    batch = plan.batch_size or 1
    for c in plan.frontier():
        f = c.judged  # measured, else compiled, else predicted
        print(f"  {c.label:<10} {f.step_time_s * 1e3:10.3f} ms  "
              f"{f.energy_per_step_j / batch * 1e3:10.3f} mJ/sample  "
              f"{f.basis:>9}{'  CHOSEN' if c.chosen else ''}")
    try:
        out = plan.plot_frontier(path)
    except ImportError as e:
        print(f"frontier plot not written: {e}", file=sys.stderr)
    else:
        print(f"frontier plot written to {out}")


def main(
    model_cls: type[nn.Module], *, name: str, cpu_image_size: int, gpu_image_size: int = 224,
    argv: list[str] | None = None,
) -> dict[str, Any]:
    """Parse flags, build model/data/step, train, print a summary. Returns the loop's stats.

    `model_cls(num_classes=..., dtype=...)` must build a Flax Linen module taking NHWC images.
    """
    args = parse_args(f"Train {name} on synthetic ImageNet-shaped data, with or without "
                      f"jaxwap.auto_shard.", cpu_image_size=cpu_image_size,
                      gpu_image_size=gpu_image_size, argv=argv)
    t_start = time.perf_counter()

    import jax
    import jax.numpy as jnp

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    model = model_cls(num_classes=args.num_classes, dtype=dtype)
    tx = make_optimizer(args.lr)
    train_step = make_train_step(model, tx)

    devices = jax.devices()
    if platform() == "gpu" and devices[0].platform != "gpu":
        # An NVIDIA driver is present but jax has no CUDA backend (e.g. plain `pip install
        # jax`): the GPU-sized defaults would then run, very slowly, on one CPU device.
        print(f"warning: a GPU was detected but jax sees {devices[0].platform} devices only "
              f"(install jax[cuda12]?); set {PLATFORM_ENV}=cpu for CPU-sized defaults",
              file=sys.stderr)
    print(f"{name}: batch {args.batch_size}, {args.image_size}px, {args.dtype}, "
          f"{args.num_classes} classes, {args.steps} steps, "
          f"{'jaxwap.auto_shard' if args.auto else 'jax.jit on 1 device'}; "
          f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform}) visible")

    pool = synthetic_batches(batch_size=args.batch_size, image_size=args.image_size,
                             num_classes=args.num_classes, seed=args.seed)
    sample = jnp.zeros((1, args.image_size, args.image_size, 3), jnp.float32)
    params = jax.jit(model.init)(jax.random.key(args.seed), sample)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"parameters: {n_params / 1e6:.2f} M")

    on_first_step = None
    if args.auto:
        import jaxwap

        hardware = None
        if args.hardware:
            hardware = jaxwap.Cluster(args.hardware, num_devices=len(devices))
        opt_state = tx.init(params)
        budget = None if args.memory_budget_gib is None else args.memory_budget_gib * 2**30
        verify = {} if args.verify is None else {"verify": args.verify}
        step = jaxwap.auto_shard(train_step, params, objective=args.objective,
                                 hardware=hardware, memory_budget=budget, **verify)
        # Plan from shapes alone (the first call would do the same), so the data pool can be
        # laid out over the plan's data axis once, as the single-device path puts it on its
        # device once; otherwise every step would re-shard its batch from host memory.
        t0 = time.perf_counter()
        step.plan_for(params, opt_state, pool[0])
        pool = step.shard(pool)
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in step.plan.planning_time_s.items())
        print(f"planned in {time.perf_counter() - t0:.2f} s ({phases}; verify compiles "
              f"the finalists, the step itself is compiled on its first call)")
        on_first_step = lambda: print(step.plan.explain(), flush=True)
    else:
        if args.hardware or args.objective != "balanced":
            print("note: --hardware/--objective only apply with --auto", file=sys.stderr)
        device = devices[0]
        # Commit the whole state to the device: optax creates its step count without a
        # device, and an uncommitted input on step 1 vs a committed one on step 2 would
        # make jit compile twice.
        params, opt_state = jax.device_put((params, tx.init(params)), device)
        # Donating params/opt_state matches auto_shard's default (donate=True), so both
        # paths hold one copy of the training state.
        step = jax.jit(train_step, donate_argnums=(0, 1))
        pool = jax.device_put(pool, device)

    stats = train(step, params, opt_state, cycle(pool), steps=args.steps,
                  batch_size=args.batch_size, on_first_step=on_first_step)
    losses = stats["losses"]
    if args.auto and args.frontier:
        print_frontier(step.plan, args.frontier)
    elapsed = time.perf_counter() - t_start
    print(f"summary: {name} {'auto_shard' if args.auto else 'jit'} | loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f} over {args.steps} steps | {stats['images_per_s']:.1f} img/s "
          f"(steady state, steps 2-{args.steps}) | first step {stats['times'][0]:.1f} s | "
          f"total {elapsed:.1f} s")
    return stats
