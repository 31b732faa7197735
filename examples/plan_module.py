"""A Llama-3-8B-shaped training step with abstract arguments, for `jaxwap plan`.

Planning for a cluster you do not have needs only the step and the shapes of its
arguments, so nothing here allocates a parameter: the arguments are
`jax.ShapeDtypeStruct`s from `jax.eval_shape`, and an 8-billion-parameter model costs a
few megabytes of Python objects. From the repository root:

    jaxwap plan examples.plan_module:llama_step --hardware h100-sxm --devices 512 \\
        --devices-per-node 8 --inter-node-bandwidth 50e9 --objective balanced --json plan.json
    jaxwap explain plan.json

(`examples/plan_module.py:llama_step`, the file's path, works too, from anywhere.)

The model is plain jax, no Flax: token embedding, `LAYERS` pre-RMSNorm blocks (grouped-query
attention with rotary positions, SwiGLU MLP) whose parameters are stacked along a leading
layer dim and run by one `lax.scan` (which is what lets the planner weigh pipelining; each
block is rematerialized, as large-model trainers run), final RMSNorm and an untied LM
head. Parameters are float32, compute bfloat16. The step is `jaxwap.make_train_step(loss,
optax.adamw(...))`, so the planner may also micro-batch it or choose another remat policy.
`tiny_llama_step` is the same code at toy sizes, for a quick look on a laptop.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxwap

#: Llama-3-8B's shape (8.03 B parameters) and a global batch of 512 sequences of 4096
#: tokens (2 M tokens a step), a typical pre-training batch for a few hundred GPUs.
LLAMA_8B = dict(layers=32, d_model=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                seq_len=4096, batch_size=512)
TINY = dict(layers=2, d_model=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq_len=32,
            batch_size=8)
COMPUTE = jnp.bfloat16


def _init(key: jax.Array, *, layers: int, d_model: int, heads: int, kv_heads: int,
          ffn: int, vocab: int, **_: Any) -> dict[str, Any]:
    """Random parameters; only ever traced here (`jax.eval_shape`), never run."""
    hd = d_model // heads
    keys = iter(jax.random.split(key, 9))

    def normal(*shape: int) -> jax.Array:
        return 0.02 * jax.random.normal(next(keys), shape, jnp.float32)

    blocks = {
        "attn_norm": jnp.ones((layers, d_model)), "mlp_norm": jnp.ones((layers, d_model)),
        "wq": normal(layers, d_model, heads * hd), "wk": normal(layers, d_model, kv_heads * hd),
        "wv": normal(layers, d_model, kv_heads * hd), "wo": normal(layers, heads * hd, d_model),
        "w_gate": normal(layers, d_model, ffn), "w_up": normal(layers, d_model, ffn),
        "w_down": normal(layers, ffn, d_model),
    }
    return {"embed": normal(vocab, d_model), "blocks": blocks,
            "norm": jnp.ones((d_model,)), "lm_head": normal(d_model, vocab)}


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
    return (y * scale).astype(x.dtype)


def _rotary(x: jax.Array, theta: float = 500000.0) -> jax.Array:
    """Rotary positions on [B, T, H, D], the two halves of D rotated as pairs."""
    t, d = x.shape[1], x.shape[-1]
    freqs = 1.0 / theta ** (jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _block(x: jax.Array, p: dict[str, jax.Array], heads: int, kv_heads: int) -> jax.Array:
    """One pre-RMSNorm block: x + attention(norm(x)), then x + SwiGLU(norm(x))."""
    p = {k: v.astype(COMPUTE) for k, v in p.items()}
    b, t, c = x.shape
    hd, g = c // heads, heads // kv_heads
    h = _rms_norm(x, p["attn_norm"])
    q = _rotary((h @ p["wq"]).reshape(b, t, heads, hd)).reshape(b, t, kv_heads, g, hd)
    k = _rotary((h @ p["wk"]).reshape(b, t, kv_heads, hd))
    v = (h @ p["wv"]).reshape(b, t, kv_heads, hd)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / math.sqrt(hd)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores,
                       jnp.finfo(jnp.float32).min)
    w = jax.nn.softmax(scores, axis=-1).astype(COMPUTE)
    x = x + jnp.einsum("bkgqs,bskd->bqkgd", w, v).reshape(b, t, c) @ p["wo"]
    h = _rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def make_step(config: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """(step, (params, opt_state, batch)) for a model of `config`'s shape, all abstract."""
    heads, kv_heads = config["heads"], config["kv_heads"]

    def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        x = params["embed"].astype(COMPUTE)[batch["inputs"]]

        @jax.checkpoint  # per-block remat: only each block's input is kept
        def layer(h: jax.Array, p: dict[str, jax.Array]) -> tuple[jax.Array, None]:
            return _block(h, p, heads, kv_heads), None

        x, _ = jax.lax.scan(layer, x, params["blocks"])
        x = _rms_norm(x, params["norm"].astype(COMPUTE))
        logits = (x @ params["lm_head"].astype(COMPUTE)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    optimizer = optax.adamw(3e-4, weight_decay=0.1)
    params = jax.eval_shape(lambda: _init(jax.random.key(0), **config))
    opt_state = jax.eval_shape(optimizer.init, params)
    tokens = jax.ShapeDtypeStruct((config["batch_size"], config["seq_len"]), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    return jaxwap.make_train_step(loss_fn, optimizer), (params, opt_state, batch)


def llama_step() -> tuple[Any, tuple[Any, ...]]:
    """Llama-3-8B-shaped, batch 512 x 4096 tokens: `jaxwap plan` target."""
    return make_step(LLAMA_8B)


def tiny_llama_step() -> tuple[Any, tuple[Any, ...]]:
    """The same model at toy sizes (2 layers, d 64): plans in a second or two."""
    return make_step(TINY)
