"""The time/energy Pareto frontier: the pure function, the objectives' picks on it, a plan's."""

from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

import jaxwap
from jaxwap.plans.frontier import pareto_front

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

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


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHOSEN_RED = (0xD6 / 255, 0x27 / 255, 0x28 / 255)   # matplotlib's "tab:red", the chosen star


def assert_real_png(path: Path) -> np.ndarray:
    """`path` is a PNG with the 8-byte signature, an IHDR chunk first with a positive size,
    that matplotlib decodes to that size; returns the RGBA pixels."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert (length, kind) == (13, b"IHDR")
    width, height = struct.unpack(">II", data[16:24])
    assert width > 0 and height > 0
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (height, width)
    return pixels


def has_color(pixels: np.ndarray, rgb: tuple[float, float, float], tol: float = 0.02) -> bool:
    return bool((np.abs(pixels[..., :3] - np.asarray(rgb)) <= tol).all(axis=-1).any())


def test_plot_frontier_writes_a_png_of_the_candidates_with_the_choice_marked(small_plan,
                                                                           tmp_path):
    pytest.importorskip("matplotlib")
    out = small_plan.plot_frontier(tmp_path / "f.png")
    assert out == tmp_path / "f.png"
    pixels = assert_real_png(out)
    # drawn, not blank: the 7 x 5 inch figure at 100 dpi, many colours, the chosen star
    assert pixels.shape[:2] == (500, 700)
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 10
    assert sum(c.chosen for c in small_plan.candidates) == 1
    assert has_color(pixels, CHOSEN_RED)


def _example_common():
    """examples/common.py, imported as zoo.py does (under a private name, so that it cannot
    shadow tests/models.py): it imports no jax at module level."""
    name = "_jaxwap_examples_common"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / "common.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_example_frontier_flag_plots_the_plan_it_trained_with(tmp_path, monkeypatch, capsys):
    """`examples/alexnet_flax.py --auto --frontier PATH ...` is `common.main(AlexNet, argv)`:
    run here in this process with CI-sized flags (1 step, batch 8, 32 px) and two changes
    that keep it to seconds: a small Linen CNN in AlexNet's place (AlexNet's 21.6 M
    parameters take ~20 s to initialise and compile on this CPU) and analytic planning
    (verify=0: the command line cannot ask for it, and compiling the finalists costs ~25 s).
    Flags, planning, the training loop, the printed frontier and the plot are the example's."""
    import flax.linen as nn

    pytest.importorskip("matplotlib")

    class SmallNet(nn.Module):       # what common.main needs: num_classes, dtype, NHWC in
        num_classes: int = 10
        dtype: object = jnp.float32

        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(8, (3, 3), strides=(2, 2), dtype=self.dtype)(x))
            return nn.Dense(self.num_classes, dtype=self.dtype)(x.mean(axis=(1, 2)))

    common = _example_common()
    monkeypatch.setattr(common, "_platform", "cpu")      # the CPU defaults, no device set-up
    plain = jaxwap.auto_shard
    monkeypatch.setattr(jaxwap, "auto_shard",
                        lambda *a, **kw: plain(*a, **{**kw, "verify": 0, "cache": False}))
    path = tmp_path / "frontier.png"
    stats = common.main(SmallNet, name="SmallNet", cpu_image_size=32, argv=[
        "--auto", "--frontier", str(path), "--steps", "1", "--batch-size", "8",
        "--image-size", "32", "--num-classes", "10", "--dtype", "float32",
        "--hardware", "h100-sxm"])
    printed = capsys.readouterr().out
    assert np.isfinite(stats["losses"]).all()
    assert "Pareto frontier" in printed and f"frontier plot written to {path}" in printed
    assert_real_png(path)
    # --frontier without --auto is refused
    with pytest.raises(SystemExit):
        common.parse_args("x", cpu_image_size=32, argv=["--frontier", str(path)])
