"""Real clients: training steps other people wrote, with their models, unchanged.

flax's examples (copied unchanged into `tests/clients/flax_examples/`, see the README
there): sst2 (Linen bidirectional-LSTM classifier, `TrainState`, dropout keys, metrics),
seq2seq (Linen LSTM encoder/decoder with sampled decoding, a `@jax.jit` step) and gemma (NNX
Gemma transformer, its `jax_train_step` with `nnx.Optimizer`, `nnx.Rngs`, `nnx.MultiMetric`
and sown intermediates). Each runs two steps under `jaxwap.auto_shard` on 8 CPU devices,
the planner's own choice and a forced 2x4 mesh (tensor parallelism), and every output (the
new state, metrics, intermediates) equals `jax.jit` of the same step: f32, rtol 2e-5, atol
2e-6 (the sharded step only reorders sums over the batch and over split features). Gemma
also runs with its own weight layouts (`ShardingConfig.fsdp_tp_sharding`) as constraints,
its mesh axes "fsdp" and "tensor" mapped to jaxwap's "data" and "model".

Small configs (hidden 16-32, vocabularies of 15-64, sequences of 6-16, batch 16): the
module takes ~55 s on 2 cores, most of it XLA compiling the LSTMs' scans.
"""

from __future__ import annotations

import functools
import importlib
import random
import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxwap

RTOL, ATOL = 2e-5, 2e-6
EXAMPLES = Path(__file__).parent / "clients" / "flax_examples"
PLANNED = pytest.param({"num_devices": 8}, id="planned")
FORCED = pytest.param({"mesh_shape": {"data": 2, "model": 4}}, id="2x4")


# ---------------------------------------------------------------------------------------
# Loading the clients' modules as they are


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


class _Unavailable:
    """A name from a package the tests do not install, which the used code never calls."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("a stub: this package is not installed for the client tests")


def _load(example: str, names: list[str], stubs: dict[str, types.ModuleType]) -> list:
    """Import an example's modules from its folder (they import each other as top-level
    modules), with `stubs` standing in for packages not installed. Afterwards their
    names (`models`, `train`, ...) and the stubs leave `sys.modules` again, and whatever
    they shadowed (`tests/models.py`) is put back."""
    folder = EXAMPLES / example
    names_here = {p.stem for p in folder.glob("*.py")} | set(stubs)
    shadowed = {k: sys.modules.pop(k) for k in names_here if k in sys.modules}
    sys.modules.update(stubs)
    sys.path.insert(0, str(folder))
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        sys.path.remove(str(folder))
        for k in names_here:
            sys.modules.pop(k, None)
        sys.modules.update(shadowed)


@functools.cache
def _sst2():
    tf = _stub("tensorflow", data=_stub("tensorflow.data", Dataset=_Unavailable))
    (train,) = _load("sst2", ["train"], {
        "tensorflow": tf, "input_pipeline": _stub("input_pipeline"),
        "ml_collections": _stub("ml_collections", ConfigDict=_Unavailable),
        "flax.metrics.tensorboard": _stub("flax.metrics.tensorboard",
                                          SummaryWriter=_Unavailable)})
    return train


@functools.cache
def _seq2seq():
    clu = _stub("clu", metric_writers=_stub("clu.metric_writers"))
    return _load("seq2seq", ["train", "models", "input_pipeline"],
                 {"clu": clu, "clu.metric_writers": clu.metric_writers})


@functools.cache
def _gemma():
    clu = _stub("clu", metric_writers=_stub("clu.metric_writers"),
                periodic_actions=_stub("clu.periodic_actions"))
    return _load("gemma", ["train", "transformer", "transformer_cfg", "sow_lib"], {
        "clu": clu, "clu.metric_writers": clu.metric_writers,
        "clu.periodic_actions": clu.periodic_actions,
        "grain": _stub("grain", IterDataset=_Unavailable),
        "input_pipeline": _stub("input_pipeline"), "sampler": _stub("sampler"),
        "tokenizer": _stub("tokenizer"), "jaxtyping": _stub("jaxtyping", Array=jax.Array)})


# ---------------------------------------------------------------------------------------
# Checks


def _assert_same(got, want) -> None:
    """The same tree (structure and static fields) and every leaf close."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if jnp.issubdtype(jnp.asarray(a).dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def _copy(tree):
    """A copy of the arrays in `tree`: the sharded step donates the state it is given."""
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


