"""Per-layer rematerialization as a planner decision (`StepVariant(remat="layer_*")`,
`layer_remat.layer_remat_loss`): each layer of a `make_train_step` loss's layer
scan checkpointed with a policy. The step computes the same gradients, XLA's compiled
memory shows the saving the model credits, and the ladder takes it before micro-batches
when the step as written does not fit."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jaxwap
from benchmarks.models import zoo
from jaxwap.core.records import StepVariant

LR = 1e-2


@pytest.fixture(scope="module")
def decoder():
    """An 8-layer scanned decoder in float32 under plain SGD (so a step's update is the
    gradient itself, not Adam's normalization of it), with real arrays."""
    w = zoo.llama("llama_tiny", batch_size=8, seq_len=128, scan=True, dtype="float32",
                  layers=8, d_model=128, ffn=512, heads=4, kv_heads=4)
    params, _, batch = w.init(0)
    step = jaxwap.make_train_step(w.step.loss_fn, optax.sgd(LR))
    return step, params, step.init(params), batch


def _update(before, after):
    return [np.asarray(b) - np.asarray(a) for a, b in
            zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)]


@pytest.mark.parametrize("policy", ["layer_dots", "layer_full", "layer_offload"])
def test_a_per_layer_remat_plan_on_8_devices_computes_the_plain_steps_update(decoder, policy):
    """Each policy, host offload of the kept values included (XLA:CPU runs it with the
    values left in device memory: the numbers, not the saving, are what a CPU checks)."""
    step, params, opt, batch = decoder
    ref = jax.jit(step)(params, opt, batch)
    variant = step.with_variant(StepVariant(remat=policy))
    jaxpr = jax.make_jaxpr(variant)(params, opt, batch).pretty_print()
    assert "remat" in jaxpr and "remat" not in jax.make_jaxpr(step)(params, opt,
                                                                      batch).pretty_print()
    sharded = jaxwap.auto_shard(variant, params, mesh_shape={"data": 8}, verify=0,
                                cache=False)
    out = sharded(jax.tree.map(np.array, params), opt, batch)
    assert dict(sharded.plan.mesh_shape)["data"] == 8
    assert float(out[2]) == pytest.approx(float(ref[2]), rel=2e-5)
    for want, got in zip(_update(params, ref[0]), _update(params, out[0]), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6 * LR)


def test_xla_compiled_memory_shows_the_saving_the_model_credits(decoder):
    """One device, each policy planned and compiled (verify=1): the drop in peak memory
    the model predicts against the step as written is within 15% of the drop in XLA's
    memory analysis of the compiled programs."""
    step, params, opt, batch = decoder
    figures = {}
    for policy in ("none", "layer_dots", "layer_full"):
        plan = jaxwap.plan(step.with_variant(StepVariant(remat=policy)), params, opt, batch,
                           hardware=jaxwap.Cluster("cpu", 1), mesh_shape={"data": 1},
                           verify=1, cache=False)
        figures[policy] = (plan.predicted.peak_memory_bytes, plan.compiled.memory_bytes)
    for policy in ("layer_dots", "layer_full"):
        predicted = figures["none"][0] - figures[policy][0]
        compiled = figures["none"][1] - figures[policy][1]
        assert compiled > 0.5 * figures["none"][1]        # a real saving, most of the peak
        assert predicted == pytest.approx(compiled, rel=0.15), (policy, figures)
    assert figures["layer_full"][1] < figures["layer_dots"][1]


def test_the_ladder_takes_per_layer_remat_before_micro_batches(decoder):
    """With a budget the step as written exceeds, the planner restructures it with the
    cheapest per-layer policy that fits (selective before full), not micro-batches, and
    says so; with a tighter one, full recompute."""
    step, params, opt, batch = decoder
    need = {}
    for policy in ("none", "layer_dots", "layer_full"):
        need[policy] = jaxwap.plan(step.with_variant(StepVariant(remat=policy)), params, opt,
                                   batch, hardware=jaxwap.Cluster("cpu", 1), verify=0,
                                   cache=False).predicted.peak_memory_bytes
    assert need["none"] > need["layer_dots"] > need["layer_full"]
    for budget, want in (((need["none"] + need["layer_dots"]) / 2, "layer_dots"),
                         ((need["layer_dots"] + need["layer_full"]) / 2, "layer_full")):
        plan = jaxwap.plan(step, params, opt, batch, hardware=jaxwap.Cluster("cpu", 1),
                           verify=0, cache=False, memory_budget=budget)
        assert (plan.step.remat, plan.step.micro_batches) == (want, 1)
        assert plan.predicted.peak_memory_bytes <= budget
        assert "each layer checkpointed" in plan.explain()


