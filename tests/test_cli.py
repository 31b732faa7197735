"""The command line, `python -m jaxwap` (the `jaxwap` console script's entry point too).

The commands run in subprocesses, as a user runs them: from the repository root, with 8
simulated CPU devices, planning examples/plan_module.py's Llama-3-8B-shaped step for a
described cluster of 512 H100s (analytic, a few seconds). Bad input is checked in this
process through `jaxwap.cli.main.main`, which exits the way the command does (argparse's
error, status 2), and once end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import pytest

import jaxwap
from jaxwap.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ["--hardware", "h100-sxm", "--devices", "512", "--devices-per-node", "8",
           "--inter-node-bandwidth", "50e9", "--objective", "balanced"]


def jaxwap_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return subprocess.run([sys.executable, "-m", "jaxwap", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp("cli") / "plan.json"
    return jaxwap_cmd("plan", "examples.plan_module:llama_step", *CLUSTER,
                      "--json", str(path)), path


def test_help_lists_every_command() -> None:
    r = jaxwap_cmd("--help")
    assert r.returncode == 0, r.stderr
    for command in ("calibrate", "plan", "explain"):
        assert command in r.stdout


def test_plan_prints_explain_and_saves_the_plan(planned: tuple[Any, Path]) -> None:
    r, path = planned
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("jaxwap plan: ")
    assert "512 x h100-sxm" in r.stdout and "64 nodes of 8" in r.stdout
    assert "candidates (every mesh considered" in r.stdout
    plan = jaxwap.Plan.from_json(path.read_text())
    assert plan.hardware.num_devices == 512
    assert plan.hardware.devices_per_node == 8
    assert plan.hardware.inter_node_bandwidth == 50e9
    assert plan.objective.kind == "balanced"
    assert 1 <= plan.num_devices <= 512
    assert len(plan.params) == 12          # embed, 9 stacked block params, norm, head


def test_explain_prints_the_saved_plan(planned: tuple[Any, Path]) -> None:
    r, path = planned
    assert r.returncode == 0, r.stderr
    e = jaxwap_cmd("explain", str(path))
    assert e.returncode == 0, e.stderr
    # the saved plan leaves out the run's own planning times (Plan.to_json), so that line
    # differs, and `plan` also says where it saved the plan
    differs = ("planning time:", "saved:")
    same = lambda text: [ln for ln in text.splitlines() if not ln.startswith(differs)]  # noqa: E731
    assert same(e.stdout) == same(r.stdout)


def test_bad_hardware_exits_2_naming_the_argument() -> None:
    r = jaxwap_cmd("plan", "examples.plan_module:llama_step", "--hardware", "h999",
                   "--devices", "8")
    assert r.returncode == 2
    assert "argument --hardware" in r.stderr and "h999" in r.stderr
    assert "Traceback" not in r.stderr


BAD = {
    "zero devices": (["--hardware", "h100-sxm", "--devices", "0"], "argument --devices"),
    "partial nodes": (["--hardware", "h100-sxm", "--devices", "16", "--devices-per-node",
                       "6"], "argument --devices-per-node"),
    "no device count": (["--hardware", "h100-sxm"], "argument --hardware"),
    "count without hardware": (["--devices", "8"], "argument --devices"),
    "unknown objective": (["--objective", "fastest"], "argument --objective"),
    "bad budget": (["--memory-budget", "lots"], "argument --memory-budget"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_options_exit_2(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv, named = BAD[case]
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "examples.plan_module:tiny_llama_step", *argv])
    assert e.value.code == 2
    assert named in capsys.readouterr().err


TARGETS = {
    "not importable": ("no_such_module_xyz:step", "cannot import module"),
    "no colon": ("examples.plan_module", "expected MODULE:FUNCTION"),
    "missing function": ("{path}:nope", "has no attribute 'nope'"),
    "three-tuple": ("{path}:three", "must return (step, example_args)"),
    "args not a tuple": ("{path}:args_dict", "tuple of the step's arguments"),
    "raises": ("{path}:fails", "raised RuntimeError: boom"),
}


@pytest.mark.parametrize("case", sorted(TARGETS))
def test_bad_target_exits_2(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))   # loading by path prepends its dir
    monkeypatch.chdir(ROOT)
    module = tmp_path / "targets.py"
    module.write_text("def three():\n    return 1, 2, 3\n"
                      "def args_dict():\n    return print, {'x': 1}\n"
                      "def fails():\n    raise RuntimeError('boom')\n")
    target, message = TARGETS[case]
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", target.format(path=module), "--hardware", "h100-sxm",
                  "--devices", "8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument MODULE:FUNCTION" in err and message in err


def test_target_by_path_is_abstract(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    step, args = cli.load_target(str(ROOT / "examples" / "plan_module.py") + ":tiny_llama_step")
    assert callable(step) and len(args) == 3
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(args))


def test_explain_of_a_file_that_is_no_plan(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as e:
        cli.main(["explain", str(bad)])
    assert e.value.code == 2
    assert "argument PLAN_JSON" in capsys.readouterr().err


def test_calibrate_main_keeps_its_own_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    """tests/calibrate_worker.py runs `jaxwap.cli.calibrate.main(["calibrate", ...])`."""
    from jaxwap.cli.calibrate import main

    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--coordinator", "localhost:1"])
    assert e.value.code == 2
    assert "go together" in capsys.readouterr().err


def test_ctrl_c_in_calibrate_ends_with_one_line_and_exit_130(tmp_path: Path) -> None:
    """A real Ctrl-C (SIGINT) while `jaxwap calibrate` measures, once its progress line is
    on screen: one line says what was interrupted and that nothing was saved, no
    traceback, exit status 130, and the cache holds no calibration."""
    import signal
    import time

    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXWAP_CACHE_DIR=str(tmp_path),
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    # `python -m jaxwap calibrate ...` with SIGINT handled and unblocked, as a terminal's
    # shell starts a command, whatever this test process passes on through exec (a
    # blocked or ignored SIGINT is inherited; Python keeps an ignored one ignored)
    as_a_shell_starts_it = (
        "import runpy, signal, sys; "
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
        "signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['jaxwap', 'calibrate', '--quick', '--no-power-limits']; "
        "runpy.run_module('jaxwap', run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen([sys.executable, "-c", as_a_shell_starts_it], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    seen = ""
    deadline = time.monotonic() + 240
    while "jaxwap calibrate [" not in seen and time.monotonic() < deadline:
        char = proc.stderr.read(1)       # the progress line has no newline until it ends
        if not char:
            break
        seen += char
    assert "jaxwap calibrate [" in seen, seen
    status = Path(f"/proc/{proc.pid}/status")
    masks = ([line for line in status.read_text().splitlines() if line.startswith("Sig")]
             if status.exists() else [])
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = seen + err
    assert proc.returncode == 130, (masks, err)
    assert "Traceback" not in err
    assert err.rstrip().splitlines()[-1] == ("jaxwap calibrate: interrupted; nothing was "
                                             "saved (a calibration is written once complete)")
    assert not list(tmp_path.rglob("*.json")), list(tmp_path.rglob("*"))


def test_ctrl_c_in_a_first_calls_planning_says_so_and_propagates(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Inside a user's program the interrupt stays the program's (a library does not exit
    its caller's process): one line says what was interrupted and that nothing was
    cached, and the KeyboardInterrupt goes on (simulated: planning raises it)."""
    from models import abstract_setup

    from jaxwap import api

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "make_plan", interrupted)
    step, params, opt, batch = abstract_setup((16, 8, 4), 16, 8)
    with pytest.raises(KeyboardInterrupt):
        jaxwap.auto_shard(step).plan_for(params, opt, batch)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"jaxwap: planning {step.__name__}: interrupted; no plan was cached"