def _uses_8_devices(step) -> None:
    assert int(np.prod(list(step.plan.mesh_shape.values()))) == 8


# ---------------------------------------------------------------------------------------
# sst2: Linen BiLSTM text classifier, TrainState step with dropout keys


# each client on one mesh (the suite's time): the planner's choice, or a forced 2x4 of
# tensor-parallel and FSDP layouts; gemma's constraint tests run 4x2 and the planner's
@pytest.mark.parametrize("mesh", [PLANNED])
def test_sst2_train_step(mesh):
    train = _sst2()
    config = SimpleNamespace(embedding_size=16, hidden_size=16, vocab_size=40, output_size=1,
                             dropout_rate=0.5, word_dropout_rate=0.1, unk_idx=1,
                             learning_rate=0.1, momentum=0.9, weight_decay=3e-6)
    state = train.create_train_state(jax.random.key(0), config,
                                     train.model_from_config(config))
    rng = np.random.default_rng(0)
    batches = [{"token_ids": jnp.asarray(rng.integers(2, 40, (16, 8)), jnp.int32),
                "length": jnp.asarray(rng.integers(1, 9, (16,)), jnp.int32),
                "label": jnp.asarray(rng.integers(0, 2, (16,)), jnp.int32)}
               for _ in range(2)]
    rngs = {"dropout": jax.random.key(1)}

    reference = jax.jit(train.train_step)
    sharded = jaxwap.auto_shard(train.train_step, cache=False, verify=0, **mesh)
    want, got = state, _copy(state)
    for batch in batches:                    # the second step folds in state.step = 1
        want, want_metrics = reference(want, batch, rngs)
        got, got_metrics = sharded(got, batch, rngs)
        _assert_same((got, got_metrics), (want, want_metrics))
    _uses_8_devices(sharded)


# ---------------------------------------------------------------------------------------
# seq2seq: Linen LSTM encoder/decoder, a @jax.jit step sampling its decoder inputs


@pytest.mark.parametrize("mesh", [FORCED])
def test_seq2seq_train_step(mesh):
    from flax.training import train_state

    train, models, input_pipeline = _seq2seq()
    ctable = input_pipeline.CharacterTable("0123456789+= ", max_len_query_digit=2)
    # as train.get_model / get_train_state build them (those read absl FLAGS)
    model = models.Seq2seq(teacher_force=False, hidden_size=16, eos_id=ctable.eos_id,
                           vocab_size=ctable.vocab_size)
    params = train.get_initial_params(model, jax.random.key(0), ctable)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adam(0.003))
    saved = random.getstate()
    random.seed(0)                           # CharacterTable draws with `random`
    try:
        batches = [jax.tree.map(jnp.asarray, ctable.get_batch(16)) for _ in range(2)]
    finally:
        random.setstate(saved)
    lstm_rng = jax.random.key(0)

    reference = jax.jit(train.train_step)
    sharded = jaxwap.auto_shard(train.train_step, cache=False, verify=0, **mesh)
    want, got = state, _copy(state)
    for batch in batches:
        want, want_metrics = reference(want, batch, lstm_rng, ctable.eos_id)
        got, got_metrics = sharded(got, batch, lstm_rng, ctable.eos_id)
        _assert_same((got, got_metrics), (want, want_metrics))
    _uses_8_devices(sharded)


# ---------------------------------------------------------------------------------------
# gemma: NNX transformer, jax_train_step(model, optimizer, rngs, batch, metrics)


