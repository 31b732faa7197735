"""The model zoo the benchmarks share: four training steps, built from shapes alone.

Each builder returns a `Workload`: the train step, the abstract arguments it takes, the
abstract parameter tree inside them, and the batch size. Everything is abstract
(`jax.eval_shape` / `nnx.eval_shape` / `jax.ShapeDtypeStruct`), so building a GPT-2-small
at sequence length 1024 or VGG-16 at 224 px allocates nothing and takes about a second at most:

    from benchmarks.models import zoo              # (from the repository root)
    w = zoo.gpt2()                                 # or zoo.WORKLOADS["gpt2"](), zoo.small("gpt2")
    plan = jaxwap.plan(w.step, *w.args, params=w.params, hardware=jaxwap.Cluster("h100-sxm", 8))
    compiled = jax.jit(w.step).lower(*w.args).compile()
    out = jax.jit(w.step)(*w.init(0))              # real arrays, when a run is wanted

The four models, and what their steps take:

- ``alexnet`` / ``vgg16``: the examples' own Linen modules, Adam and train step
  (`examples/models.py`, `examples/common.py`), reused unchanged:
  ``step(params, opt_state, batch) -> (params, opt_state, metrics)``, where ``params`` is the
  whole Linen variables dict ``{"params": ...}`` and ``batch = {"image": f32[B, S, S, 3],
  "label": i32[B]}``.
- ``resnet50``: a Flax Linen ResNet-50 (v1.5: stride on the 3x3 conv, as in the Flax
  ImageNet example and torchvision) with batch norm, trained the Flax ImageNet way:
  ``step(params, batch_stats, opt_state, batch) -> (params, batch_stats, opt_state,
  metrics)``. ``params`` is ``variables["params"]`` (what Adam updates; the `Workload.params`
  tree), ``batch_stats`` is ``variables["batch_stats"]`` (running means/variances, updated
  by ``apply(..., mutable=["batch_stats"])``, not by the optimizer). Loss is softmax
  cross-entropy plus the example's L2 penalty (``0.5 * weight_decay * sum(w**2)`` over
  kernels).
- ``gpt2``: a GPT-2-shaped decoder in Flax NNX with plain-jnp causal attention:
  ``step(params, opt_state, batch) -> (params, opt_state, metrics)``, where ``params`` is the
  ``nnx.State`` of ``nnx.Param`` from ``nnx.split(model, nnx.Param)`` (the step calls
  ``nnx.merge(graphdef, params)``) and ``batch = {"inputs": i32[B, T], "targets": i32[B, T]}``
  (targets are inputs shifted by one; next-token cross-entropy). The LM head is tied to the
  token embedding by default (``tie_embeddings=True``, as in GPT-2: 124.4 M parameters).

Every optimizer is ``optax.adam`` (made by the examples' ``make_optimizer``). Parameters are
float32; ``dtype`` is the compute dtype (activations, matmul inputs), bfloat16 by default as
on GPU (the examples' and ``plan_time.py``'s GPU default); losses and softmaxes are float32.

`small(name)` is a CI-sized version of each (32 px images or a 2-layer GPT, few classes,
float32) that compiles and runs on CPU in seconds. For runs, `Workload.init(seed)` gives real
arrays matching `args` from the model's own initialisers (it compiles `init`: seconds on a
CPU), `Workload.synthetic(seed)` cheap numpy-made ones of the same shapes. Both allocate, so
call them only when you mean to.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxwap
from benchmarks.harness import ROOT

EXAMPLES = ROOT / "examples"

DTypeLike = Any  # a jnp dtype, numpy dtype or its name ("bfloat16", "float32")


# --------------------------------------------------------------------------------------
# The examples' modules, loaded by file path
# --------------------------------------------------------------------------------------


def load_example(stem: str) -> ModuleType:
    """Import `examples/<stem>.py` under a private module name.

    Not `sys.path.insert(0, "examples"); import models`: the test suite has its own
    `tests/models.py`, imported as `models`, and whichever came first would shadow the other
    in `sys.modules`. The module is registered before it runs, which Linen's dataclasses need.
    `examples/common.py` imports no jax at module level and nothing here calls its
    `setup_devices`, so loading it changes no device settings.
    """
    name = f"_jaxwap_examples_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


_common = load_example("common")
_models = load_example("models")
AlexNet = _models.AlexNet
VGG16 = _models.VGG16
make_optimizer = _common.make_optimizer
make_train_step = _common.make_train_step
make_loss = _common.make_loss


# --------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A training step and abstract arguments for it.

    `args` is exactly what `step(*args)` takes (pytrees of `jax.ShapeDtypeStruct`);
    `params` is the abstract parameter tree among them (the tree to pass to
    `jaxwap.plan(..., params=...)`); `init(seed)` returns concrete arrays shaped like `args`
    (random parameters as the model initialises them, optimizer state, a random batch).
    """

    name: str
    step: Callable[..., Any]
    args: tuple[Any, ...]
    params: Any
    batch_size: int
    description: str
    #: integer entries of the batch (labels; tokens for GPT) lie in [0, num_classes)
    num_classes: int = 0
    init: Callable[[int], tuple[Any, ...]] | None = dataclasses.field(
        default=None, repr=False, compare=False)

    @property
    def num_params(self) -> int:
        """Number of parameter elements (of `params`)."""
        return sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(self.params))

    @property
    def param_bytes(self) -> int:
        return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(self.params))

    def synthetic(self, seed: int = 0) -> tuple[Any, ...]:
        """Concrete arrays shaped like `args` without running the model's initialisers.

        A cheap stand-in for `init` (which compiles the model's `init`, many seconds on a
        CPU): parameters ~ N(0, 1/fan_in) for kernels and embeddings, 1 for norm scales,
        0 for biases; other state 0, except running variances ('var') 1; optimizer state 0
        (Adam's own initial state); float batch entries N(0, 1), integer ones uniform in
        [0, num_classes). Good for checking that a step runs and its loss is finite.
        """
        rng = np.random.default_rng(seed)

        def param(path: Any, leaf: jax.ShapeDtypeStruct) -> jax.Array:
            name = _last_name(path)
            if len(leaf.shape) >= 2:
                fan_in = int(np.prod(leaf.shape[:-1]))
                x = rng.standard_normal(leaf.shape, np.float32) / np.sqrt(fan_in)
            else:
                x = np.full(leaf.shape, 1.0 if name == "scale" else 0.0, np.float32)
            return jnp.asarray(x, leaf.dtype)

        def state(path: Any, leaf: jax.ShapeDtypeStruct) -> jax.Array:
            return jnp.full(leaf.shape, 1 if _last_name(path) == "var" else 0, leaf.dtype)

        def data(leaf: jax.ShapeDtypeStruct) -> jax.Array:
            if jnp.issubdtype(leaf.dtype, jnp.integer):
                return jnp.asarray(rng.integers(0, max(self.num_classes, 1), leaf.shape),
                                   leaf.dtype)
            return jnp.asarray(rng.standard_normal(leaf.shape, np.float32), leaf.dtype)

        *state_args, batch = self.args
        out = [jax.tree_util.tree_map_with_path(param if a is self.params else state, a)
               for a in state_args]
        return (*out, jax.tree.map(data, batch))