def test_the_ladder_puts_per_layer_policies_first_and_offload_on_gpus_only():
    from jaxwap.runtime.train_step import ladder

    micro = [StepVariant(micro_batches=k) for k in (2, 4, 8)]
    assert ladder(8, "gpu", layers="scan") == [StepVariant(remat="layer_dots"),
                                               StepVariant(remat="layer_full"),
                                               StepVariant(remat="layer_offload"), *micro]
    assert ladder(8, "cpu", layers="scan") == [StepVariant(remat="layer_dots"),
                                               StepVariant(remat="layer_full"), *micro]
    assert ladder(8, "gpu") == micro      # no layer scan: micro-batches only


def _two_layer_mlp():
    """A loss with no layers to checkpoint: two matmuls of different shapes."""
    import jax.numpy as jnp

    params = {"w1": jnp.ones((64, 256)) / 64, "w2": jnp.ones((256, 8)) / 256}
    batch = {"x": jnp.ones((32, 64)), "y": jnp.ones((32, 8))}

    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    step = jaxwap.make_train_step(loss, optax.sgd(LR))
    return step, (params, step.init(params), batch)


def test_a_loss_without_layers_says_why_per_layer_remat_was_not_tried():
    step, args = _two_layer_mlp()
    plain = jaxwap.plan(step, *args, hardware=jaxwap.Cluster("cpu", 1), verify=0,
                        cache=False)
    plan = jaxwap.plan(step, *args, hardware=jaxwap.Cluster("cpu", 1), verify=0,
                       cache=False, memory_budget=0.9 * plain.predicted.peak_memory_bytes,
                       offload=False)
    assert plan.step.remat == "none" and plan.step.micro_batches > 1
    assert any("per-layer rematerialization not tried: no layers found" in n
               and "no repeated blocks" in n for n in plan.notes)


@pytest.fixture(scope="module")
def unrolled():
    """The decoder of `decoder`, written as a newcomer writes it: a Python loop over its
    8 layers (no scan)."""
    w = zoo.llama("llama_tiny", batch_size=8, seq_len=128, scan=False, dtype="float32",
                  layers=8, d_model=128, ffn=512, heads=4, kv_heads=4)
    params, _, batch = w.init(0)
    step = jaxwap.make_train_step(w.step.loss_fn, optax.sgd(LR))
    return step, params, step.init(params), batch


def test_an_unrolled_models_layers_are_found_as_its_repeated_blocks(unrolled):
    """Eight repeats, each starting at the layer's input (the RMSNorm of the residual
    stream, right after the embedding), each reading a layer's weights of its own."""
    from jaxwap.analysis.flatten import is_value
    from jaxwap.runtime.layer_blocks import RepeatedBlocks, find_layers
    from jaxwap.runtime.layer_scan import trace_loss

    step, params, _, batch = unrolled
    closed, _ = trace_loss(step.loss_fn, params, batch)
    leaves = jax.tree.leaves(params)
    found = find_layers(closed.jaxpr, len(leaves), 8)
    assert isinstance(found, RepeatedBlocks) and found.count == 8 and found.path == ()
    eqns = closed.jaxpr.eqns
    assert eqns[found.start].primitive.name == "square"       # RMSNorm's first op
    param_vars = {v: i for i, v in enumerate(closed.jaxpr.invars[:len(leaves)])}
    owned = [{param_vars[v] for e in eqns[a:b] for v in e.invars
              if is_value(v) and v in param_vars} for a, b in found.bounds()]
    assert all(owned) and sum(map(len, owned)) == len(set().union(*owned))  # disjoint
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert all(len({names[i].split("]")[0] for i in o}) == 1 for o in owned)   # one layer


