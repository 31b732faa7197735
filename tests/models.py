"""Small models and steps the tests share (kept tiny: the suite runs on 2 CPU cores), and
checks more than one test makes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest


class MLP(nn.Module):
    widths: Sequence[int] = (64, 64, 10)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for w in self.widths[:-1]:
            x = nn.relu(nn.Dense(w)(x))
        return nn.Dense(self.widths[-1])(x)


class CNN(nn.Module):
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(self.num_classes)(x)


class BNNet(nn.Module):
    """`layers` of conv, batch norm and relu, then a dense head on the mean of the map."""

    channels: int = 16
    layers: int = 1

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        for _ in range(self.layers):
            x = nn.Conv(self.channels, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        return nn.Dense(10)(x.mean(axis=(1, 2)))


def make_bn_step(model: nn.Module, tx: optax.GradientTransformation) -> Any:
    """The Flax batch-norm train step: (params, batch_stats, opt_state, batch) -> (params,
    batch_stats, opt_state, {"loss"}), the running statistics carried as state."""

    def step(params, stats, opt_state, batch):
        def loss_fn(p):
            logits, new = model.apply({"params": p, "batch_stats": stats}, batch["x"],
                                      mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, new["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, {"loss": loss}

    return step


def make_step(model: nn.Module, tx: optax.GradientTransformation,
              regression: bool = False) -> Any:
    """An ordinary single-device train step: (params, opt_state, batch) -> (.., .., metrics).

    Cross-entropy on integer labels, or mean squared error on float targets."""

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            out = model.apply(p, batch["x"])
            if regression:
                return jnp.mean((out - batch["y"]) ** 2)
            return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    return train_step


def setup(model: nn.Module, x_shape: tuple[int, ...], num_classes: int = 10,
          tx: optax.GradientTransformation | None = None, seed: int = 0) -> tuple:
    """(step, params, opt_state, batch) with a deterministic batch."""
    tx = tx or optax.adam(1e-2)
    kx, ky, kp = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, x_shape)
    y = jax.random.randint(ky, (x_shape[0],), 0, num_classes)
    params = model.init(kp, x)
    return make_step(model, tx), params, tx.init(params), {"x": x, "y": y}


def copy_tree(tree: Any) -> Any:
    """A deep copy on the default device, so donation of one copy cannot touch the other."""
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def run_both(step: Any, params: Any, opt_state: Any, batch: Any, n_steps: int = 3,
             pass_params: bool = True, **options: Any) -> tuple[Any, Any, Any]:
    """`n_steps` of `step` under `jax.jit` on one device and under `jaxwap.auto_shard`
    with `options`, each from its own copy of the state: (the plain step's (params,
    opt_state, metrics), the sharded step's, the sharded step)."""
    import jaxwap

    ref_p, ref_o = copy_tree(params), copy_tree(opt_state)
    single = jax.jit(step)
    for _ in range(n_steps):
        ref_p, ref_o, ref_m = single(ref_p, ref_o, batch)
    sharded = jaxwap.auto_shard(step, params if pass_params else None, **options)
    p, o = copy_tree(params), copy_tree(opt_state)
    for _ in range(n_steps):
        p, o, m = sharded(p, o, batch)
    return (ref_p, ref_o, ref_m), (p, o, m), sharded


def abstract_setup(widths: Sequence[int], batch: int, in_dim: int, *,
                   regression: bool = False,
                   tx: optax.GradientTransformation | None = None) -> tuple:
    """(step, params, opt_state, batch), all jax.ShapeDtypeStruct: planning needs no arrays."""
    model, tx = MLP(tuple(widths)), tx or optax.adam(1e-3)
    params = jax.eval_shape(model.init, jax.random.key(0),
                            jax.ShapeDtypeStruct((1, in_dim), jnp.float32))
    y = (jax.ShapeDtypeStruct((batch, widths[-1]), jnp.float32) if regression
         else jax.ShapeDtypeStruct((batch,), jnp.int32))
    data = {"x": jax.ShapeDtypeStruct((batch, in_dim), jnp.float32), "y": y}
    return make_step(model, tx, regression), params, jax.eval_shape(tx.init, params), data


class TypedMLP(nn.Module):
    """`MLP` with its compute dtype and parameter dtype chosen (bfloat16 for both trains
    wholly in bfloat16: weights, gradients, their reductions and the optimizer state);
    float32 logits."""

    widths: Sequence[int] = (64, 64, 10)
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        for w in self.widths[:-1]:
            x = nn.relu(nn.Dense(w, dtype=self.dtype, param_dtype=self.param_dtype)(x))
        x = nn.Dense(self.widths[-1], dtype=self.dtype, param_dtype=self.param_dtype)(x)
        return x.astype(jnp.float32)


