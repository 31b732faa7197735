"""The optimizers people write, not just `optax.adam`: chains with clipping and masked
weight decay, schedules, gradient accumulation inside the optimizer (`optax.MultiSteps`),
per-group optimizers (`optax.multi_transform`, whose state holds `MaskedNode`s),
hyperparameters in the state (`inject_hyperparams`), integer and boolean counters
(`apply_if_finite`) and factored moments whose shapes are not the parameters'
(`adafactor`). Each step, sharded with FSDP and tensor parallelism on 8 CPU devices,
gives the single-device numbers; and a step micro-batched by the planner around an
optimizer that accumulates gradients itself gives them too."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from models import MLP, run_both, setup

import jaxwap

RTOL, ATOL = 2e-5, 2e-6   # f32 sums in another order (`test_equivalence`)


def _kernels(params):
    return jax.tree_util.tree_map(lambda x: x.ndim > 1, params)


def _groups(params):
    return jax.tree_util.tree_map(lambda x: "kernel" if x.ndim > 1 else "bias", params)


OPTIMIZERS = {
    "clip+adamw(schedule, masked decay)": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 1, 10),
                    weight_decay=0.1, mask=_kernels)),
    "MultiSteps(adam)": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "multi_transform": lambda: optax.multi_transform(
        {"kernel": optax.adam(1e-2), "bias": optax.sgd(1e-2)}, _groups),
    "inject_hyperparams(adamw)": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=1e-2, weight_decay=1e-3),
    "apply_if_finite(adam)": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    "adafactor": lambda: optax.adafactor(1e-2),
}


def _close(a, b):
    # leaves compared as float64 (integer and boolean counters among them)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(
        np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=RTOL, atol=ATOL), a, b)


def _both(step, params, opt, batch, steps=2, **options):
    """(the plan, the optimizer state after `steps`), the sharded step's every output
    equal to the plain step's (`models.run_both`)."""
    want, got, sharded = run_both(step, params, opt, batch, steps, cache=False, verify=0,
                                  **options)
    _close(want, got)
    return sharded.plan, got[1]


def _mirrors(plan, params, opt_state):
    """(each FSDP parameter's path, the sharding of every optimizer-state leaf that
    mirrors it: a leaf of its shape at a path ending in the parameter's)."""
    fsdp = {jax.tree_util.keystr(path) for (path, _), pl in zip(
        jax.tree_util.tree_leaves_with_path(params), plan.params, strict=True)
        if "fsdp" in pl.strategy}
    shapes = {jax.tree_util.keystr(path): x.shape
              for path, x in jax.tree_util.tree_leaves_with_path(params)}
    out = []
    for path, x in jax.tree_util.tree_leaves_with_path(opt_state):
        key = jax.tree_util.keystr(path)
        out += [(name, x.sharding) for name in fsdp
                if key.endswith(name) and x.shape == shapes[name]]
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_optimizers_state_shards_with_its_parameters_and_the_step_is_unchanged(name):
    step, params, opt, batch = setup(MLP(), (32, 16), tx=OPTIMIZERS[name]())
    plan, state = _both(step, params, opt, batch, mesh_shape={"data": 4, "model": 2},
                        strategies=("fsdp", "tp"))
    assert dict(plan.mesh_shape) == {"data": 4, "model": 2}
    used = {p.strategy for p in plan.params}
    assert any("fsdp" in s for s in used) and any("tp" in s for s in used), used
    # the moments (and MultiSteps' accumulated gradients) of an FSDP parameter are
    # sharded as it is, not held whole on every device
    mirrors = _mirrors(plan, params, state)
    assert mirrors
    for path, sharding in mirrors:
        assert not sharding.is_fully_replicated, (path, sharding)


def test_micro_batches_around_an_optimizer_that_accumulates_gradients_itself():
    # MultiSteps averages two steps' gradients before one update; the planner's
    # micro-batches average each step's first: an update every second step, equal
    tx = optax.MultiSteps(optax.sgd(1e-2, momentum=0.9), every_k_schedule=2)
    model = MLP()

    def loss(p, b):
        logits = model.apply(p, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    _, params, opt, batch = setup(model, (2048, 16), tx=tx)
    step = jaxwap.make_train_step(loss, tx)
    # a budget under the step as written's predicted peak on one device and over its
    # state: only micro-batches make it fit
    whole = jaxwap.plan(step, params, opt, batch, params=params, num_devices=1, verify=0,
                        cache=False, offload=False)
    state = sum(x.nbytes for x in jax.tree.leaves((params, opt)))
    peak = whole.predicted.peak_memory_bytes
    assert whole.step.is_plain and peak > 2 * state, (peak, state)
    plan, _ = _both(step, params, opt, batch, steps=4, num_devices=1, offload=False,
                 memory_budget=(peak + 2 * state) / 3)
    assert plan.step.micro_batches > 1, plan.step.describe()