def test_an_unrolled_models_checkpointed_blocks_on_8_devices_compute_the_plain_update(
        unrolled):
    """Full remat (the policy only changes what jax.checkpoint keeps, which the scanned
    decoder's test covers for each)."""
    policy = "layer_full"
    step, params, opt, batch = unrolled
    ref = jax.jit(step)(params, opt, batch)
    variant = step.with_variant(StepVariant(remat=policy))
    text = jax.make_jaxpr(variant)(params, opt, batch).pretty_print()
    assert text.count("checkpoint[") + text.count("remat2[") >= 8      # one per layer
    sharded = jaxwap.auto_shard(variant, params, mesh_shape={"data": 8}, verify=0,
                                cache=False)
    out = sharded(jax.tree.map(np.array, params), opt, batch)
    assert float(out[2]) == pytest.approx(float(ref[2]), rel=2e-5)
    for want, got in zip(_update(params, ref[0]), _update(params, out[0]), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6 * LR)


def test_on_a_gpu_the_planner_checkpoints_an_unrolled_models_blocks(unrolled):
    """Predicted for 16 H100s (more than the devices here: a plan for the described
    cluster, compiled by XLA for GPUs): each policy lowers the unrolled decoder's peak as
    it does the scanned one's, and with a budget between the step as written and
    selective remat, the ladder restructures the newcomer's loop with it, not
    micro-batches."""
    step, params, opt, batch = unrolled
    gpu = jaxwap.Cluster("h100-sxm", 16)
    one = {"hardware": gpu, "mesh_shape": {"data": 1}, "verify": 0, "cache": False}
    need = {p: jaxwap.plan(step.with_variant(StepVariant(remat=p)), params, opt, batch,
                           **one).predicted.peak_memory_bytes
            for p in ("none", "layer_dots", "layer_full")}
    assert need["none"] > need["layer_dots"] > need["layer_full"]
    assert need["layer_full"] < 0.5 * need["none"]
    budget = (need["none"] + need["layer_dots"]) / 2
    plan = jaxwap.plan(step, params, opt, batch, **one, memory_budget=budget, offload=False)
    assert (plan.step.remat, plan.step.micro_batches) == ("layer_dots", 1)
    assert "each layer checkpointed" in plan.explain()


def test_selective_remat_is_not_traced_where_the_matmul_outputs_it_keeps_cannot_fit(
        decoder, monkeypatch):
    """What selective remat keeps (every layer's weight-matmul outputs) is a lower bound
    of its predicted peak on one device; with a budget under that bound and over full
    remat's need, the planner checkpoints with full remat and never traces the selective
    variant."""
    from jaxwap.planning import variant_trials
    from jaxwap.runtime.layer_blocks import find_layers, saved_dot_bytes
    from jaxwap.runtime.layer_scan import trace_loss

    step, params, opt, batch = decoder
    one = {"hardware": jaxwap.Cluster("cpu", 1), "verify": 0, "cache": False}
    need = {p: jaxwap.plan(step.with_variant(StepVariant(remat=p)), params, opt, batch,
                           **one).predicted.peak_memory_bytes
            for p in ("layer_dots", "layer_full")}
    closed, _ = trace_loss(step.loss_fn, params, batch)
    kept = saved_dot_bytes(closed.jaxpr, find_layers(closed.jaxpr, len(jax.tree.leaves(
        params)), 8))
    assert need["layer_full"] < kept / 1.1 and kept <= need["layer_dots"]
    traced = []
    real = variant_trials.trace_layout
    monkeypatch.setattr(variant_trials, "trace_layout",
                        lambda fn, layout: traced.append(fn.variant.remat) or real(fn, layout))
    plan = jaxwap.plan(step, params, opt, batch, **one, offload=False,
                       memory_budget=(need["layer_full"] + kept / 1.1) / 2)
    assert (plan.step.remat, plan.step.micro_batches) == ("layer_full", 1)
    assert traced == ["layer_full"]


