"""The time/energy Pareto frontier: the pure function, the objectives' picks on it, a plan's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import jaxwap
from jaxwap.frontier import pareto_front

# ---------------------------------------------------------------- pareto_front


def test_pareto_front_excludes_dominated_points():
    pts = [(3.0, 1.0), (1.0, 3.0), (2.0, 2.0), (2.5, 2.5), (1.5, 3.5), (4.0, 1.0)]
    # (2.5, 2.5) by (2, 2); (1.5, 3.5) by (1, 3); (4, 1) by (3, 1) (same energy, slower)
    assert pareto_front(pts) == [1, 2, 0]


def test_pareto_front_same_time_keeps_the_lower_energy():
    assert pareto_front([(1.0, 5.0), (1.0, 4.0), (2.0, 4.0)]) == [1]


def test_pareto_front_duplicates_kept_together():
    pts = [(2.0, 1.0), (1.0, 2.0), (2.0, 1.0), (3.0, 3.0), (3.0, 3.0)]
    assert pareto_front(pts) == [1, 0, 2]


def test_pareto_front_single_and_empty_and_non_finite():
    assert pareto_front([(1.0, 1.0)]) == [0]
    assert pareto_front([]) == []
    assert pareto_front([(float("inf"), 0.0), (1.0, 1.0), (float("nan"), 0.5)]) == [1]


# ---------------------------------------------------------------- objectives on a frontier

MAX_WATTS, N = 100.0, 8   # balanced cost = 0.5 * E + 0.5 * 800 * T


def _fake(t: float, e: float) -> SimpleNamespace:
    return SimpleNamespace(step_time_s=t, energy_per_step_j=e)


# (time s, energy J/step): A fastest; B within 5% and cheaper; C best Zeus cost; D least
# energy; X dominated by C.
HAND = {"A": (1.00, 400.0), "B": (1.04, 380.0), "C": (1.20, 200.0), "D": (2.00, 100.0),
        "X": (1.30, 250.0)}


def _pick(objective: jaxwap.Objective) -> str:
    names = list(HAND)
    scores = objective.scores([_fake(*HAND[n]) for n in names], max_watts=MAX_WATTS,
                              num_devices_available=N)
    return names[min(range(len(names)), key=lambda i: scores[i])]


def test_objectives_pick_different_points_all_on_the_frontier():
    names = list(HAND)
    front = {names[i] for i in pareto_front([HAND[n] for n in names])}
    assert front == {"A", "B", "C", "D"}
    picks = {kind: _pick(obj) for kind, obj in [
        ("throughput", jaxwap.Objective("throughput")),
        ("energy", jaxwap.Objective("energy")),
        ("balanced", jaxwap.Objective("balanced")),
        ("max_slowdown", jaxwap.Objective(max_slowdown=0.05)),
    ]}
    assert picks == {"throughput": "A", "max_slowdown": "B", "balanced": "C", "energy": "D"}
    assert set(picks.values()) <= front


# ---------------------------------------------------------------- a real plan


@pytest.fixture(scope="module")
def small_plan() -> jaxwap.Plan:
    from models import abstract_setup

    step, params, opt, batch = abstract_setup((64, 64, 10), 32, 16)
    return jaxwap.plan(step, params, opt, batch, hardware=jaxwap.Cluster("h100-sxm", 8),
                       verify=0, cache=False)


def test_plan_frontier(small_plan):
    front = small_plan.frontier()
    assert front
    assert all(c.fits for c in front)
    assert all(c in small_plan.candidates for c in front)
    figs = [c.verified or c.predicted for c in front]
    times = [f.step_time_s for f in figs]
    assert times == sorted(times)
    for a, b in zip(figs, figs[1:], strict=False):
        if b.step_time_s > a.step_time_s:
            assert b.energy_per_sample_j < a.energy_per_sample_j
    # no fitting candidate dominates a frontier point
    for c in small_plan.candidates:
        if not c.fits:
            continue
        g = c.verified or c.predicted
        for f in figs:
            assert not (g.step_time_s <= f.step_time_s
                        and g.energy_per_sample_j <= f.energy_per_sample_j
                        and (g.step_time_s, g.energy_per_sample_j)
                        != (f.step_time_s, f.energy_per_sample_j))


def test_plot_frontier_writes_png(small_plan, tmp_path):
    pytest.importorskip("matplotlib")
    out = small_plan.plot_frontier(tmp_path / "f.png")
    assert out == tmp_path / "f.png"
    assert out.read_bytes()[:4] == b"\x89PNG"
