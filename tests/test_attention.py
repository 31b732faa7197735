"""Attention: cuDNN's fused kernel planned for GPUs from this CPU host and priced as one
kernel, and the advice where a step materializes its attention scores.

A Llama-shaped step written with `jax.nn.dot_product_attention(..., is_causal=True)`:
with `implementation="cudnn"` it traces for an H100 target here (jax's cuDNN checks
answered for the target, `fused_attention.target_checks`), its two kernels priced at their
FlashAttention flops (causal: half the scores), no T x T value in its memory; with
`implementation="xla"` the scores are found (`fused_counterfactual.score_sites`) and, at a
long sequence, `Plan.explain()` says what they take and what the fused kernel would give.
The fused counterfactual of the XLA step is checked against the cuDNN step itself.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import abstract_setup

import jaxwap
from benchmarks.models import zoo
from jaxwap.analysis.dataflow import dataflow, op_kinds
from jaxwap.analysis.flatten import flatten
from jaxwap.analysis.fused_attention import (
    FUSED_BACKWARD,
    FUSED_FORWARD,
    fused_cost,
    kept_pairs,
    require_compilable,
    target_checks,
)
from jaxwap.analysis.grad_reductions import batch_dims
from jaxwap.analysis.graph import analyze
from jaxwap.analysis.live_matrix import LiveRows
from jaxwap.analysis.roles import BATCH
from jaxwap.analysis.trace import layout_of
from jaxwap.core.objective import Objective
from jaxwap.decide.attention_advice import SHARE, _layout_prediction
from jaxwap.decide.fused_counterfactual import score_sites, step_live
from jaxwap.hardware.builtin_profiles import device_spec
from jaxwap.plans.plan import Plan
from jaxwap.search.across_meshes import search

H100 = device_spec("h100-sxm")
H100X8 = jaxwap.Cluster("h100-sxm", 8)
# dims that no other dim equals, so a T x T value cannot be mistaken
B, T, D, HEADS, KV, FFN, VOCAB, LAYERS = 8, 256, 128, 4, 2, 192, 320, 2
HD = D // HEADS
bf16, f32 = jnp.bfloat16, jnp.float32


def llama(impl: str | None, *, seq: int = T, causal: bool = True, layers: int = LAYERS):
    """A fresh (step, params, opt_state, batch) of a Llama-shaped decoder (RMSNorm, GQA
    4/2 heads, SwiGLU, untied head) whose attention is jax.nn.dot_product_attention with
    `impl`; a new step function each call, so no trace of another target is reused."""
    def rms(x, scale):
        x32 = x.astype(f32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)
                * scale).astype(bf16)

    def attention(x, w):
        q = (x @ w["q"]).reshape(B, seq, HEADS, HD)
        k = (x @ w["k"]).reshape(B, seq, KV, HD)
        v = (x @ w["v"]).reshape(B, seq, KV, HD)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
        return o.reshape(B, seq, D) @ w["o"]

    def loss_fn(params, batch):
        x = params["embed"][batch["inputs"]].astype(bf16)
        for blk in params["blocks"]:
            w = jax.tree.map(lambda a: a.astype(bf16), blk)
            x = x + attention(rms(x, blk["attn_norm"]), w)
            h = rms(x, blk["mlp_norm"])
            x = x + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]
        logits = (rms(x, params["norm"]) @ params["head"].astype(bf16)).astype(f32)
        return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                               batch["targets"]).mean()

    def p(*shape):
        return jax.ShapeDtypeStruct(shape, f32)
    block = {"q": p(D, D), "k": p(D, KV * HD), "v": p(D, KV * HD), "o": p(D, D),
             "gate": p(D, FFN), "up": p(D, FFN), "down": p(FFN, D),
             "attn_norm": p(D), "mlp_norm": p(D)}
    params = {"embed": p(VOCAB, D), "blocks": [dict(block) for _ in range(layers)],
              "norm": p(D), "head": p(D, VOCAB)}
    tx = optax.adam(1e-3)
    tokens = jax.ShapeDtypeStruct((B, seq), jnp.int32)
    return (jaxwap.make_train_step(loss_fn, tx), params, jax.eval_shape(tx.init, params),
            {"inputs": tokens, "targets": tokens})


def traced(impl: str | None, **kw):
    """(layout, jaxpr, graph) of `llama(impl)`, traced for an H100 target."""
    step, params, opt, batch = llama(impl, **kw)
    with target_checks(H100):
        layout, closed = layout_of(step, (params, opt, batch), {}, params, None)
    graph = analyze(closed, layout.inputs.roles, layout.outputs.roles, layout.params,
                    layout.inputs.batch_size)
    return layout, closed, graph


def sites_of(layout, closed, graph):
    return score_sites(graph, closed, layout.inputs.roles, layout.outputs.roles,
                       layout.params, H100)


# --------------------------------------------------------------------------- fused kernel
def test_cudnn_step_plans_for_h100_from_this_cpu_host():
    """jaxwap.plan of the cuDNN step for 8 H100s, here: no cuDNN error, no generic rule,
    nothing to advise (no materialized scores), jax's checks put back afterwards."""
    module = importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")
    before = module.check_cudnn_version
    step, params, opt, batch = llama("cudnn")
    plan = jaxwap.plan(step, params, opt, batch, hardware=H100X8, verify=0, cache=False)
    assert plan.predicted.step_time_s > 0
    assert not any("generic rule" in n for n in plan.notes), plan.notes
    assert plan.attention is None
    assert module.check_cudnn_version is before
    with pytest.raises(RuntimeError, match="cuDNN is not detected"):   # jax's own, here
        jax.make_jaxpr(lambda q: jax.nn.dot_product_attention(
            q, q, q, implementation="cudnn"))(jax.ShapeDtypeStruct((1, 8, 1, 8), bf16))