def host_setup(model: nn.Module, x_shape: tuple[int, ...], num_classes: int = 10,
               tx: optax.GradientTransformation | None = None, seed: int = 0) -> tuple:
    """`setup` without running the model: Flax's `init` applies it once, which compiles
    every op eagerly (or the whole forward pass under jit): seconds for a small CNN on 2
    cores. The parameters' shapes come from `jax.eval_shape`, their values from numpy:
    kernels N(0, 1/fan_in), LayerNorm/BatchNorm scales 1, biases 0; the batch too (x ~
    N(0, 1), integer labels). Returns (step, params, opt_state, batch)."""
    tx = tx or optax.adam(1e-2)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape, np.float32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct(x_shape,
                                                                               jnp.float32))

    def init(path: Any, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        if len(leaf.shape) >= 2:
            value = rng.standard_normal(leaf.shape, np.float32) / np.sqrt(
                np.prod(leaf.shape[:-1]))
        else:
            scale = getattr(path[-1], "key", None) == "scale"
            value = np.full(leaf.shape, 1.0 if scale else 0.0, np.float32)
        return jnp.asarray(value.astype(leaf.dtype))

    params = jax.tree_util.tree_map_with_path(init, shapes)
    batch = {"x": jnp.asarray(x),
             "y": jnp.asarray(rng.integers(0, num_classes, x_shape[0]).astype(np.int32))}
    return make_step(model, tx), params, jax.jit(tx.init)(params), batch


def analyze_step(step: Any, params: Any, *args: Any, batch_size: int | None) -> Any:
    """`graph.analyze` of `step(params, *args) -> new params` with the roles the planner
    gives (`jax.make_jaxpr` and `jaxwap.analysis.roles` alone)."""
    from jaxwap.analysis.graph import analyze
    from jaxwap.analysis.roles import classify_leaves, param_infos

    infos, _ = param_infos(params)
    identity = {id(leaf): j for j, leaf in enumerate(jax.tree_util.tree_leaves(params))}
    flat, _ = jax.tree_util.tree_flatten_with_path((params, *args))
    inputs = classify_leaves([("args", p, leaf) for p, leaf in flat], infos,
                             identity=identity, batch_size=batch_size)
    closed, out_shape = jax.make_jaxpr(step, return_shape=True)(params, *args)
    out_flat, _ = jax.tree_util.tree_flatten_with_path(out_shape)
    outputs = classify_leaves([("out", p, leaf) for p, leaf in out_flat], infos,
                              batch_size=batch_size, infer_batch=False)
    return analyze(closed, inputs.roles, outputs.roles, infos, batch_size)


def collectives_reproduced(cal: Any) -> None:
    """The profile's ring latency and collective overhead are what `collectives.ring_fit` makes
    of the all-reduce and all-gather calibration timed inside a program."""
    from jaxwap.cost.collectives import ring_fit

    ar, ag = cal.measurements["link"]["in_program_s"].values()
    assert ar > 0 and ag > 0
    assert (cal.spec.link_latency_s, cal.spec.collective_overhead_s) == \
        pytest.approx(ring_fit(ar, ag, cal.num_devices))


def mixed_mlp_plan(pins: Any, mesh_shape: Any = None, **options: Any) -> Any:
    """A 4-layer tanh MLP shaped like AlexNet's classifier (256 -> 256 -> 4096 -> 4096 ->
    10, batch 8, float32), trained by Adam, planned on a 4 x 1 mesh (or `mesh_shape`) with
    each layer's layout pinned through `constraints=` (and any other planning `options`),
    and its choice compiled (`verify=1`)."""
    import jaxwap

    widths = (256, 256, 4096, 4096, 10)

    def loss(p: Any, b: Any) -> Any:
        h = b["x"]
        for i in range(4):
            h = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            h = jnp.tanh(h) if i < 3 else h
        return jnp.mean((h - b["y"]) ** 2)

    def sds(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    params = {f"l{i}": {"w": sds(widths[i], widths[i + 1]), "b": sds(widths[i + 1])}
              for i in range(4)}
    step = jaxwap.make_train_step(loss, optax.adam(1e-3))
    return jaxwap.plan(step, params, jax.eval_shape(step.init, params),
                       {"x": sds(8, 256), "y": sds(8, 10)}, params=params,
                       mesh_shape=mesh_shape or {"data": 4, "model": 1}, constraints=pins,
                       verify=1, cache=False, **options)


def scanned_mlp_step(layers: int, d: int, rows: int) -> tuple[Any, Any, Any, Any]:
    """(step, params, opt_state, batch), abstract: a `make_train_step` step (Adam) over a
    `lax.scan` of `layers` residual MLP blocks of width `d` (hidden 4d), `rows` rows."""
    import jaxwap

    S = jax.ShapeDtypeStruct

    def loss(p, b):
        def layer(h, w):
            return h + jax.nn.gelu(h @ w["up"]) @ w["down"], None

        h, _ = jax.lax.scan(layer, b["x"], p["blocks"])
        return jnp.mean((h - b["y"]) ** 2)

    params = {"blocks": {"up": S((layers, d, 4 * d), jnp.float32),
                         "down": S((layers, 4 * d, d), jnp.float32)}}
    batch = {"x": S((rows, d), jnp.float32), "y": S((rows, d), jnp.float32)}
    step = jaxwap.make_train_step(loss, optax.adam(1e-4))
    return step, params, jax.eval_shape(step.init, params), batch