def test_each_layers_kept_input_is_the_residual_stream_scanned_or_unrolled(decoder,
                                                                          unrolled):
    """What every per-layer policy keeps as each layer's input, a part of the selective
    variant's lower bound: the residual stream a layer passes the next (8 x 128 x 128
    float32), once for each of the 7 layers after the first, whether the layers are a
    scan's iterations (its carry) or a loop's repeated blocks (what a block reads from
    the block before it); the same weight-matmul outputs in both forms."""
    from jaxwap.runtime.layer_blocks import find_layers, saved_dot_bytes, saved_input_bytes
    from jaxwap.runtime.layer_scan import trace_loss

    got = []
    for step, params, _, batch in (decoder, unrolled):
        closed, _ = trace_loss(step.loss_fn, params, batch)
        layers = find_layers(closed.jaxpr, len(jax.tree.leaves(params)), 8)
        got.append((saved_input_bytes(closed.jaxpr, layers),
                    saved_dot_bytes(closed.jaxpr, layers)))
    assert got[0] == got[1]
    assert got[0][0] == 7 * 8 * 128 * 128 * 4


def test_xla_cpu_compiles_checkpointed_unrolled_blocks_to_the_plain_peak(unrolled):
    """Why a CPU's ladder leaves an unrolled model's blocks alone: XLA:CPU computes the
    recomputations ahead of the backward pass, so its compiled peak does not drop (a
    scanned model's does: `test_xla_compiled_memory_shows_the_saving_the_model_credits`).
    Should a later XLA:CPU realize the saving, this fails, and the CPU rule in
    `train_step.ladder` can go. The planner, on a CPU, says why and micro-batches."""
    step, params, opt, batch = unrolled
    peak = {p: jax.jit(step.with_variant(StepVariant(remat=p))).lower(params, opt, batch)
            .compile().memory_analysis().temp_size_in_bytes
            for p in ("none", "layer_full")}
    assert peak["layer_full"] > 0.85 * peak["none"], peak
    one = jaxwap.Cluster("cpu", 1)
    plain = jaxwap.plan(step, params, opt, batch, hardware=one, verify=0, cache=False)
    plan = jaxwap.plan(step, params, opt, batch, hardware=one, verify=0, cache=False,
                       memory_budget=0.8 * plain.predicted.peak_memory_bytes, offload=False)
    assert plan.step.remat == "none" and plan.step.micro_batches > 1
    assert any("XLA:CPU computes their recomputations" in n for n in plan.notes)


def test_a_plan_for_described_gpus_checkpoints_unrolled_blocks_on_a_cpu_host(unrolled):
    """`jaxwap.plan(hardware=<GPUs>, verify=0)` plans for the GPUs' compiler even where
    the host has as many CPU devices as the hardware describes: the unrolled blocks are
    checkpointed (the CPU's rule is XLA:CPU's, whose step nothing here compiles), where
    the same plan for the CPU micro-batches (the test above)."""
    step, params, opt, batch = unrolled
    gpu = {"hardware": jaxwap.Cluster("h100-sxm", 1), "verify": 0, "cache": False}
    plain = jaxwap.plan(step, params, opt, batch, **gpu)
    plan = jaxwap.plan(step, params, opt, batch, **gpu, offload=False,
                       memory_budget=0.8 * plain.predicted.peak_memory_bytes)
    assert plan.step.remat in ("layer_dots", "layer_full") and plan.step.micro_batches == 1
    assert not any("XLA:CPU computes their recomputations" in n for n in plan.notes)


def test_the_ladder_offers_unrolled_blocks_off_the_cpu_only():
    from jaxwap.runtime.train_step import ladder

    micro = [StepVariant(micro_batches=k) for k in (2, 4, 8)]
    assert ladder(8, "cpu", layers="blocks") == micro
    assert ladder(8, "gpu", layers="blocks") == ladder(8, "gpu", layers="scan")