def test_fused_attention_is_priced_as_one_kernel_causal_half_the_xla_matmuls():
    layout, closed, graph = traced("cudnn")
    fwd, bwd = (np.flatnonzero(graph.attention == k) for k in (FUSED_FORWARD, FUSED_BACKWARD))
    assert len(fwd) == len(bwd) == LAYERS
    assert not graph.unmodeled
    kept = kept_pairs(T, T, causal=True)
    assert kept == T * (T + 1) // 2
    pairs = B * HEADS
    np.testing.assert_array_equal(graph.flops[fwd], 2.0 * pairs * kept * 2 * HD)
    np.testing.assert_array_equal(graph.flops[bwd], 2.5 * graph.flops[fwd])
    assert graph.is_matmul[fwd].all() and graph.low_precision[np.r_[fwd, bwd]].all()
    # the same step with XLA's attention: its two forward matmuls per layer (scores and
    # values) compute all T x T entries; the causal kernel half of them (and the diagonal)
    xl, xc, xg = traced("xla")
    sites = sites_of(xl, xc, xg)
    prog = flatten(xc)
    score_ops = [k for k, op in enumerate(prog.ops) if sites.region[k]
                 and op.prim == "dot_general" and sites.fused.attention[k] == FUSED_FORWARD]
    assert len(score_ops) == LAYERS
    xla_fwd = 2 * 2.0 * pairs * T * T * HD
    np.testing.assert_array_equal(xg.flops[score_ops], xla_fwd / 2)   # jax's roofline
    assert graph.flops[fwd].sum() == pytest.approx(LAYERS * xla_fwd * (T + 1) / (2 * T))
    # not causal: every entry
    _, _, full = traced("cudnn", causal=False)
    np.testing.assert_array_equal(full.flops[full.attention == FUSED_FORWARD], xla_fwd)


def test_fused_attention_holds_no_t_by_t_value_and_splits_with_the_batch():
    layout, closed, graph = traced("cudnn")
    prog = flatten(closed)
    assert not [v.shape for v in prog.vars if list(v.shape).count(T) >= 2]
    # the log-sum-exp (B, heads, T) float32 is what the backward pass keeps
    lse = [prog.vars[op.outs[1]] for op in prog.ops if op.prim.endswith("fwd_wrapper")]
    assert [(v.shape, str(v.dtype)) for v in lse] == [((B, HEADS, T), "float32")] * LAYERS
    # the XLA step's scores dominate its memory: the fused step's peak is far below
    _, _, xgraph = traced("xla")

    def peak(g):
        base = 2 + 6 * len(g.params)
        return float((g.live[:, 0] + g.live[:, base:].sum(axis=1)).max())
    scores = B * HEADS * T * T * 4    # one layer's float32 logits
    assert peak(graph) < peak(xgraph) - scores
    # data parallelism: every result of the kernels carries the batch on its leading dim
    axis, partial = batch_dims(prog, [i for i, r in zip(prog.in_ids, layout.inputs.roles,
                                                        strict=True) if r.kind == BATCH])
    att = np.flatnonzero(graph.attention)
    assert all(axis[o] == 0 for k in att for o in prog.ops[k].outs)
    assert graph.batched[att].all() and not partial[att].any()
    # tensor parallelism: the heads a column-parallel q projection splits split the kernel
    assert (graph.tp_op_param[att] >= 0).all()


