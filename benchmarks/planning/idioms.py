"""The models users actually write, planned as a new user would plan them.

    .venv/bin/python -m benchmarks.planning.idioms

Each row is one idiom of a mature JAX codebase, planned with `jaxwap.plan` (`verify=0`)
from this CPU for the hardware named; the row says what the user sees: the plan's mesh
and step, or the error. Every figure is **predicted** (the planner's model); nothing is
measured. Writes `benchmarks/results/idioms/cpu.md`.

- Flax Linen's layer scan, `nn.scan(Block, variable_axes={"params": 0}, length=L)` with
  `nn.remat` inside (MaxText's `scan_layers`), on a cluster of nodes;
- the same scan with `nn.Dropout` and `split_rngs={"dropout": True}` (a key per layer):
  dropout off but a key passed (MaxText's way), on the cluster; dropout on, no remat
  written and a dropout key in the batch, for 8 H100s;
- a `lax.fori_loop` over stacked layers reading `w[i]`, for 8 H100s;
- NNX layers made by `nnx.vmap` and run by `nnx.scan`, on the same cluster;
- cuDNN attention, `jax.nn.dot_product_attention(..., implementation="cudnn")`, in a
  Llama-shaped step, for 8 H100s;
- XLA attention at sequence 8192 (a Llama-3.1-8B-shaped step, global batch 8): what
  `explain()` advises;
- a fixed mesh with a model axis, `mesh_shape={"data": 1, "model": 4}`, on Alpa's MLP
  (six 256-wide layers, batch 32) where bytes dominate;
- a Flax example's own logical-axis rules with names left out.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxwap  # noqa: E402
from benchmarks import harness  # noqa: E402
from jaxwap.core.records import STAGE  # noqa: E402

NODES = jaxwap.Cluster("h100-sxm", 64, devices_per_node=8, inter_node_bandwidth=12.5e9)
H100X8 = jaxwap.Cluster("h100-sxm", 8)


def _sds(*shape: int, dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _plan_of(step: Any, params: Any, batch: Any, hardware: jaxwap.Cluster,
             **options: Any) -> Callable[[], jaxwap.Plan]:
    """The row's plan, made when called: `jaxwap.plan` of `step` from abstract arguments
    (its optimizer state `eval_shape`d), analytic (`verify=0`) and uncached."""
    return lambda: jaxwap.plan(step, params, jax.eval_shape(step.init, params), batch,
                               hardware=hardware, verify=0, cache=False, **options)


def _xent(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class _Block(nn.Module):
    d: int

    @nn.compact
    def __call__(self, h: jax.Array, mask: jax.Array) -> tuple[jax.Array, None]:
        h = h + nn.MultiHeadDotProductAttention(num_heads=8, qkv_features=self.d)(
            nn.LayerNorm()(h), mask=mask)
        return h + nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(nn.LayerNorm()(h)))), None


class _LinenDecoder(nn.Module):
    layers: int
    d: int
    vocab: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        blocks = nn.scan(nn.remat(_Block), variable_axes={"params": 0},
                         split_rngs={"params": True}, in_axes=nn.broadcast,
                         length=self.layers)
        h, _ = blocks(self.d)(nn.Embed(self.vocab, self.d)(x), nn.make_causal_mask(x))
        return nn.Dense(self.vocab)(nn.LayerNorm()(h))


def linen_scan() -> tuple[str, Callable[[], jaxwap.Plan]]:
    model = _LinenDecoder(layers=32, d=1024, vocab=32000)
    tokens = _sds(256, 1024, dtype=jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))["params"]
    step = jaxwap.make_train_step(
        lambda p, b: _xent(model.apply({"params": p}, b["x"]), b["y"]), optax.adam(1e-4))
    batch = {"x": tokens, "y": tokens}
    return ("Linen nn.scan(length=32) + nn.remat decoder (d 1024, seq 1024, batch 256), "
            "64 H100 in 8 nodes at 100 Gb/s",
            _plan_of(step, params, batch, NODES, objective="throughput"))


class _DropoutBlock(nn.Module):
    d: int
    deterministic: bool = False

    @nn.compact
    def __call__(self, h: jax.Array, _: None) -> tuple[jax.Array, None]:
        y = nn.Dropout(0.1, deterministic=self.deterministic)(nn.gelu(nn.Dense(4 * self.d)(
            nn.LayerNorm()(h))))
        return h + nn.Dense(self.d)(y), None


class _LinenDropout(nn.Module):
    layers: int
    d: int
    vocab: int
    deterministic: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        blocks = nn.scan(_DropoutBlock, variable_axes={"params": 0},
                         split_rngs={"params": True, "dropout": True}, length=self.layers)
        h, _ = blocks(self.d, self.deterministic)(nn.Embed(self.vocab, self.d)(x), None)
        return nn.Dense(self.vocab)(nn.LayerNorm()(h))


def _dropout_step(model: _LinenDropout, tokens: jax.ShapeDtypeStruct
                  ) -> tuple[jaxwap.TrainStep, Any, Any]:
    """(step, params, batch) of the Linen dropout model, the step passing the batch's
    dropout key to `apply`, as Flax's examples and MaxText do."""
    params = jax.eval_shape(lambda: model.init(
        {"params": jax.random.key(0), "dropout": jax.random.key(1)}, tokens))["params"]

    def loss(p: Any, b: Any) -> jax.Array:
        logits = model.apply({"params": p}, b["x"],
                             rngs={"dropout": jax.random.wrap_key_data(b["key"])})
        return _xent(logits, b["y"])

    step = jaxwap.make_train_step(loss, optax.adam(1e-4))
    return step, params, {"x": tokens, "y": tokens, "key": _sds(2, dtype=jnp.uint32)}