V, B, L = 64, 16, 16


def _gemma_config(sharding=None):
    _, transformer, cfg, _ = _gemma()
    kinds = cfg.AttentionType
    # a small Gemma 3: local sliding + global attention, grouped KV heads, QK norm,
    # post-norms and soft caps. dropout_rate stays at the example's 0.0: with dropout, the
    # client's own step fails under plain jax.jit on flax 0.12 (rngs mutated inside
    # jax.value_and_grad: TraceContextError), before jaxwap is involved.
    return transformer.TransformerConfig.from_dict(
        num_layers=2, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2,
        use_post_attn_norm=True, use_post_ffw_norm=True, use_qk_norm=True,
        attention_types=(kinds.LOCAL_SLIDING, kinds.GLOBAL), sliding_window_size=4,
        final_logit_softcap=30.0, attn_logits_soft_cap=50.0, num_embed=V,
        dtype=jnp.float32, shd_config=sharding or cfg.ShardingConfig.no_sharding())


@functools.cache
def _gemma_tx():
    train = _gemma()[0]
    schedule = train.create_learning_rate_schedule(learning_rate=0.0016, warmup_steps=1)
    return optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)


def _gemma_objects():
    """model, optimizer, rngs and metrics as train_and_evaluate makes them (fresh: the
    sharded step donates them)."""
    from flax import nnx

    _, transformer, _, sow_lib = _gemma()
    rngs = nnx.Rngs(params=0, dropout=0)
    model = transformer.Transformer(
        _gemma_config(), rngs=rngs,
        sow_config=sow_lib.SowConfig(embeddings=True, mlp_hidden_topk=2))
    optimizer = nnx.Optimizer(model, tx=_gemma_tx(), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"),
                              accuracy=nnx.metrics.Accuracy())
    return model, optimizer, rngs, metrics