def step_runner(cs: Any, layout: Any, state: list[Any]) -> Callable[..., Any]:
    """`run()`: one step of a compiled zoo step (`CompiledStep` cs, traced as `layout`) as a
    training loop runs an `auto_shard` step: the arguments in their pytrees, read and
    placed on each call by the call `auto_shard`'s step makes (`step_call.StepCall`). Every zoo
    step takes (*state, batch) and returns (*new state, metrics); `state` holds the flat
    arguments, already placed, and each step's new state is the next step's arguments
    (donated buffers are never reused). `run(block=False)` dispatches without waiting for
    the device. Returns the outputs."""
    from jaxwap.analysis.trace import signature
    from jaxwap.runtime.step_call import StepCall

    args, _ = jax.tree_util.tree_unflatten(layout.args_treedef, state)
    args = list(args)
    call = StepCall(cs, layout, signature(args, {})[0])

    def run(block: bool = True) -> Any:
        _, leaves = call.leaves_of(args, {})
        out = call(leaves)
        if block:
            jax.block_until_ready(out)
        args[:-1] = out[:-1]     # the batch comes last
        return out
    return run


def wall_times(run: Callable[[], Any], steps: int, warm: int = 3) -> list[float]:
    """Seconds of each of `steps` calls of `run` (each blocking until its step is done),
    after `warm` calls untimed (compilation, first-touch memory)."""
    for _ in range(warm):
        run()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        walls.append(time.perf_counter() - t0)
    return walls


def _last_name(path: Any) -> str:
    """The last named entry of a key path (skipping NNX's trailing `.value`)."""
    for key in reversed(path):
        name = getattr(key, "key", getattr(key, "name", None))
        if isinstance(name, str) and name != "value":
            return name
    return ""


def _dtype(dtype: DTypeLike) -> Any:
    return jnp.dtype(dtype)