def test_where_neither_fits_alone_micro_batches_are_weighed_with_and_without_remat(decoder):
    """A budget below full per-layer remat's need: the planner takes micro-batches, and
    among the fewest that fit with full remat and the fewest without, the faster
    (objective "throughput"): the chosen step is as fast as every fitting combination."""
    step, params, opt, batch = decoder
    one = jaxwap.Cluster("cpu", 1)
    full = jaxwap.plan(step.with_variant(StepVariant(remat="layer_full")), params, opt, batch,
                       hardware=one, verify=0, cache=False).predicted.peak_memory_bytes
    budget = 0.9 * full
    plan = jaxwap.plan(step, params, opt, batch, hardware=one, verify=0, cache=False,
                       memory_budget=budget, objective="throughput", offload=False)
    assert plan.step.micro_batches > 1 and plan.predicted.peak_memory_bytes <= budget
    fitting = []
    for k in (2, 4, 8):
        for remat in ("none", "layer_full"):
            try:
                fitting.append(jaxwap.plan(
                    step.with_variant(StepVariant(micro_batches=k, remat=remat)), params,
                    opt, batch, hardware=one, verify=0, cache=False, memory_budget=budget,
                    objective="throughput", offload=False).predicted.step_time_s)
            except MemoryError:
                pass
    assert fitting and plan.predicted.step_time_s == pytest.approx(min(fitting), rel=1e-9)


def test_fsdp_gathers_a_checkpointed_unrolled_block_again_in_its_backward_pass():
    """Predicted, FSDP over 16 H100s: inside a checkpointed block's backward pass the
    weights are read through jax's optimization barrier, values of their own that XLA
    gathers again, so the unrolled model holds one layer's gathered weights at a time as
    the scanned one does (not every layer's from the forward pass on, as without remat)."""
    peak = {}
    for scan in (True, False):
        w = zoo.llama("llama_tiny", batch_size=16, seq_len=128, scan=scan, dtype="float32",
                      layers=8, d_model=256, ffn=1024, heads=4, kv_heads=4)
        for policy in ("none", "layer_full"):
            peak[scan, policy] = jaxwap.plan(
                w.step.with_variant(StepVariant(remat=policy)), *w.args, params=w.params,
                hardware=jaxwap.Cluster("h100-sxm", 16), mesh_shape={"data": 16},
                strategies=("fsdp",), verify=0, cache=False).predicted.peak_memory_bytes
    assert peak[False, "layer_full"] < 0.3 * peak[False, "none"], peak
    assert peak[False, "layer_full"] < 1.6 * peak[True, "layer_full"], peak


def test_variants_bounded_by_one_that_did_not_fit_are_not_traced(unrolled, monkeypatch):
    """Predicted for 16 H100s with a budget below full per-layer remat's need: selective
    and full remat are traced and miss; offload, which keeps on the device at least what
    full remat keeps, is not traced; micro-batched full remat is bisected from the counts
    the full-remat step's activations, at 1/k of the rows, leave room for. The plan is
    the one tracing every rung gives."""
    from jaxwap.planning import micro_batch_search, variant_trials

    step, params, opt, batch = unrolled
    gpu = jaxwap.Cluster("h100-sxm", 16)
    one = {"hardware": gpu, "mesh_shape": {"data": 1}, "verify": 0, "cache": False}
    full = jaxwap.plan(step.with_variant(StepVariant(remat="layer_full")), params, opt,
                       batch, **one).predicted.peak_memory_bytes
    traced = []
    real_trace = variant_trials.trace_layout

    def counted(fn, layout):
        traced.append(fn.variant)
        return real_trace(fn, layout)

    def plan():     # what a first plan of the step traces: no analysis kept
        traced.clear()
        jaxwap.clear_caches()
        return jaxwap.plan(step, params, opt, batch, **one, memory_budget=0.7 * full)

    monkeypatch.setattr(variant_trials, "trace_layout", counted)
    bounded = plan()
    skipped = list(traced)
    assert StepVariant(remat="layer_offload") not in skipped
    assert StepVariant(remat="layer_full") in skipped
    assert bounded.step.remat == "layer_full" and bounded.step.micro_batches > 1
    monkeypatch.setattr(variant_trials, "holds_at_least", lambda a, b: False)
    monkeypatch.setattr(micro_batch_search, "_above_floor",
                        lambda trials, micro, base=None, lo=0, hi=None: lo)
    every = plan()
    assert StepVariant(remat="layer_offload") in traced and len(traced) > len(skipped)
    assert (every.step, every.mesh_shape) == (bounded.step, bounded.mesh_shape)


