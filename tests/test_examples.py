"""The examples the README lists run from their command lines, CI-sized: `make run`'s
own command (read from the Makefile, so the test follows it), VGG-16 planned as if on
8 H100s, and the checkpoint restored across plans. Each runs in a fresh interpreter,
which sets up its own 8 simulated devices before jax starts, as a user's would.

CI-sized means the examples' own options (`--batch-size`, `--steps`, `--num-classes`),
nothing the user could not type: what is checked is that the command works end to end
(a plan printed, every step run, a finite loss, the summary line), not the model's
accuracy.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from processes import FAST_COMPILE

ROOT = Path(__file__).resolve().parent.parent
CI_SIZED = ["--batch-size", "16", "--steps", "2", "--num-classes", "10"]


def _run(argv: list[str], tmp_path: Path) -> str:
    """The command in a fresh interpreter, from the repository root, with its own plan
    cache; the simulated devices are left to the example (it adds them to XLA_FLAGS), which
    holds only `FAST_COMPILE` (these runs are not timed)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXWAP_CACHE_DIR=str(tmp_path / "cache"),
               XLA_FLAGS=FAST_COMPILE)
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout


def _make_run_command() -> list[str]:
    """The `run` target's command line, `$(PY)` as this interpreter."""
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^run:.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "the Makefile has no run target"
    (line,) = [ln.strip() for ln in recipe.group(1).splitlines()]
    argv = shlex.split(line)
    assert argv[0] == "$(PY)", line
    return [sys.executable, *argv[1:]]


def _summary_losses(out: str, name: str, mode: str, steps: int) -> tuple[float, float]:
    m = re.search(rf"^summary: {re.escape(name)} {mode} \| loss (\S+) -> (\S+) over "
                  rf"{steps} steps", out, re.M)
    assert m, out[-2000:]
    first, last = float(m.group(1)), float(m.group(2))
    assert math.isfinite(first) and math.isfinite(last)
    return first, last


def test_make_run_command_plans_and_trains_alexnet_as_plain_jit_does(tmp_path: Path) -> None:
    argv = _make_run_command()
    assert argv[1:] == ["examples/alexnet_flax.py", "--auto"]   # what the README says
    out = _run(argv + CI_SIZED, tmp_path)
    assert "jaxwap plan: " in out and "candidates (every mesh considered):" in out
    assert re.search(r"^step +2/2 +loss", out, re.M), out[-2000:]
    auto = _summary_losses(out, "AlexNet", "auto_shard", 2)
    # the README's second line: the same step under plain jax.jit on one device, the same
    # data and seed, gives the same losses (printed to 4 decimals)
    plain = _run([sys.executable, "examples/alexnet_flax.py", *CI_SIZED], tmp_path)
    assert "jaxwap plan: " not in plain
    assert auto == pytest.approx(_summary_losses(plain, "AlexNet", "jit", 2), abs=2e-4)


def test_vgg16_example_plans_for_h100s_and_trains_here(tmp_path: Path) -> None:
    # one finalist compiled (`make run`'s test compiles the default three)
    out = _run([sys.executable, "examples/vgg16_flax.py", "--auto", "--hardware", "h100-sxm",
                "--verify", "1", *CI_SIZED], tmp_path)
    assert "jaxwap plan: " in out and "h100-sxm" in out
    assert re.search(r"verify \d+ ms", out), out[-2000:]   # XLA compiled a finalist
    _summary_losses(out, "VGG-16", "auto_shard", 2)


def test_checkpoint_example_resumes_on_another_plan_as_if_uninterrupted(tmp_path: Path
                                                                        ) -> None:
    out = _run([sys.executable, "examples/checkpoint_replan.py", "--steps", "1",
                "--ckpt-dir", str(tmp_path / "ckpt")], tmp_path)
    m = re.search(r"largest relative loss difference (\S+)", out)
    assert m, out[-2000:]
    assert float(m.group(1)) <= 1e-5   # float32 rounding at most, as it prints