def test_fused_counterfactual_of_the_xla_step_matches_the_cudnn_step():
    """The XLA step with its attention replaced by the fused kernels
    (`ScoreSites.fused`) against the cuDNN step, on the same layouts of every mesh the
    search keeps: time within 10%, peak memory within 5%, and faster than the XLA step by
    at least a tenth; and the memory pass run again
    with nothing removed reproduces the graph's own."""
    xl, xc, xg = traced("xla", seq=1024)
    _, _, cg = traced("cudnn", seq=1024)
    sites = sites_of(xl, xc, xg)
    assert sites.instances == LAYERS and sites.masked
    assert sites.shape[-2:] == (1024, 1024)
    prog = flatten(xc)
    kinds, _ = op_kinds(prog)
    flow = dataflow(prog, kinds, xl.inputs.roles, xl.outputs.roles, xl.params, B)
    mem = step_live(xg, prog, kinds, flow, xl.inputs.roles, xl.outputs.roles, xl.params,
                    prog.nbytes)
    np.testing.assert_array_equal(mem.live, xg.live)
    assert mem.tp_live_kind == xg.tp_live_kind
    # the changes it hands the fused graph are the graph's own, kept as they were made
    assert isinstance(mem.live, LiveRows)
    np.testing.assert_array_equal(mem.live.changes.toarray(), xg.live_changes.toarray())
    fused_rows = sites.fused.live_changes
    assert fused_rows is sites.fused.live.changes
    dense = np.diff(sites.fused.live, axis=0, prepend=np.zeros((1, sites.fused.live.shape[1])))
    np.testing.assert_allclose(fused_rows.toarray(), dense)
    found = search(xg, H100X8, Objective("throughput"), 8, 72e9)
    checked = 0
    for r in found.results:
        if r.stages > 1:
            continue
        est, real = (_layout_prediction(g, H100X8, r) for g in (sites.fused, cg))
        xla = _layout_prediction(xg, H100X8, r)
        assert est.step_time_s == pytest.approx(real.step_time_s, rel=0.10), r.describe()
        assert est.peak_memory_bytes == pytest.approx(real.peak_memory_bytes, rel=0.05)
        # the fused kernels save the scores' memory traffic: at least a tenth of this step
        assert est.step_time_s < 0.9 * xla.step_time_s
        checked += 1
    assert checked >= 4


# --------------------------------------------------------------------------- advice
def test_explain_advises_fused_attention_where_the_scores_dominate():
    step, params, opt, batch = llama("xla", seq=2048)
    plan = jaxwap.plan(step, params, opt, batch, hardware=H100X8, verify=0, cache=False)
    a = plan.attention
    assert a is not None
    assert a.instances == LAYERS and a.shape[-2:] == (2048, 2048) and a.masked
    assert a.seconds >= SHARE * a.step_time_s or a.bytes >= SHARE * a.peak_memory_bytes
    assert a.step_time_s == plan.predicted.step_time_s
    assert a.fused_step_time_s < a.step_time_s and a.fused_peak_memory_bytes < \
        a.peak_memory_bytes
    assert 0 < a.fused_seconds < a.seconds
    # the fused step planned (the same search): it fits and is faster
    assert a.replanned_mesh and a.replanned_step_time_s < a.step_time_s
    assert a.replanned_peak_memory_bytes <= plan.memory_budget_bytes
    text = plan.explain()
    assert "advice (predicted):" in text
    share = f"({a.seconds / a.step_time_s:.0%})"
    line = next(x for x in text.splitlines() if "attention scores:" in x)
    assert share in line and f"{a.step_time_s * 1e3:.3f} ms step" in line
    fused = next(x for x in text.splitlines() if 'implementation="cudnn"' in x)
    assert f"step {a.fused_step_time_s * 1e3:.3f} ms" in fused and "is_causal=True" in fused
    assert f"mesh {a.replanned_mesh}: step {a.replanned_step_time_s * 1e3:.3f} ms" in fused
    assert Plan.from_json(plan.to_json()).attention == a