def test_an_unrolled_models_alike_blocks_run_one_traced_checkpoint(unrolled):
    """The eight layers compute the same function of their own inputs, so the rewrite
    traces one checkpointed block and runs it for each: every recomputation in the step
    reads the same jaxpr (JAX's caches of its derivative and transposition then serve all
    layers, where each traced afresh cost seconds at 80 layers)."""
    from jaxwap.runtime.layer_blocks import alike_repeats, find_layers
    from jaxwap.runtime.layer_scan import trace_loss

    step, params, opt, batch = unrolled
    closed, _ = trace_loss(step.loss_fn, params, batch)
    found = find_layers(closed.jaxpr, len(jax.tree.leaves(params)), 8)
    assert alike_repeats(closed.jaxpr, found) == [0] * 8
    jaxpr = jax.make_jaxpr(step.with_variant(StepVariant(remat="layer_full")))(
        params, opt, batch).jaxpr
    remats = [e.params["jaxpr"] for e in jaxpr.eqns
              if e.primitive.name in ("checkpoint", "remat2")]
    assert len(remats) == 8 and len({id(j) for j in remats}) == 1


def _scaled_mlp(scales):
    """An unrolled MLP whose layer i also multiplies by the constant scales[i]: repeats
    equal in shapes and primitives, which differ in a literal where the scales do."""
    def loss(params, batch):
        h = batch["x"]
        for p, s in zip(params, scales, strict=True):
            h = jax.numpy.tanh(h @ p["w"]) * s + h
        return ((h - batch["y"]) ** 2).mean()

    rng = np.random.default_rng(0)
    params = [{"w": rng.normal(0, 0.3, (16, 16)).astype(np.float32)} for _ in scales]
    batch = {"x": rng.normal(size=(8, 16)).astype(np.float32),
             "y": rng.normal(size=(8, 16)).astype(np.float32)}
    return loss, params, batch


def test_blocks_that_differ_in_a_constant_are_each_traced_and_keep_their_gradient():
    """Sharing one trace is only for repeats that compute the same function: layers
    scaled by different constants are found as repeats (equal shapes) but not alike, and
    the checkpointed loss's gradient is the plain one's; with equal scales they share."""
    from jaxwap.runtime.layer_blocks import alike_repeats, find_layers
    from jaxwap.runtime.layer_remat import layer_remat_loss
    from jaxwap.runtime.layer_scan import trace_loss

    def alike(scales):
        loss, params, batch = _scaled_mlp(scales)
        closed, _ = trace_loss(loss, params, batch)
        found = find_layers(closed.jaxpr, len(params), 8)
        assert found.count == len(scales)
        return alike_repeats(closed.jaxpr, found)

    assert alike([0.5, 0.5, 0.5, 0.5]) == [0, 0, 0, 0]
    assert alike([0.5, 1.5, 0.5, 2.5]) == [0, 1, 0, 3]
    loss, params, batch = _scaled_mlp([0.5, 1.5, 0.5, 2.5])
    remat = layer_remat_loss(loss, jax.checkpoint_policies.nothing_saveable)
    want = jax.grad(loss)(params, batch)
    got = jax.grad(lambda p, b: remat(p, b))(params, batch)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


def test_no_micro_batch_count_is_traced_where_each_ones_floor_is_over_the_budget(
        unrolled, monkeypatch):
    """With a budget below the weights alone on one device, every micro-batch count's
    floor (a lower bound) is over it: none is traced, the largest included, and the
    error says each was estimated."""
    from jaxwap.planning import variant_trials

    step, params, opt, batch = unrolled
    traced = []
    real_trace = variant_trials.trace_layout

    def counted(fn, layout):
        traced.append(fn.variant)
        return real_trace(fn, layout)

    monkeypatch.setattr(variant_trials, "trace_layout", counted)
    weights = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
    with pytest.raises(MemoryError) as e:
        jaxwap.plan(step, params, opt, batch, hardware=jaxwap.Cluster("h100-sxm", 16),
                    mesh_shape={"data": 1}, verify=0, cache=False,
                    memory_budget=0.5 * weights, offload=False)
    assert traced and all(v.micro_batches == 1 for v in traced), traced
    assert "8 micro-batches: needs at least" in str(e.value)