def _image_batch(batch_size: int, image_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {"image": jax.ShapeDtypeStruct((batch_size, image_size, image_size, 3), jnp.float32),
            "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}


def _random_image_batch(seed: int, batch_size: int, image_size: int,
                        num_classes: int) -> dict[str, jax.Array]:
    k_img, k_lbl = jax.random.split(jax.random.key(seed + 1))
    return {"image": jax.random.normal(k_img, (batch_size, image_size, image_size, 3),
                                       jnp.float32),
            "label": jax.random.randint(k_lbl, (batch_size,), 0, num_classes, jnp.int32)}


# --------------------------------------------------------------------------------------
# AlexNet and VGG-16: the examples' models and step
# --------------------------------------------------------------------------------------


def _example_cnn(name: str, model_cls: type[nn.Module], *, batch_size: int, image_size: int,
                 num_classes: int, dtype: DTypeLike, lr: float,
                 restructurable: bool = False) -> Workload:
    dtype = _dtype(dtype)
    model = model_cls(num_classes=num_classes, dtype=dtype)
    tx = make_optimizer(lr)
    batch = _image_batch(batch_size, image_size)
    params = jax.eval_shape(model.init, jax.random.key(0), batch["image"])
    opt_state = jax.eval_shape(tx.init, params)

    def init(seed: int = 0) -> tuple[Any, ...]:
        sample = jnp.zeros((1, image_size, image_size, 3), jnp.float32)
        p = jax.jit(model.init)(jax.random.key(seed), sample)
        return p, tx.init(p), _random_image_batch(seed, batch_size, image_size, num_classes)

    step = (jaxwap.make_train_step(make_loss(model), tx, has_aux=True) if restructurable
            else make_train_step(model, tx))
    return Workload(
        name=name, step=step, args=(params, opt_state, batch),
        params=params, batch_size=batch_size, num_classes=num_classes,
        description=(f"{model_cls.__name__} (examples/models.py), {image_size}px, batch "
                     f"{batch_size}, {num_classes} classes, compute {dtype.name}, Adam "
                     f"lr {lr:g}; step(params, opt_state, batch), params = Linen variables"),
        init=init)


def alexnet(batch_size: int = 128, image_size: int = 224, dtype: DTypeLike = jnp.bfloat16, *,
            num_classes: int = 1000, lr: float = 3e-5, restructurable: bool = False) -> Workload:
    """AlexNet from `examples/models.py` with the examples' Adam and step (62.4 M at 224 px).
    `restructurable=True`: the same loss and Adam as a `jaxwap.make_train_step` step (which
    returns `(params, opt_state, (loss, accuracy))`)."""
    return _example_cnn("alexnet", AlexNet, batch_size=batch_size, image_size=image_size,
                        num_classes=num_classes, dtype=dtype, lr=lr,
                        restructurable=restructurable)


def vgg16(batch_size: int = 128, image_size: int = 224, dtype: DTypeLike = jnp.bfloat16, *,
          num_classes: int = 1000, lr: float = 3e-5, restructurable: bool = False) -> Workload:
    """VGG-16 from `examples/models.py` with the examples' Adam and step (138.4 M at 224 px);
    `restructurable` as for `alexnet`."""
    return _example_cnn("vgg16", VGG16, batch_size=batch_size, image_size=image_size,
                        num_classes=num_classes, dtype=dtype, lr=lr,
                        restructurable=restructurable)


# --------------------------------------------------------------------------------------
# ResNet-50 (Flax Linen, batch norm), Flax-ImageNet-style step
# --------------------------------------------------------------------------------------


class BottleneckBlock(nn.Module):
    """1x1 -> 3x3 (strided) -> 1x1 (x4 channels), batch norm after each, projection shortcut
    when the shape changes. The last norm starts at scale 0, so each block starts as the
    identity (as in the Flax ImageNet example). `inner` widens the first two convolutions
    and `groups` splits the 3x3 one (ResNeXt's cardinality); `se_reduction` > 0 adds a
    squeeze-and-excitation gate on the block's output (SE-ResNeXt)."""

    filters: int
    strides: int = 1
    dtype: Any = jnp.float32
    inner: int | None = None
    groups: int = 1
    se_reduction: int = 0

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        conv = partial(nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32)
        norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                       dtype=self.dtype, param_dtype=jnp.float32)
        inner = self.inner or self.filters
        residual = x
        y = nn.relu(norm(name="bn1")(conv(inner, (1, 1), name="conv1")(x)))
        y = conv(inner, (3, 3), strides=(self.strides, self.strides),
                 feature_group_count=self.groups, name="conv2")(y)
        y = nn.relu(norm(name="bn2")(y))
        y = conv(self.filters * 4, (1, 1), name="conv3")(y)
        y = norm(scale_init=nn.initializers.zeros, name="bn3")(y)
        if self.se_reduction:
            dense = partial(nn.Dense, dtype=self.dtype, param_dtype=jnp.float32)
            s = jnp.mean(y, axis=(1, 2))
            s = nn.relu(dense(self.filters * 4 // self.se_reduction, name="se_reduce")(s))
            y = y * nn.sigmoid(dense(self.filters * 4, name="se_expand")(s))[:, None, None, :]
        if residual.shape != y.shape:
            residual = conv(self.filters * 4, (1, 1), strides=(self.strides, self.strides),
                            name="proj_conv")(residual)
            residual = norm(name="proj_bn")(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    """Bottleneck ResNet; the defaults are ResNet-50 (stages [3, 4, 6, 3], widths 64..512).
    `groups` x `width_per_group` (x 2 per stage) make it a ResNeXt (32 x 4: 32x4d), and
    `se_reduction` an SE-ResNeXt.

    Input NHWC images; output float32 logits. `train` selects batch statistics (and updates
    the running ones, with `mutable=["batch_stats"]`) or the running averages.
    """

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    width: int = 64
    num_classes: int = 1000
    dtype: Any = jnp.float32
    groups: int = 1
    width_per_group: int = 0
    se_reduction: int = 0

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = x.astype(self.dtype)
        x = nn.Conv(self.width, (7, 7), strides=(2, 2), padding=((3, 3), (3, 3)), use_bias=False,
                    dtype=self.dtype, param_dtype=jnp.float32, name="conv_init")(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                         dtype=self.dtype, param_dtype=jnp.float32, name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, blocks in enumerate(self.stage_sizes):
            for j in range(blocks):
                strides = 2 if i > 0 and j == 0 else 1
                inner = self.groups * self.width_per_group * 2**i or None
                x = BottleneckBlock(self.width * 2**i, strides=strides, dtype=self.dtype,
                                    inner=inner, groups=self.groups,
                                    se_reduction=self.se_reduction,
                                    name=f"stage{i + 1}_block{j + 1}")(x, train)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=jnp.float32,
                     name="head")(x)
        return x.astype(jnp.float32)


def make_resnet_train_step(model: nn.Module, tx: optax.GradientTransformation,
                           weight_decay: float = 1e-4) -> Callable[..., Any]:
    """`(params, batch_stats, opt_state, batch) -> (params, batch_stats, opt_state, metrics)`,
    as in the Flax ImageNet example: apply with `mutable=["batch_stats"]`, cross-entropy plus
    an L2 penalty on kernels (leaves with ndim > 1), Adam on params only."""

    def loss_fn(params: Any, batch_stats: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any]:
        logits, new_state = model.apply({"params": params, "batch_stats": batch_stats},
                                        batch["image"], train=True, mutable=["batch_stats"])
        labels = batch["label"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        l2 = sum(jnp.sum(jnp.square(w)) for w in jax.tree.leaves(params) if w.ndim > 1)
        accuracy = (jnp.argmax(logits, axis=-1) == labels).mean()
        return loss + 0.5 * weight_decay * l2, (new_state["batch_stats"], loss, accuracy)

    def train_step(params: Any, batch_stats: Any, opt_state: Any,
                   batch: dict[str, jax.Array]) -> tuple[Any, Any, Any, dict[str, jax.Array]]:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (total, (batch_stats, loss, accuracy)), grads = grad_fn(params, batch_stats, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, batch_stats, opt_state, {"loss": loss, "total_loss": total,
                                                "accuracy": accuracy}

    return train_step


def resnet50(batch_size: int = 128, image_size: int = 224, dtype: DTypeLike = jnp.bfloat16, *,
             num_classes: int = 1000, lr: float = 1e-3, weight_decay: float = 1e-4,
             stage_sizes: Sequence[int] = (3, 4, 6, 3), width: int = 64, groups: int = 1,
             width_per_group: int = 0, se_reduction: int = 0, name: str = "resnet50"
             ) -> Workload:
    """ResNet-50 (25.6 M parameters) with batch norm. `args = (params, batch_stats, opt_state,
    batch)`; `stage_sizes` / `width` shrink it for CPU runs (`small`); `groups`,
    `width_per_group` and `se_reduction` make a ResNeXt or SE-ResNeXt of it (`resnext101`)."""
    dtype = _dtype(dtype)
    model = ResNet(stage_sizes=tuple(stage_sizes), width=width, num_classes=num_classes,
                   dtype=dtype, groups=groups, width_per_group=width_per_group,
                   se_reduction=se_reduction)
    tx = make_optimizer(lr)
    batch = _image_batch(batch_size, image_size)
    variables = jax.eval_shape(partial(model.init, train=False), jax.random.key(0),
                               batch["image"])
    params, batch_stats = variables["params"], variables["batch_stats"]
    opt_state = jax.eval_shape(tx.init, params)

    def init(seed: int = 0) -> tuple[Any, ...]:
        sample = jnp.zeros((1, image_size, image_size, 3), jnp.float32)
        v = jax.jit(partial(model.init, train=False))(jax.random.key(seed), sample)
        return (v["params"], v["batch_stats"], tx.init(v["params"]),
                _random_image_batch(seed, batch_size, image_size, num_classes))

    depth = 2 + 3 * sum(stage_sizes)
    kind = (("SE-" if se_reduction else "") + f"ResNeXt-{depth} {groups}x{width_per_group}d"
            if groups > 1 else f"ResNet-{depth}")
    return Workload(
        name=name, step=make_resnet_train_step(model, tx, weight_decay),
        args=(params, batch_stats, opt_state, batch), params=params, batch_size=batch_size,
        num_classes=num_classes,
        description=(f"{kind} (Linen, BatchNorm, stages {list(stage_sizes)}, width "
                     f"{width}), {image_size}px, batch {batch_size}, {num_classes} classes, "
                     f"compute {dtype.name}, Adam lr {lr:g}, L2 {weight_decay:g}; "
                     f"step(params, batch_stats, opt_state, batch)"),
        init=init)


def resnext101(batch_size: int = 128, image_size: int = 224, dtype: DTypeLike = jnp.bfloat16,
               *, se: bool = False, **kw: Any) -> Workload:
    """ResNeXt-101 32x4d (44.2 M parameters; stages [3, 4, 23, 3], 32 groups of 4 channels
    widening x2 per stage), or with `se` SE-ResNeXt-101 32x4d (squeeze-and-excitation,
    reduction 16, 49.0 M), as NVIDIA's DeepLearningExamples train them."""
    return resnet50(batch_size, image_size, dtype, stage_sizes=(3, 4, 23, 3), groups=32,
                    width_per_group=4, se_reduction=16 if se else 0,
                    name="se-resnext101" if se else "resnext101", **kw)


# --------------------------------------------------------------------------------------
# GPT-2 (Flax NNX)
# --------------------------------------------------------------------------------------


def _normal(std: float) -> Any:
    return nnx.initializers.normal(stddev=std)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scores_spec: str,
                     out_spec: str, dtype: Any) -> jax.Array:
    """softmax(q k^T / sqrt(d), causal) v in plain jnp, the full [T, T] scores in float32
    (no flash kernel): `scores_spec` contracts q with k (queries the second-to-last and
    keys the last dim of the scores), `out_spec` the weights with v."""
    t, d = q.shape[1], q.shape[-1]
    scores = jnp.einsum(scores_spec, q, k).astype(jnp.float32) / math.sqrt(d)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum(out_spec, weights, v)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention in plain jnp (einsum, mask, softmax): no fused or
    flash kernel, so XLA sees (and the planner costs) the full [B, H, T, T] scores."""

    def __init__(self, d_model: int, heads: int, layers: int, *, dtype: Any, rngs: nnx.Rngs):
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not divisible by heads {heads}")
        self.heads = heads
        self.dtype = dtype
        dense = partial(nnx.Linear, dtype=dtype, param_dtype=jnp.float32,
                        bias_init=nnx.initializers.zeros, rngs=rngs)
        self.qkv = dense(d_model, 3 * d_model, kernel_init=_normal(0.02))
        # GPT-2's scaled init for projections into the residual stream
        self.proj = dense(d_model, d_model, kernel_init=_normal(0.02 / math.sqrt(2 * layers)))

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, c = x.shape
        h, d = self.heads, c // self.heads
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * h, d), 3, axis=2)
        y = causal_attention(q, k, v, "bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd",
                             self.dtype).reshape(b, t, c)
        return self.proj(y)


class MLP(nnx.Module):
    def __init__(self, d_model: int, layers: int, *, dtype: Any, rngs: nnx.Rngs):
        dense = partial(nnx.Linear, dtype=dtype, param_dtype=jnp.float32,
                        bias_init=nnx.initializers.zeros, rngs=rngs)
        self.fc = dense(d_model, 4 * d_model, kernel_init=_normal(0.02))
        self.proj = dense(4 * d_model, d_model, kernel_init=_normal(0.02 / math.sqrt(2 * layers)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(jax.nn.gelu(self.fc(x), approximate=True))


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d_model: int, heads: int, layers: int, *, dtype: Any, rngs: nnx.Rngs):
        norm = partial(nnx.LayerNorm, d_model, epsilon=1e-5, dtype=dtype,
                       param_dtype=jnp.float32, rngs=rngs)
        self.ln1 = norm()
        self.attn = CausalSelfAttention(d_model, heads, layers, dtype=dtype, rngs=rngs)
        self.ln2 = norm()
        self.mlp = MLP(d_model, layers, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nnx.Module):
    """GPT-2-style decoder: token + learned position embeddings, `layers` pre-LN blocks, final
    LayerNorm, LM head tied to the token embedding (or a separate bias-free Linear)."""

    def __init__(self, *, vocab: int, seq_len: int, layers: int, d_model: int, heads: int,
                 tie_embeddings: bool = True, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        embed = partial(nnx.Embed, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.wte = embed(vocab, d_model, embedding_init=_normal(0.02))
        self.wpe = embed(seq_len, d_model, embedding_init=_normal(0.01))
        self.blocks = nnx.List([Block(d_model, heads, layers, dtype=dtype, rngs=rngs)
                                for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d_model, epsilon=1e-5, dtype=dtype, param_dtype=jnp.float32,
                                  rngs=rngs)
        self.tie_embeddings = tie_embeddings
        self.lm_head = None if tie_embeddings else nnx.Linear(
            d_model, vocab, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
            kernel_init=_normal(0.02), rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """int32 [B, T] tokens -> float32 [B, T, vocab] logits."""
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(jnp.arange(t, dtype=jnp.int32))[None]
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = self.wte.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits.astype(jnp.float32)


def gpt_loss(graphdef: Any) -> Callable[[Any, dict[str, jax.Array]], jax.Array]:
    """`loss_fn(params, batch)`: next-token cross-entropy, a mean over the batch, on an
    `nnx.State` of params (`nnx.merge(graphdef, params)` inside)."""

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        model = nnx.merge(graphdef, params)
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return loss_fn


def make_gpt_train_step(graphdef: Any, tx: optax.GradientTransformation) -> Callable[..., Any]:
    """`(params, opt_state, batch) -> (params, opt_state, metrics)` on an `nnx.State` of
    params: `nnx.merge(graphdef, params)` inside, next-token cross-entropy."""
    loss_fn = gpt_loss(graphdef)

    def train_step(params: Any, opt_state: Any,
                   batch: dict[str, jax.Array]) -> tuple[Any, Any, dict[str, jax.Array]]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss}

    return train_step


def gpt2(batch_size: int = 8, seq_len: int = 1024, vocab: int = 50257, layers: int = 12,
         d_model: int = 768, heads: int = 12, dtype: DTypeLike = jnp.bfloat16, *,
         tie_embeddings: bool = True, lr: float = 3e-4, restructurable: bool = False) -> Workload:
    """GPT-2 small by default (124.4 M parameters tied, 163.0 M untied).
    `restructurable=True`: the same loss and Adam as a `jaxwap.make_train_step` step (which
    returns `(params, opt_state, loss)`)."""
    dtype = _dtype(dtype)
    tx = make_optimizer(lr)

    def build(seed: int) -> GPT:
        return GPT(vocab=vocab, seq_len=seq_len, layers=layers, d_model=d_model, heads=heads,
                   tie_embeddings=tie_embeddings, dtype=dtype, rngs=nnx.Rngs(seed))

    graphdef, params = nnx.split(nnx.eval_shape(lambda: build(0)), nnx.Param)
    opt_state = jax.eval_shape(tx.init, params)
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}

    def init(seed: int = 0) -> tuple[Any, ...]:
        _, p = nnx.split(build(seed), nnx.Param)
        data = jax.random.randint(jax.random.key(seed + 1), (batch_size, seq_len + 1), 0, vocab,
                                  jnp.int32)
        return p, tx.init(p), {"inputs": data[:, :-1], "targets": data[:, 1:]}

    head = "tied to wte" if tie_embeddings else "separate"
    return Workload(
        name="gpt2", args=(params, opt_state, batch),
        step=(jaxwap.make_train_step(gpt_loss(graphdef), tx) if restructurable
              else make_gpt_train_step(graphdef, tx)),
        params=params, batch_size=batch_size, num_classes=vocab,
        description=(f"GPT-2-style decoder (NNX, plain-jnp causal attention): {layers} layers, "
                     f"d_model {d_model}, {heads} heads, vocab {vocab}, seq {seq_len}, batch "
                     f"{batch_size}, LM head {head}, compute {dtype.name}, Adam lr {lr:g}; "
                     f"step(params, opt_state, batch), params = nnx.State of nnx.Param"),
        init=init)


# --------------------------------------------------------------------------------------
# Llama-style decoder (Flax NNX): unrolled blocks, or stacked layers run by lax.scan
# --------------------------------------------------------------------------------------

#: Llama-3-shaped configurations (builder arguments of `llama`). `kv_heads < heads` is
#: grouped-query attention.
LLAMA_CONFIGS: dict[str, dict[str, Any]] = {
    "llama_8b": dict(layers=32, d_model=4096, heads=32, kv_heads=8, ffn=14336,
                     vocab=128256, seq_len=4096),
    "llama_70b": dict(layers=80, d_model=8192, heads=64, kv_heads=8, ffn=28672,
                      vocab=128256, seq_len=4096),
    "llama_tiny": dict(layers=2, d_model=64, heads=4, kv_heads=2, ffn=128, vocab=256,
                       seq_len=32),
}


def _rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of [B, T, H, D] queries or keys (the two halves of D
    rotated as pairs, as in Llama), computed in float32."""
    t, d = x.shape[1], x.shape[-1]
    freqs = 1.0 / theta ** (jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs[None, :]     # [T, D/2]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class LlamaAttention(nnx.Module):
    """Causal grouped-query attention with rotary positions, in plain jnp (the full
    [B, H, T, T] scores, no flash kernel), or with `attention="cudnn"` cuDNN's fused
    kernel (`jax.nn.dot_product_attention`, as PyTorch trainers call SDPA's flash
    kernel); bias-free projections."""

    def __init__(self, d_model: int, heads: int, kv_heads: int, *, dtype: Any,
                 rope_theta: float, rngs: nnx.Rngs, attention: str = "xla"):
        if d_model % heads or heads % kv_heads:
            raise ValueError(f"d_model {d_model} must divide by heads {heads}, and heads by "
                             f"kv_heads {kv_heads}")
        self.heads, self.kv_heads, self.dtype, self.rope_theta = heads, kv_heads, dtype, rope_theta
        self.attention = attention
        hd = d_model // heads
        dense = partial(nnx.Linear, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                        kernel_init=_normal(0.02), rngs=rngs)
        self.q = dense(d_model, heads * hd)
        self.k = dense(d_model, kv_heads * hd)
        self.v = dense(d_model, kv_heads * hd)
        self.o = dense(heads * hd, d_model)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, c = x.shape
        h, kv = self.heads, self.kv_heads
        hd, g = c // h, h // kv
        q = _rotary(self.q(x).reshape(b, t, h, hd), self.rope_theta)
        k = _rotary(self.k(x).reshape(b, t, kv, hd), self.rope_theta)
        v = self.v(x).reshape(b, t, kv, hd)
        if self.attention == "cudnn":
            return self.o(jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn").reshape(b, t, c))
        q = q.reshape(b, t, kv, g, hd)
        y = causal_attention(q, k, v, "bqkgd,bskd->bkgqs", "bkgqs,bskd->bqkgd",
                             self.dtype).reshape(b, t, c)
        return self.o(y)


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)), bias-free."""

    def __init__(self, d_model: int, ffn: int, *, dtype: Any, rngs: nnx.Rngs):
        dense = partial(nnx.Linear, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                        kernel_init=_normal(0.02), rngs=rngs)
        self.gate = dense(d_model, ffn)
        self.up = dense(d_model, ffn)
        self.down = dense(ffn, d_model)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nnx.Module):
    """Pre-RMSNorm block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, d_model: int, heads: int, kv_heads: int, ffn: int, *, dtype: Any,
                 rope_theta: float, rngs: nnx.Rngs, attention: str = "xla"):
        norm = partial(nnx.RMSNorm, d_model, epsilon=1e-5, dtype=dtype,
                       param_dtype=jnp.float32, rngs=rngs)
        self.attn_norm = norm()
        self.attn = LlamaAttention(d_model, heads, kv_heads, dtype=dtype,
                                   rope_theta=rope_theta, rngs=rngs, attention=attention)
        self.mlp_norm = norm()
        self.mlp = SwiGLU(d_model, ffn, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    """Llama-style decoder: token embedding, `layers` pre-RMSNorm blocks (GQA with rotary
    positions, SwiGLU MLP), final RMSNorm, untied LM head.

    `scan=False`: the blocks are a python list, unrolled into the step's program.
    `scan=True`: one block whose parameters are stacked along a leading layer dim
    (`nnx.vmap` at creation), run by `jax.lax.scan` over that dim.
    """

    def __init__(self, *, vocab: int, layers: int, d_model: int, heads: int, kv_heads: int,
                 ffn: int, scan: bool = False, dtype: Any = jnp.float32,
                 rope_theta: float = 500000.0, remat: bool | str = False, rngs: nnx.Rngs,
                 attention: str = "xla", **_: Any):
        make = partial(LlamaBlock, d_model, heads, kv_heads, ffn, dtype=dtype,
                       rope_theta=rope_theta, attention=attention)
        self.embed = nnx.Embed(vocab, d_model, dtype=dtype, param_dtype=jnp.float32,
                               embedding_init=_normal(0.02), rngs=rngs)
        self.scan = scan
        self.remat = remat
        if scan:
            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(r: nnx.Rngs) -> LlamaBlock:
                return make(rngs=r)

            self.blocks = stacked(rngs)
        else:
            self.blocks = nnx.List([make(rngs=rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d_model, epsilon=1e-5, dtype=dtype, param_dtype=jnp.float32,
                                rngs=rngs)
        self.lm_head = nnx.Linear(d_model, vocab, use_bias=False, dtype=dtype,
                                  param_dtype=jnp.float32, kernel_init=_normal(0.02),
                                  rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """int32 [B, T] tokens -> float32 [B, T, vocab] logits."""
        x = self.embed(tokens)
        # remat: each block's activations are recomputed in its backward pass, only the
        # block inputs kept (per-block rematerialization, as large-model trainers run)
        # remat="dots": selective, the matmul outputs without batch dims (the projections)
        # kept and the rest recomputed, as torchtitan's op-level selective checkpointing
        if self.remat == "dots":
            wrap = partial(jax.checkpoint,
                           policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        else:
            wrap = jax.checkpoint if self.remat else (lambda f: f)
        if self.scan:
            graphdef, state = nnx.split(self.blocks)

            def layer(h: jax.Array, s: Any) -> tuple[jax.Array, None]:
                return nnx.merge(graphdef, s)(h), None

            x, _ = jax.lax.scan(wrap(layer), x, state)
        else:
            for block in self.blocks:
                graphdef, state = nnx.split(block)
                x = wrap(lambda s, h, g=graphdef: nnx.merge(g, s)(h))(state, x)
        return self.lm_head(self.norm(x)).astype(jnp.float32)


def llama(config: str = "llama_tiny", *, batch_size: int = 8, seq_len: int | None = None,
          scan: bool = False, dtype: DTypeLike = jnp.bfloat16, lr: float = 3e-4,
          weight_decay: float = 0.1, restructurable: bool = True, remat: bool | str = False,
          attention: str = "xla", **overrides: Any) -> Workload:
    """A Llama-style decoder of `LLAMA_CONFIGS[config]` (`overrides` replace any of its
    fields: layers, d_model, heads, kv_heads, ffn, vocab, seq_len), built abstractly, so an
    8B or 70B model allocates nothing. `scan=True` stacks the blocks' parameters along a
    leading layer dim and runs them with `lax.scan`. `remat=True` checkpoints each block
    (its activations recomputed in the backward pass, only block inputs kept); `remat="dots"`
    keeps each block's projection outputs and recomputes the rest (selective). The step is
    `jaxwap.make_train_step(loss_fn, optax.adamw(lr, weight_decay=...))` (returns
    `(params, opt_state, loss)`); `restructurable=False` gives the same loss and AdamW as a
    plain step returning `(params, opt_state, {"loss": loss})`. `args = (params, opt_state,
    batch)`, params the `nnx.State` of `nnx.Param`. `attention="cudnn"` runs cuDNN's fused
    attention (planned for a GPU from any host; it runs only on one)."""
    if config not in LLAMA_CONFIGS:
        raise KeyError(f"unknown llama config {config!r}; choose from {sorted(LLAMA_CONFIGS)}")
    cfg = {**LLAMA_CONFIGS[config], **overrides}
    if seq_len is not None:
        cfg["seq_len"] = seq_len
    dtype = _dtype(dtype)
    tx = optax.adamw(lr, weight_decay=weight_decay)

    def build(seed: int) -> Llama:
        return Llama(**cfg, scan=scan, dtype=dtype, remat=remat, rngs=nnx.Rngs(seed),
                     attention=attention)

    graphdef, params = nnx.split(nnx.eval_shape(lambda: build(0)), nnx.Param)
    opt_state = jax.eval_shape(tx.init, params)
    T, vocab = cfg["seq_len"], cfg["vocab"]
    tokens = jax.ShapeDtypeStruct((batch_size, T), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}

    def init(seed: int = 0) -> tuple[Any, ...]:
        _, p = nnx.split(build(seed), nnx.Param)
        data = jax.random.randint(jax.random.key(seed + 1), (batch_size, T + 1), 0, vocab,
                                  jnp.int32)
        return p, tx.init(p), {"inputs": data[:, :-1], "targets": data[:, 1:]}

    loss_fn = gpt_loss(graphdef)
    if restructurable:
        step = jaxwap.make_train_step(loss_fn, tx)
    else:
        def step(params: Any, opt_state: Any,
                 batch: dict[str, jax.Array]) -> tuple[Any, Any, dict[str, jax.Array]]:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    form = f"stacked, lax.scan over {cfg['layers']}" if scan else f"{cfg['layers']} unrolled"
    form += ", per-block remat" + (" (matmul outputs kept)" if remat == "dots" else "") \
        if remat else ""
    form += ", cuDNN attention" if attention == "cudnn" else ""
    return Workload(
        name=config + ("-scan" if scan else "") + ("-remat" if remat else "")
        + ("-dots" if remat == "dots" else "")
        + ("-cudnn" if attention == "cudnn" else ""), step=step,
        args=(params, opt_state, batch),
        params=params, batch_size=batch_size, num_classes=vocab,
        description=(f"Llama-style decoder (NNX, RMSNorm, rotary GQA {cfg['heads']}/"
                     f"{cfg['kv_heads']} heads, SwiGLU {cfg['ffn']}, untied head): {form} "
                     f"layers, d_model {cfg['d_model']}, vocab {vocab}, seq {T}, batch "
                     f"{batch_size}, compute {dtype.name}, AdamW lr {lr:g}; step(params, "
                     f"opt_state, batch), params = nnx.State of nnx.Param"),
        init=init)


def llama_8b(**kw: Any) -> Workload:
    """Llama-3-8B-shaped (8.03 B parameters): 32 layers, d 4096, 32/8 heads, ffn 14336."""
    return llama("llama_8b", **kw)


def llama_70b(**kw: Any) -> Workload:
    """Llama-3-70B-shaped (70.6 B parameters): 80 layers, d 8192, 64/8 heads, ffn 28672."""
    return llama("llama_70b", **kw)


# --------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "alexnet": alexnet,
    "vgg16": vgg16,
    "resnet50": resnet50,
    "gpt2": gpt2,
}

#: Builder arguments of the CI-sized versions: float32 (CPUs have no fast bfloat16), 32 px
#: images and 10 classes, a narrow 2-stage ResNet (one bottleneck block per stage: XLA's CPU
#: compile time grows with the number of convolutions), a 2-layer GPT. AlexNet and VGG
#: keep their architecture (only the image size shrinks; VGG-16 is then 33.6 M parameters,
#: most of them fc7).
SMALL: dict[str, dict[str, Any]] = {
    "alexnet": dict(batch_size=8, image_size=32, num_classes=10, dtype=jnp.float32),
    "vgg16": dict(batch_size=8, image_size=32, num_classes=10, dtype=jnp.float32),
    "resnet50": dict(batch_size=16, image_size=32, num_classes=10, dtype=jnp.float32,
                     stage_sizes=(1, 1), width=16),
    "gpt2": dict(batch_size=8, seq_len=32, vocab=256, layers=2, d_model=64, heads=4,
                 dtype=jnp.float32),
}


def small(name: str, **overrides: Any) -> Workload:
    """The CI-sized version of `WORKLOADS[name]` (named `<name>-small`); `overrides` replace
    any of its builder arguments."""
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    w = WORKLOADS[name](**{**SMALL[name], **overrides})
    return dataclasses.replace(w, name=f"{name}-small")


__all__ = [
    "GPT",
    "LLAMA_CONFIGS",
    "SMALL",
    "WORKLOADS",
    "AlexNet",
    "ResNet",
    "VGG16",
    "Workload",
    "alexnet",
    "gpt2",
    "Llama",
    "llama",
    "llama_70b",
    "llama_8b",
    "make_gpt_train_step",
    "make_resnet_train_step",
    "resnet50",
    "small",
    "vgg16",
]