def _interrupted_in_c() -> SystemError:
    """What a Ctrl-C that lands in a Python callback of C code leaves: CPython reports a
    SystemError ("returned a result with an exception set") caused by the
    KeyboardInterrupt (`_PyErr_FormatFromCause`), as a clean clone's CI run saw inside
    numpy asking for a jax dtype."""
    e = SystemError("<function _ScalarMeta.__numpy_dtype__> returned a result with an "
                    "exception set")
    e.__cause__ = KeyboardInterrupt()
    return e


def test_an_interrupt_reported_by_c_code_is_still_ctrl_c(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`jaxwap calibrate` ended by such an error says its one line and exits 130; any
    other SystemError, and one whose chain loops, is not taken for an interrupt."""
    import argparse

    from jaxwap.cli.calibrate import run_command
    from jaxwap.core.progress import from_interrupt

    def run(args: argparse.Namespace) -> int:
        raise _interrupted_in_c()

    code = run_command(argparse.Namespace(command="calibrate", run=run))
    assert code == 130
    assert capsys.readouterr().err.strip() == ("jaxwap calibrate: interrupted; nothing was "
                                               "saved (a calibration is written once complete)")
    other = SystemError("not an interrupt")
    assert not from_interrupt(other)
    loop_a, loop_b = ValueError("a"), ValueError("b")
    loop_a.__context__, loop_b.__context__ = loop_b, loop_a
    assert not from_interrupt(loop_a)

    def fails(args: argparse.Namespace) -> int:
        raise other

    with pytest.raises(SystemError, match="not an interrupt"):
        run_command(argparse.Namespace(command="calibrate", run=fails))