def _stack_loop(loop):
    """An 8-layer MLP run by a loop over its layers, with real arrays: a `fori_loop`
    reading `w[7 - i]` of its stacked weights (one reading `w[i]` is the layer scan it
    is: `indexed_stacks`) or a `lax.scan` carrying a second value (neither can be
    pipelined), or a `lax.scan` over the weights and a dropout key per layer (it can)."""
    layers, width, rows = 8, 64, 256
    rng = np.random.default_rng(0)
    params = {"w": (rng.standard_normal((layers, width, width)) / 8).astype(np.float32),
              "out": (rng.standard_normal((width, 4)) / 8).astype(np.float32)}
    batch = {"x": rng.standard_normal((rows, width)).astype(np.float32),
             "y": rng.standard_normal((rows, 4)).astype(np.float32),
             "key": np.asarray(jax.random.key_data(jax.random.key(1)))}

    def layer(h, w):
        a = jax.numpy.tanh(h @ w)
        return h + jax.numpy.sin(a) * jax.numpy.cos(a) + a * a

    def loss(p, b):
        if loop == "fori_loop_reversed":
            h = jax.lax.fori_loop(0, layers, lambda i, h: layer(h, p["w"][layers - 1 - i]),
                                  b["x"])
        elif loop == "scan_two_carries":
            (h, _), _ = jax.lax.scan(lambda c, w: ((layer(c[0], w), c[1] + 1.0), None),
                                     (b["x"], 0.0), p["w"])
        else:
            def body(h, wk):
                keep = jax.random.bernoulli(wk[1], 0.9, h.shape)
                return jax.numpy.where(keep, layer(h, wk[0]), 0.0), None
            keys = jax.random.split(jax.random.wrap_key_data(b["key"]), layers)
            h, _ = jax.lax.scan(body, b["x"], (p["w"], keys))
        return jax.numpy.mean((h @ p["out"] - b["y"]) ** 2)

    step = jaxwap.make_train_step(loss, optax.sgd(LR))
    return step, params, step.init(params), batch


@pytest.mark.parametrize("loop", ["fori_loop_reversed", "scan_two_carries",
                                  "scan_with_keys"])
def test_loops_over_layers_are_checkpointed_layer_by_layer_whether_or_not_they_pipeline(
        loop):
    """Two loops cannot be pipelined (the reason is kept), the scan with keys can; each
    is a loop over layers: per-layer remat checkpoints its body (the dropout drawn again
    alike in the backward pass), computes the plain step's update on 8 devices, and is
    what the ladder takes when the step as written does not fit."""
    from jaxwap.runtime.layer_blocks import find_layers
    from jaxwap.runtime.layer_scan import trace_loss

    step, params, opt, batch = _stack_loop(loop)
    closed, _ = trace_loss(step.loss_and_aux(), params, batch)
    found = find_layers(closed.jaxpr, 2, 256)
    assert found.length == 8 and bool(found.not_pipelined) == (loop != "scan_with_keys")
    ref = jax.jit(step)(params, opt, batch)
    variant = step.with_variant(StepVariant(remat="layer_full"))
    sharded = jaxwap.auto_shard(variant, params, mesh_shape={"data": 8}, verify=0,
                                cache=False)
    out = sharded(jax.tree.map(np.array, params), opt, batch)
    assert float(out[2]) == pytest.approx(float(ref[2]), rel=2e-5)
    # updates up to 0.2: 8 devices' partial gradients summed in another order than one
    # device's leave up to 5e-8 on the elements that cancel to near zero
    for want, got in zip(_update(params, ref[0]), _update(params, out[0]), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    need = {policy: jaxwap.plan(step.with_variant(StepVariant(remat=policy)), params, opt,
                                batch, hardware=jaxwap.Cluster("cpu", 1), verify=0,
                                cache=False).predicted.peak_memory_bytes
            for policy in ("none", "layer_full")}
    assert need["none"] > 1.5 * need["layer_full"]
    plan = jaxwap.plan(step, params, opt, batch, hardware=jaxwap.Cluster("cpu", 1),
                       verify=0, cache=False, memory_budget=(need["none"] + need["layer_full"]) / 2)
    assert plan.step.remat.startswith("layer_") and plan.step.micro_batches == 1
