"""`jaxwap.Objective` on hand-built predictions, and the hardware profiles
(`DeviceSpec`, the built-ins, `Cluster`)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxwap
from jaxwap import Cluster, DeviceSpec, Objective
from jaxwap.hardware.cluster import builtin_for_kind


class Pred(NamedTuple):
    """The two figures an objective reads."""

    step_time_s: float
    energy_per_step_j: float


# fastest: 1; least energy: 2; 0 and 3 dominated in one way or another
PREDS = [Pred(1.0, 10.0), Pred(0.5, 30.0), Pred(0.7, 5.0), Pred(2.0, 12.0)]
MAX_W, N_AVAIL = 700.0, 8


def pick(objective, preds, max_watts=MAX_W, n=N_AVAIL):
    scores = objective.scores(preds, max_watts=max_watts, num_devices_available=n)
    assert len(scores) == len(preds)
    return min(range(len(preds)), key=lambda i: scores[i]), scores


def zeus(eta, p, max_watts=MAX_W, n=N_AVAIL):
    return eta * p.energy_per_step_j + (1 - eta) * max_watts * n * p.step_time_s


# --------------------------------------------------------------------------- objectives
def test_throughput_picks_fastest():
    best, scores = pick(Objective("throughput"), PREDS)
    assert best == 1
    assert scores == [p.step_time_s for p in PREDS]


def test_energy_picks_least_energy():
    best, scores = pick(Objective("energy"), PREDS)
    assert best == 2
    assert scores == [p.energy_per_step_j for p in PREDS]


@pytest.mark.parametrize("eta", [0.0, 0.3, 0.5, 0.9, 1.0])
def test_balanced_follows_zeus_cost(eta):
    obj = Objective("balanced", eta=eta)
    best, scores = pick(obj, PREDS)
    assert scores == pytest.approx([zeus(eta, p) for p in PREDS], rel=1e-12)
    assert best == min(range(len(PREDS)), key=lambda i: zeus(eta, PREDS[i]))


def test_balanced_trades_time_for_energy_with_eta():
    # small powers make the energy term matter: eta=0 is throughput, eta=1 energy
    preds = [Pred(1.0, 100.0), Pred(1.5, 10.0)]
    assert pick(Objective("balanced", eta=0.0), preds, max_watts=10, n=2)[0] == 0
    assert pick(Objective("balanced", eta=1.0), preds, max_watts=10, n=2)[0] == 1
    # 0.5*100 + 0.5*20*1.0 = 60 vs 0.5*10 + 0.5*20*1.5 = 20: the frugal one wins
    best, scores = pick(Objective("balanced", eta=0.5), preds, max_watts=10, n=2)
    assert best == 1 and scores == pytest.approx([60.0, 20.0])
    # N is the devices available: a larger allocation charges time more
    best, scores = pick(Objective("balanced", eta=0.5), preds, max_watts=10, n=100)
    assert best == 0 and scores == pytest.approx([550.0, 755.0])


def test_default_objective_is_balanced_half():
    obj = Objective()
    assert obj.kind == "balanced" and obj.eta == 0.5 and obj.max_slowdown is None
    assert Objective.parse("balanced") == obj


def test_max_slowdown_picks_least_energy_within_bound():
    preds = [Pred(1.0, 100.0), Pred(1.04, 50.0), Pred(1.06, 10.0), Pred(1.5, 1.0)]
    obj = Objective(max_slowdown=0.05)
    assert obj.kind == "max_slowdown"
    best, scores = pick(obj, preds)
    assert best == 1
    assert scores[:2] == [100.0, 50.0]
    assert scores[2] == math.inf and scores[3] == math.inf


def test_max_slowdown_bound_is_inclusive_and_relative_to_fastest():
    preds = [Pred(2.0, 100.0), Pred(2.1, 40.0), Pred(2.1000001, 1.0)]
    best, scores = pick(Objective(max_slowdown=0.05), preds)
    assert best == 1 and scores[2] == math.inf
    # order does not matter
    best, _ = pick(Objective(max_slowdown=0.05), preds[::-1])
    assert preds[::-1][best] == preds[1]


def test_max_slowdown_zero_and_large():
    preds = [Pred(1.0, 100.0), Pred(1.0, 80.0), Pred(3.0, 1.0)]
    best, scores = pick(Objective(max_slowdown=0.0), preds)
    assert best == 1 and scores[2] == math.inf
    best, _ = pick(Objective(max_slowdown=10.0), preds)
    assert best == 2


def test_scores_of_nothing():
    for obj in (Objective("throughput"), Objective("energy"), Objective(),
                Objective(max_slowdown=0.1)):
        assert obj.scores([], max_watts=MAX_W, num_devices_available=N_AVAIL) == []


def test_parse():
    assert Objective.parse("throughput") == Objective(kind="throughput")
    assert Objective.parse("energy").kind == "energy"
    assert Objective.parse("balanced") == Objective()
    o = Objective(max_slowdown=0.1)
    assert Objective.parse(o) is o
    with pytest.raises(ValueError, match="fastest"):
        Objective.parse("fastest")
    with pytest.raises(ValueError, match="max_slowdown"):
        Objective.parse("max_slowdown")  # needs a value
    assert Objective.parse("max_slowdown=0.05") == Objective(max_slowdown=0.05)
    with pytest.raises(ValueError, match="'fast' is not a number"):
        Objective.parse("max_slowdown=fast")


def test_the_objective_error_lists_only_what_it_accepts():
    """Each string form the error offers is one `parse` takes: the error named
    'max_slowdown' among the valid strings, then refused it without a number."""
    with pytest.raises(ValueError) as e:
        Objective.parse("fastest")
    offered = re.findall(r"'([^']+)'", str(e.value).split(" got ")[0])
    assert offered == ["throughput", "energy", "balanced", "max_slowdown=X",
                       "max_slowdown=0.05"]
    for form in offered:
        Objective.parse(form.replace("=X", "=0.1"))
    with pytest.raises(TypeError, match="objective"):
        Objective.parse(42)
    with pytest.raises(TypeError):
        Objective.parse(None)


@pytest.mark.parametrize("kwargs, match", [
    (dict(eta=1.5), "eta"),
    (dict(eta=-0.1), "eta"),
    (dict(max_slowdown=-1), "max_slowdown"),
    (dict(max_slowdown=float("nan")), "max_slowdown"),
    (dict(kind="energy", max_slowdown=0.1), "max_slowdown"),
    (dict(kind="throughput", max_slowdown=0.1), "max_slowdown"),
    (dict(kind="max_slowdown"), "max_slowdown"),
    (dict(kind="fast"), "fast"),
])
def test_objective_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Objective(**kwargs)


def test_objective_serialises_and_describes():
    for obj in (Objective("throughput"), Objective("energy"), Objective(eta=0.25),
                Objective(max_slowdown=0.05)):
        d = json.loads(json.dumps(obj.to_dict()))
        assert Objective.from_dict(d) == obj
    assert "5%" in Objective(max_slowdown=0.05).describe()
    assert "0.25" in Objective(eta=0.25).describe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        Objective().eta = 0.1


# --------------------------------------------------------------------------- DeviceSpec
def spec(**overrides):
    kw = dict(name="test", peak_flops=1e14, memory_bandwidth=1e12, memory_bytes=16e9,
              idle_watts=50.0, max_watts=300.0)
    kw.update(overrides)
    return DeviceSpec(**kw)


@pytest.mark.parametrize("field", ["peak_flops", "memory_bandwidth", "memory_bytes",
                                   "max_watts"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_device_spec_rejects_non_positive(field, value):
    with pytest.raises(ValueError, match=field):
        spec(**{field: value})


@pytest.mark.parametrize("idle", [-1.0, 301.0])
def test_device_spec_idle_watts_in_range(idle):
    with pytest.raises(ValueError, match="idle_watts"):
        spec(idle_watts=idle)
    assert spec(idle_watts=0.0).idle_watts == 0.0
    assert spec(idle_watts=300.0).idle_watts == 300.0


@pytest.mark.parametrize("overrides", [
    dict(peak_flops_f32=0.0),
    dict(peak_flops_f32=-1e12),
    dict(kernel_overhead_s=-1.0),
    dict(efficiency_half_flops=-1.0),
    dict(link_bandwidth=0.0),
    dict(link_latency_s=-1e-6),
])
def test_device_spec_rejects_bad_optional_figures(overrides):
    # regression: only the required figures were checked; peak_flops_f32=0 gave plans
    # with step_time_s=nan and kernel_overhead_s=-1 negative step times
    with pytest.raises(ValueError, match=next(iter(overrides))):
        spec(**overrides)


def test_device_spec_flops_rate():
    s = spec(peak_flops=1e14, peak_flops_f32=3e13)
    assert s.flops_rate(jnp.bfloat16) == 1e14
    assert s.flops_rate(np.float16) == 1e14
    assert s.flops_rate(np.float32) == 3e13
    assert spec().flops_rate(np.float32) == 5e13  # half the 16-bit peak by default


def test_device_spec_round_trip():
    s = spec(peak_flops_f32=2e13, link_bandwidth=1e11)
    assert DeviceSpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s


# --------------------------------------------------------------------------- built-ins
BUILTINS = ["h100-sxm", "h200", "a100-sxm-80gb", "a100-sxm-40gb", "v100-sxm2", "v100-pcie",
            "cpu"]


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_profiles(name):
    assert name in jaxwap.builtin_device_names()
    s = jaxwap.device_spec(name)
    assert isinstance(s, DeviceSpec) and s.name == name
    assert s.peak_flops > 0 and s.memory_bandwidth > 0 and s.memory_bytes > 0
    assert 0 <= s.idle_watts < s.max_watts
    assert s.flops_rate(np.float32) <= s.peak_flops
    assert s.link_bandwidth > 0 and s.link_latency_s >= 0
    assert jaxwap.device_spec(name.upper()) == s
    assert jaxwap.device_spec(s) is s
    assert Cluster(name, 2).device == s


def test_builtin_figures_are_ordered_sensibly():
    ds = jaxwap.device_spec
    assert ds("a100-sxm-40gb").memory_bytes < ds("a100-sxm-80gb").memory_bytes
    assert ds("h100-sxm").memory_bytes < ds("h200").memory_bytes
    assert ds("h200").memory_bandwidth > ds("h100-sxm").memory_bandwidth
    assert ds("v100-sxm2").peak_flops < ds("a100-sxm-80gb").peak_flops < ds("h100-sxm").peak_flops
    assert ds("cpu").peak_flops < ds("v100-sxm2").peak_flops
    assert ds("h100-sxm").memory_bytes == pytest.approx(80e9)


@pytest.mark.parametrize("kind, name", [
    ("Tesla V100-PCIE-32GB", "v100-pcie"), ("Tesla V100-SXM2-16GB", "v100-sxm2"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"), ("NVIDIA H100 80GB HBM3", "h100-sxm")])
def test_device_kind_picks_its_builtin(kind, name):
    # the PCIe V100 is a 250 W card that accepts 100-250 W; the SXM2 one is not it
    assert builtin_for_kind(kind, "gpu").name == name


def test_a_capped_v100_pcie_accepts_the_published_limits():
    power = jaxwap.device_spec("v100-pcie").power_profile()
    assert power.check_limit(100.0, "V100") == 100.0
    with pytest.raises(ValueError, match="100-250 W"):
        power.check_limit(300.0, "V100")


def test_unknown_profile_lists_builtins():
    with pytest.raises(ValueError, match="tpu-v9") as e:
        jaxwap.device_spec("tpu-v9")
    for name in BUILTINS:
        assert name in str(e.value)


# --------------------------------------------------------------------------- Cluster
def test_cluster_defaults_link_to_the_device():
    c = Cluster("h100-sxm", 8)
    dev = jaxwap.device_spec("h100-sxm")
    assert c.device == dev and c.num_devices == 8
    assert c.link_bandwidth == dev.link_bandwidth == 450e9
    assert c.link_latency == dev.link_latency_s
    a = Cluster("a100-sxm-40gb", 4)
    assert a.link_bandwidth == jaxwap.device_spec("a100-sxm-40gb").link_bandwidth


def test_cluster_link_override():
    c = Cluster("h100-sxm", 8, link_bandwidth=25e9)
    assert c.link_bandwidth == 25e9
    assert c.link_latency == jaxwap.device_spec("h100-sxm").link_latency_s
    c2 = Cluster("h100-sxm", 8, link_bandwidth=25e9, link_latency=1e-5)
    assert c2.link_latency == 1e-5
    assert c != Cluster("h100-sxm", 8)
    assert c.device == Cluster("h100-sxm", 8).device  # the device itself is unchanged


@pytest.mark.parametrize("cluster", [
    Cluster("h100-sxm", 8),
    Cluster("h100-sxm", 8, link_bandwidth=25e9),
    Cluster("cpu", 1, link_latency=0.0),
    Cluster(DeviceSpec("custom", 1e13, 5e11, 8e9, 10, 100, peak_flops_f32=4e12), 3),
], ids=["nvlink", "pcie", "cpu", "custom"])
def test_cluster_round_trip(cluster):
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    assert Cluster.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster
    assert hash(Cluster.from_dict(cluster.to_dict())) == hash(cluster)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_devices=0), "num_devices"),
    (dict(num_devices=-2), "num_devices"),
    (dict(num_devices=2.5), "num_devices"),
    (dict(num_devices="8"), "num_devices"),
    (dict(num_devices=8, link_bandwidth=0), "link_bandwidth"),
    (dict(num_devices=8, link_latency=-1e-6), "link_latency"),
])
def test_cluster_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Cluster("h100-sxm", **kwargs)


def test_cluster_is_frozen():
    c = Cluster("h100-sxm", 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_devices = 4


def _grad_comm_time(cluster):
    """Predicted gradient-reduction time of an 8-way data-parallel step on `cluster`."""
    din, dout, batch = 64, 8, 64
    params = {"w": jax.ShapeDtypeStruct((din, dout), jnp.float32),
              "b": jax.ShapeDtypeStruct((dout,), jnp.float32)}
    tx = optax.sgd(0.1)

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    batch = {"x": jax.ShapeDtypeStruct((batch, din), jnp.float32),
             "y": jax.ShapeDtypeStruct((batch, dout), jnp.float32)}
    # the mesh fixed: the free search may split the layer over a model axis instead
    plan = jaxwap.plan(train_step, params, jax.eval_shape(tx.init, params), batch,
                       hardware=cluster, mesh_shape={"data": 8, "model": 1},
                       objective="throughput")
    assert plan.mesh_shape == {"data": 8, "model": 1}
    assert plan.hardware == cluster
    return plan.predicted.grad_comm_time_s


def test_slower_link_costs_more_communication():
    nvlink = _grad_comm_time(Cluster("h100-sxm", 8))
    pcie = _grad_comm_time(Cluster("h100-sxm", 8, link_bandwidth=25e9))
    assert 0 < nvlink < pcie


# --------------------------------------------------------------------------- in planning
@pytest.mark.parametrize("objective, metric", [
    ("throughput", "step_time_s"),
    ("energy", "energy_per_step_j"),
])
def test_planner_choice_follows_objective(objective, metric):
    din, hidden, dout, batch = 32, 64, 8, 64
    params = {"l1": {"w": jax.ShapeDtypeStruct((din, hidden), jnp.float32)},
              "l2": {"w": jax.ShapeDtypeStruct((hidden, dout), jnp.float32)}}
    tx = optax.sgd(0.1)

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            h = jax.nn.relu(batch["x"] @ p["l1"]["w"])
            return jnp.mean((h @ p["l2"]["w"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    batch = {"x": jax.ShapeDtypeStruct((batch, din), jnp.float32),
             "y": jax.ShapeDtypeStruct((batch, dout), jnp.float32)}
    opt_state = jax.eval_shape(tx.init, params)
    # analytic only: every ranked candidate is scored on the model's prediction
    plan = jaxwap.plan(train_step, params, opt_state, batch,
                       hardware=Cluster("h100-sxm", 8), objective=objective, verify=0)
    assert plan.objective == Objective(objective)
    ranked = [c for c in plan.candidates if math.isfinite(c.score)]
    assert ranked
    chosen = next(c for c in plan.candidates if c.chosen)
    assert getattr(chosen.predicted, metric) == min(getattr(c.predicted, metric)
                                                     for c in ranked)
    assert all(c.score == getattr(c.predicted, metric) for c in ranked)
    # verified: the finalists are scored on the model fed XLA's figures
    plan = jaxwap.plan(train_step, params, opt_state, batch,
                       hardware=Cluster("h100-sxm", 8), objective=objective, verify=2)
    verified = [c for c in plan.candidates if c.verified is not None and c.fits]
    chosen = next(c for c in plan.candidates if c.chosen)
    assert chosen in verified and plan.verified == chosen.verified
    assert getattr(chosen.verified, metric) == min(getattr(c.verified, metric)
                                                    for c in verified)
    assert all(c.score == getattr(c.verified, metric) for c in verified)