def test_hand_written_attention_gets_the_advice_and_an_mlp_none():
    """zoo's Llama writes softmax(q k^T) v in plain jnp (einsum, a tril mask): found as
    well. An MLP has no scores: no advice, and its plan reads as before."""
    w = zoo.llama("llama_tiny", layers=2, seq_len=1024, batch_size=8, d_model=128,
                  heads=4, kv_heads=2, ffn=192, vocab=320)
    plan = jaxwap.plan(w.step, *w.args, hardware=H100X8, verify=0, cache=False)
    assert plan.attention is not None and plan.attention.masked
    assert plan.attention.shape[-2:] == (1024, 1024)
    step, params, opt, data = abstract_setup((512, 256, 10), batch=64, in_dim=128)
    mlp = jaxwap.plan(step, params, opt, data, hardware=H100X8, verify=0, cache=False)
    assert mlp.attention is None
    assert "advice (predicted)" not in mlp.explain()
    assert '"attention":' not in mlp.to_json()


def test_advice_that_cannot_be_priced_is_a_note_not_a_failed_plan(monkeypatch):
    import jaxwap.decide.score_detection as scores

    def broken(*args, **kwargs):
        raise RuntimeError("the detection broke")
    monkeypatch.setattr(scores, "_site", broken)
    step, params, opt, batch = llama("xla", seq=1024)
    plan = jaxwap.plan(step, params, opt, batch, hardware=H100X8, verify=0, cache=False)
    assert plan.attention is None
    assert ("the attention advice not computed (RuntimeError: the detection broke)"
            in plan.notes)


def test_a_contrastive_loss_pairs_samples_not_positions():
    """CLIP's logits (images x texts of one batch, through a softmax) are a product of two
    activations reaching an exp, read by a matmul with a third in the backward pass; but
    they pair the batch's samples: not attention, nothing found."""
    n, dim = 512, 64

    def loss_fn(params, batch):
        a = jnp.tanh(batch["x"].astype(bf16) @ params["a"].astype(bf16))
        b = jnp.tanh(batch["y"].astype(bf16) @ params["b"].astype(bf16))
        logits = (a @ b.T).astype(f32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(n)).mean()
    params = {k: jax.ShapeDtypeStruct((dim, dim), f32) for k in "ab"}
    tx = optax.adam(1e-3)
    data = {k: jax.ShapeDtypeStruct((n, dim), f32) for k in "xy"}
    step, opt = jaxwap.make_train_step(loss_fn, tx), jax.eval_shape(tx.init, params)
    layout, closed = layout_of(step, (params, opt, data), {}, params, None)
    graph = analyze(closed, layout.inputs.roles, layout.outputs.roles, layout.params,
                    layout.inputs.batch_size)
    assert sites_of(layout, closed, graph) is None


def test_nothing_fits_says_what_the_fused_kernel_would_fit():
    """A plain step (no micro-batches to fall back on) under a budget its XLA attention
    cannot meet: the error says the fused kernel's plan, found by the same search."""
    step, params, opt, batch = llama("xla", seq=2048)
    tx = step.optimizer

    def plain(p, o, b):
        loss, g = jax.value_and_grad(step.loss_fn)(p, b)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss
    with pytest.raises(MemoryError) as e:
        jaxwap.plan(plain, params, opt, batch, hardware=H100X8, verify=0, cache=False,
                    memory_budget=40e6)
    got = str(e.value)
    assert got.startswith("no candidate plan fits")
    assert (f"The step materializes its attention scores ({LAYERS} attention score "
            f"products of {B * HEADS} x 2048 x 2048") in got
    fits = float(got.split("peak ")[-1].split(" MB")[0]) * 1e6
    assert 'implementation="cudnn", is_causal=True' in got and fits <= 40e6


def test_cpu_targets_get_no_advice():
    step, params, opt, batch = llama("xla", seq=1024)
    plan = jaxwap.plan(step, params, opt, batch, hardware=jaxwap.Cluster("cpu", 8),
                       verify=0, cache=False)
    assert plan.attention is None   # a CPU does not run cuDNN's kernel