def _gemma_batches():
    """lm1b-like packed batches: tokens padded with 0, positions and segmentation."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(2):
        tokens = rng.integers(1, V, (B, L + 1))
        lengths = rng.integers(L // 2, L + 2, (B,))
        tokens = np.where(np.arange(L + 1) < lengths[:, None], tokens, 0)
        out.append({"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
                    "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
                    "inputs_position": jnp.asarray(np.tile(np.arange(L), (B, 1)), jnp.int32),
                    "inputs_segmentation": jnp.asarray(
                        1 + (np.arange(L) >= lengths[:, None] - 1), jnp.int32)})
    return out


def _run_gemma(**options):
    from flax import nnx

    train = _gemma()[0]
    # as train_and_evaluate binds it (with_capture: its default sow_config is not None)
    step = functools.partial(train.jax_train_step, label_smoothing=0.0, pad_id=0,
                             with_capture=True)
    reference = jax.jit(step)
    sharded = jaxwap.auto_shard(step, cache=False, verify=0, **options)
    want, got = _gemma_objects(), _gemma_objects()
    for batch in _gemma_batches():
        want_out = reference(*want[:3], batch, want[3])
        nnx.update(want, want_out[0])                   # as the example's loop does
        got_out = sharded(*got[:3], batch, got[3])
        nnx.update(got, got_out[0])
        _assert_same(got_out, want_out)                 # state, metrics, intermediates
    _uses_8_devices(sharded)
    return sharded


@pytest.mark.parametrize("mesh", [PLANNED])
def test_gemma_train_step(mesh):
    _run_gemma(**mesh)


def _gemma_rules_as_constraints(keep=lambda pattern: True):
    """Gemma's weight layouts (train_and_evaluate's `fsdp_tp_sharding` on its
    ("fsdp", "tensor") mesh) read from an abstract model as jaxwap constraints."""
    from flax import nnx

    _, transformer, cfg, _ = _gemma()
    sharding = cfg.ShardingConfig.fsdp_tp_sharding(fsdp_axis_name="fsdp",
                                                   tensor_parallel_axis_name="tensor")
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: transformer.Transformer(
            _gemma_config(sharding), rngs=nnx.Rngs(params=0)))
    constraints = jaxwap.logical_constraints(nnx.state(abstract, nnx.Param),
                                             (("fsdp", "data"), ("tensor", "model")))
    return {p: s for p, s in constraints.items() if keep(p)}


def _assert_pinned(plan, constraints) -> None:
    for pattern, spec in constraints.items():
        hits = [p for p in plan.params if re.search(pattern, "/".join(p.path))]
        assert hits, pattern
        for p in hits:
            assert tuple(p.spec) == tuple(spec) and p.strategy.endswith("pinned"), p


def test_gemma_with_its_weight_layouts_as_constraints():
    """Its embedding, attention and MLP weights pinned (FSDP over "data", heads and
    hidden features over "model"); its RMSNorm scales left out (next test)."""
    constraints = _gemma_rules_as_constraints(keep=lambda p: "norm" not in p)
    assert len(constraints) == 13
    # 2 KV heads split over "model": a model axis of 2
    sharded = _run_gemma(mesh_shape={"data": 4, "model": 2}, constraints=constraints)
    _assert_pinned(sharded.plan, constraints)


def test_gemma_with_all_its_sharding_rules_as_constraints():
    """Its RMSNorm scales too, over "tensor" (-> "model"): jaxwap splits only a layer's
    feature dims over the model axis, so the pins hold where that axis is 1 (there a
    model entry splits nothing) and the planner keeps to such meshes, the specs as
    given."""
    constraints = _gemma_rules_as_constraints()
    assert any("norm" in p for p in constraints)
    sharded = _run_gemma(num_devices=8, constraints=constraints)
    _assert_pinned(sharded.plan, constraints)
    assert dict(sharded.plan.mesh_shape)["model"] == 1


def test_the_clients_are_unchanged_copies():
    """The copied files are flax's, byte for byte (blob hashes of commit 18f8f311)."""
    import hashlib

    def blob(path: Path) -> str:
        data = path.read_bytes()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    got = {str(p.relative_to(EXAMPLES)): blob(p) for p in sorted(EXAMPLES.rglob("*.py"))}
    assert got == _FLAX_BLOBS


# git blob hashes (`git rev-parse 18f8f311:examples/<path>` in google/flax)
_FLAX_BLOBS = {
    "gemma/helpers.py": "97f83d52a1650a82b5fef05867424045b29254e4",
    "gemma/layers.py": "200c3082bd904036d5a72dd6d125e2792d9ddc1e",
    "gemma/modules.py": "ba257fd2f1b45a856a79631dfccc8aa36d30c45a",
    "gemma/params.py": "a99737ac4d73fc7a48bc2db00439f7c3ca80dac9",
    "gemma/positional_embeddings.py": "0d9e3a118c7e9134f3e1b8b683d404f8422402c4",
    "gemma/sow_lib.py": "3f869b48d66fbb2a4a04ae7cd1f77d094fefa708",
    "gemma/train.py": "83d30bfc646678ca0a384a381bd2d938eb40b62d",
    "gemma/train_cfg.py": "7c2982a4446e7941f2a53039e7eb6d16eb3955f9",
    "gemma/transformer.py": "7748b326e65220cbaf1ccafcae24daba0035937a",
    "gemma/transformer_cfg.py": "bd9b73d17f53b7ac7dfda9c3e32401fbecce68a7",
    "seq2seq/input_pipeline.py": "72794a3969066c5f90d738dbf27c8167df342708",
    "seq2seq/models.py": "00bdbcb5618eff2ae0f1d3416be60f78e68a7f4a",
    "seq2seq/train.py": "3fcfd0497e02d4e79c1c233f57234df9fe5e2463",
    "sst2/models.py": "fbb832fd33b10f299378531c5486fa4a6f351d35",
    "sst2/train.py": "1097e3d209c530afa6e75960d89934837c9b17e6",
}