def linen_scan_dropout_off() -> tuple[str, Callable[[], jaxwap.Plan]]:
    step, params, batch = _dropout_step(
        _LinenDropout(layers=48, d=2048, vocab=32000, deterministic=True),
        _sds(256, 1024, dtype=jnp.int32))
    return ("Linen nn.scan(length=48) with dropout off (deterministic) but a dropout key "
            "passed and split over the layers (MaxText's way; d 2048, seq 1024, batch "
            "256), 64 H100 in 8 nodes at 100 Gb/s",
            _plan_of(step, params, batch, NODES, objective="throughput"))


def linen_scan_dropout() -> tuple[str, Callable[[], jaxwap.Plan]]:
    model = _LinenDropout(layers=32, d=1024, vocab=32000)
    tokens = _sds(1024, 1024, dtype=jnp.int32)
    step, params, batch = _dropout_step(model, tokens)
    return ("Linen nn.scan(length=32) with nn.Dropout (split_rngs dropout: a key per layer), "
            "no remat written (d 1024, seq 1024, batch 1024; a dropout key in the batch), "
            "8 H100",
            _plan_of(step, params, batch, H100X8, objective="throughput"))


def fori_stack() -> tuple[str, Callable[[], jaxwap.Plan]]:
    layers, d = 32, 2048
    params = {"embed": _sds(32000, d), "w_in": _sds(layers, d, 4 * d),
              "w_out": _sds(layers, 4 * d, d), "head": _sds(d, 32000)}

    def loss(p: Any, b: Any) -> jax.Array:
        def layer(i: jax.Array, h: jax.Array) -> jax.Array:
            w_in, w_out = p["w_in"][i].astype(jnp.bfloat16), p["w_out"][i].astype(jnp.bfloat16)
            return h + jax.nn.gelu(h @ w_in) @ w_out
        h = jax.lax.fori_loop(0, layers, layer, p["embed"].astype(jnp.bfloat16)[b["x"]])
        return _xent((h @ p["head"].astype(jnp.bfloat16)).astype(jnp.float32), b["y"])

    step = jaxwap.make_train_step(loss, optax.adam(1e-4))
    tokens = _sds(256, 2048, dtype=jnp.int32)
    batch = {"x": tokens, "y": tokens}
    return ("a lax.fori_loop over 32 stacked MLP layers reading w[i] (d 2048, seq 2048, "
            "batch 256), 8 H100",
            _plan_of(step, params, batch, H100X8, objective="throughput"))