# --------------------------------------------------------------------------- targets
def test_targets_that_cannot_run_the_kernel_and_verification_on_cpu():
    step, params, opt, batch = llama("cudnn")
    plan = jaxwap.plan(step, params, opt, batch, hardware=H100X8, verify=1, cache=False)
    assert any(n.startswith("verification skipped: the step uses cuDNN's fused attention")
               for n in plan.notes), plan.notes
    assert plan.compiled is None
    # that plan compiled to run on these CPU devices: the clear error, not jax's
    with pytest.raises(RuntimeError, match="the devices present are not NVIDIA GPUs"):
        jaxwap.auto_shard(step, plan=plan).lower_and_compile(params, opt, batch)
    # a target that cannot run it, even for a step traced before for one that can
    for hw, why in ((jaxwap.Cluster("cpu", 8), "are not NVIDIA GPUs"),
                    (jaxwap.Cluster("v100-sxm2", 8), "compute capability 7.0"),
                    (None, r"the devices planned for \('cpu.*are not NVIDIA GPUs")):
        with pytest.raises(RuntimeError, match=why):
            jaxwap.plan(step, params, opt, batch, hardware=hw, verify=0, cache=False)
    # ... and one jax traces afresh: its own check answers for the devices present
    fresh = llama("cudnn")
    with pytest.raises(RuntimeError, match="the devices present are not NVIDIA GPUs"):
        jaxwap.plan(*fresh, verify=0, cache=False)
    # compiled to run on these CPU devices: a clear error, not a missing lowering rule
    layout, closed, _ = traced("cudnn")
    with pytest.raises(RuntimeError, match=r"run it there"):
        require_compilable(closed, jax.devices())


def test_adapter_fails_loudly_when_jax_changes_its_private_surface(monkeypatch):
    module = importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")
    layout, closed, _ = traced("cudnn")
    eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name.endswith("fwd_wrapper"))
    flops, traffic = fused_cost(eqn)
    assert flops > 0 and traffic > 0
    params = {k: v for k, v in eqn.params.items() if k != "mask_type"}
    with pytest.raises(RuntimeError, match=r"changed the private API.*mask_type"):
        fused_cost(eqn.replace(params=params))
    monkeypatch.delattr(module, "check_cudnn_version")
    # a step without cuDNN's attention still plans; one with it says what jax changed
    step, params, opt, data = abstract_setup((64, 10), batch=16, in_dim=32)
    assert jaxwap.plan(step, params, opt, data, hardware=H100X8, verify=0,
                       cache=False).predicted.step_time_s > 0
    with pytest.raises(RuntimeError, match=rf"jax {jax.__version__} changed the private "
                                           r"API.*lacks check_cudnn_version"):
        traced("cudnn")
    monkeypatch.undo()
    monkeypatch.setattr(module, "is_cuda_compute_capability_equal", None)
    with pytest.raises(RuntimeError, match="lacks is_cuda_compute_capability_equal"):
        traced("cudnn")


def test_device_profiles_carry_the_published_attention_rates():
    h100, h200 = device_spec("h100-sxm"), device_spec("h200")
    # the published rates (529 and 518 Tflop/s), as shares of the profile's matmul rate
    assert h100.attention_fwd_efficiency * h100.peak_flops == pytest.approx(529e12)
    assert h100.attention_bwd_efficiency * h100.peak_flops == pytest.approx(518e12)
    assert h200.attention_fwd_efficiency == h100.attention_fwd_efficiency
    assert h100.compute_capability == "9.0" and device_spec("cpu").compute_capability is None
    # a profile without them reads and writes as before (plan-cache keys unchanged)
    cpu = device_spec("cpu").to_dict()
    assert "compute_capability" not in cpu and "attention_fwd_efficiency" not in cpu
    assert type(h100).from_dict(h100.to_dict()) == h100
    with pytest.raises(ValueError, match="attention_fwd_efficiency"):
        dataclasses.replace(h100, attention_fwd_efficiency=1.5)
    # the kernel's time at the rate: a forward kernel of 8 x 32 heads x 8k causal, 128
    # head dim takes its flops over 529 Tflop/s (the matmul efficiency of so large a
    # kernel is 1 within 1e-3)
    flops = 2.0 * 8 * 32 * kept_pairs(8192, 8192, True) * 256
    assert flops / (h100.peak_flops * h100.attention_fwd_efficiency) == pytest.approx(
        flops / 529e12, rel=1e-9)
    assert math.isclose(float(h100.matmul_eff(np.array([flops]), h100.peak_flops)[0]), 1.0,
                        rel_tol=1e-3)