class _NnxBlock(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + self.down(jax.nn.gelu(self.up(h)))


class _NnxStack(nnx.Module):
    def __init__(self, layers: int, d: int, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(r: nnx.Rngs) -> _NnxBlock:
            return _NnxBlock(d, r)

        self.blocks = make(rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h: jax.Array, block: _NnxBlock) -> jax.Array:
            return block(h)

        return run(h, self.blocks)


def nnx_scan() -> tuple[str, Callable[[], jaxwap.Plan]]:
    graphdef, params = nnx.split(nnx.eval_shape(lambda: _NnxStack(48, 2048, nnx.Rngs(0))),
                                 nnx.Param)
    step = jaxwap.make_train_step(
        lambda p, b: jnp.mean((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2),
        optax.adam(1e-4))
    batch = {"x": _sds(2048, 2048), "y": _sds(2048, 2048)}
    return ("NNX nnx.vmap-made layers run by nnx.scan (48 MLP blocks d 2048, batch 2048), "
            "64 H100 in 8 nodes at 100 Gb/s",
            _plan_of(step, params, batch, NODES, objective="throughput"))


def _cudnn(q: Any, k: Any, v: Any, *_: Any, **__: Any) -> Any:
    """The zoo Llama's grouped attention (q [B, T, KV, G, H], k and v [B, S, KV, H]) as
    cuDNN's fused kernel: query head kv * G + g reads key head kv, as jax's GQA does."""
    b, t, kv, g, hd = q.shape
    out = jax.nn.dot_product_attention(q.reshape(b, t, kv * g, hd), k, v, is_causal=True,
                                       implementation="cudnn")
    return out.reshape(b, t, kv, g, hd)


@contextlib.contextmanager
def _cudnn_attention() -> Iterator[None]:
    """The zoo Llama's attention is cuDNN's while the block is traced (the step calls the
    zoo module's `causal_attention` when jaxwap traces it)."""
    from benchmarks.models import zoo

    saved, zoo.causal_attention = zoo.causal_attention, _cudnn
    try:
        yield
    finally:
        zoo.causal_attention = saved


def _llama(cudnn: bool) -> Callable[[], jaxwap.Plan]:
    """Planning a Llama-3.1-8B-shaped step (the zoo's, abstract; seq 8192, batch 8) for
    8 H100s with XLA's attention or cuDNN's."""
    from benchmarks.models import zoo

    w = zoo.llama("llama_8b", seq_len=8192, batch_size=8)

    def run() -> jaxwap.Plan:
        with _cudnn_attention() if cudnn else contextlib.nullcontext():
            return jaxwap.plan(w.step, *w.args, hardware=H100X8, verify=0, cache=False)
    return run


def cudnn_attention() -> tuple[str, Callable[[], jaxwap.Plan]]:
    return ("Llama-3.1-8B shape, cuDNN attention (implementation='cudnn'), seq 8192, "
            "batch 8, 8 H100, planned from this CPU", _llama(True))


def xla_attention() -> tuple[str, Callable[[], jaxwap.Plan]]:
    return "Llama-3.1-8B shape, XLA attention, seq 8192, batch 8, 8 H100", _llama(False)


def alpa_mlp() -> tuple[str, Callable[[], jaxwap.Plan]]:
    layers = {f"l{i}": {"w": _sds(256, 256), "b": _sds(256)} for i in range(6)}

    def loss(p: Any, b: Any) -> jax.Array:
        h = b["x"]
        for i in range(6):
            h = jax.nn.relu(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return jnp.mean((h - b["y"]) ** 2)

    step = jaxwap.make_train_step(loss, optax.sgd(0.1))
    batch = {"x": _sds(32, 256), "y": _sds(32, 256)}
    slow = jaxwap.Cluster("h100-sxm", 4, link_bandwidth=1e9)
    return ("Alpa's MLP (6 x 256, batch 32), mesh_shape={'data': 1, 'model': 4}, "
            "4 H100 at 1 GB/s",
            _plan_of(step, layers, batch, slow, mesh_shape={"data": 1, "model": 4}))


def logical_rules() -> tuple[str, Callable[[], jaxwap.Plan]]:
    init = nn.initializers.lecun_normal()

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = nn.Dense(1024, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
            return nn.Dense(256, kernel_init=nn.with_logical_partitioning(
                init, ("mlp", "embed")))(jax.nn.relu(h))

    model = Mlp()
    x = _sds(64, 256)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape)))["params"]
    params = nn.unbox(boxed)
    # a Flax example's rules: "embed" left out, "mlp" over the tensor axis
    rules = (("batch", "data"), ("mlp", "model"))
    cons = jaxwap.logical_constraints(boxed, rules)
    step = jaxwap.make_train_step(
        lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2),
        optax.sgd(0.1))
    batch = {"x": x, "y": _sds(64, 256)}
    return ("Flax logical partitioning with the example's rules (('batch', 'data'), "
            "('mlp', 'model')), 'embed' unlisted",
            _plan_of(step, params, batch, H100X8, constraints=cons,
                     mesh_shape={"data": 2, "model": 4}))


def _seen(plan: jaxwap.Plan) -> str:
    shape = " x ".join(f"{a}={s}" for a, s in plan.mesh_shape.items() if s > 1) or "1 device"
    step = plan.step.describe()
    pr = plan.predicted
    tp = sorted({p.strategy for p in plan.params if "tp" in p.strategy})
    parts = [f"plan: {shape}, {step}", f"step {pr.step_time_s * 1e3:.1f} ms (predicted)",
             f"peak {pr.peak_memory_bytes / 1e9:.2f} GB/device (predicted)"]
    if tp:
        parts.append("layouts " + ", ".join(tp))
    if plan.attention is not None:
        parts.append("explain() advises fused attention")
    notes = [n for n in plan.notes if n.startswith(("pipelining not considered",
                                                     "step variant skipped"))]
    staged = [c for c in plan.candidates if dict(c.mesh_shape).get(STAGE, 1) > 1]
    if staged and not dict(plan.mesh_shape).get(STAGE, 1) > 1:
        best = min(staged, key=lambda c: c.predicted.step_time_s)
        mesh = " x ".join(f"{a}={n}" for a, n in best.mesh_shape if n > 1)
        notes.append(f"pipelines weighed, the best {mesh} at "
                     f"{best.predicted.step_time_s * 1e3:.1f} ms (predicted)")
    return "; ".join(parts + notes)


def main() -> None:
    rows = []
    for make in (linen_scan, linen_scan_dropout_off, linen_scan_dropout, fori_stack, nnx_scan,
                 cudnn_attention, xla_attention, alpa_mlp, logical_rules):
        what, run = make()
        t0 = time.perf_counter()
        try:
            plan = run()
            seen = _seen(plan)
            if make is xla_attention:
                seen += "\n\n```\n" + "\n".join(
                    line for line in plan.explain().splitlines()
                    if "attention" in line or "cudnn" in line) + "\n```"
        except Exception as e:  # noqa: BLE001 - what a user would see is the row
            seen = f"**{type(e).__name__}**: {str(e).splitlines()[0][:300]}"
        secs = time.perf_counter() - t0
        rows.append((what, seen, secs))
        print(f"- {what}\n  {seen}\n  ({secs:.1f} s to plan, measured on this CPU)", flush=True)
    out = harness.results_dir("idioms") / "cpu.md"
    lines = ["# Idioms: what a user sees", "",
             "`.venv/bin/python -m benchmarks.planning.idioms`: each idiom planned with "
             "`jaxwap.plan(..., verify=0)` from a CPU host. Step times and memory are "
             "**predicted**; planning time is **measured** on the host that ran it.", ""]
    for what, seen, secs in rows:
        lines += [f"## {what}", "", seen, "", f"Planned in {secs:.1f} s.", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
