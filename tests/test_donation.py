"""Donation made safe and predictable (`step_call.StepCall`).

Passing a step the state it donated (the state from before the last step: an easy slip)
crashed the process on a sharded plan (jax's own dispatch, exit 139) and raised XLA's raw
`INVALID_ARGUMENT` on a one-device plan. The step now refuses it first with a ValueError
that names the argument's path and says to pass the state the last step returned. The
user's initial state is treated alike on every plan: jax arrays are consumed by the first
call (donated in place, or copied onto the mesh and deleted), host arrays never touched.

The checks that pass a step donated arrays run in a process of their own
(`donation_worker.py`), so no test relies on a crash not happening: on a 1-device plan, an
8-device sharded (FSDP) plan, and two processes of 4 devices each. The rest (the initial-
state rule, a repeat at two donated leaves) run here, on arrays that are alive."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import MLP, copy_tree, setup
from processes import run_processes, worker_env

import jaxwap

HERE = Path(__file__).parent
CHECKS = ["host initial state untouched", "jax initial state consumed",
          "donate=False keeps the state", "donated state refused by path",
          "older state refused", "optimizer state refused by path",
          "one array at two donated leaves"]


def _run_worker(mode: str) -> str:
    got = subprocess.run([sys.executable, str(HERE / "donation_worker.py"), mode],
                         env=worker_env(), capture_output=True, text=True, timeout=600)
    out = got.stdout + got.stderr
    assert got.returncode == 0, f"the {mode} worker ended with {got.returncode}:\n{out[-4000:]}"
    return out


@pytest.mark.parametrize("mode", ["one", "eight"])
def test_reused_donated_state_is_refused_by_path_never_a_crash(mode):
    """On a 1-device and an 8-device sharded plan: the state from before the last step,
    from two steps back, optimizer state alone, an array deleted by hand are each refused
    by a ValueError naming the path (`args[0]['params']['Dense_0']['kernel']`) and saying
    to pass the state the last step returned; the step then goes on and its numbers are
    `jax.jit`'s. The initial-state rule holds on both plans."""
    out = _run_worker(mode)
    for check in [*CHECKS, "placed initial state consumed", "deleted array refused by path"]:
        assert f"OK {check}" in out, f"{check!r} missing:\n{out[-4000:]}"
    refusals = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert len(refusals) == 4 and not any("INVALID_ARGUMENT" in r for r in refusals), out
    assert "DONE" in out


def test_under_two_processes_reused_state_is_refused_on_every_process():
    """Two CPU processes (4 devices each, the plan over all 8, each passing its half of the
    batch as numpy): both refuse the donated state by path before anything runs (no
    process is left waiting in a collective), go on with the returned state, and keep the
    initial-state rule (host state untouched, each process's jax copy consumed)."""
    ran = run_processes("donation_worker.py", "two")
    for i, (code, out) in enumerate(ran):
        assert code == 0, f"process {i} ended with {code}:\n{out[-4000:]}"
        for check in CHECKS:
            assert f"process {i}: OK {check}" in out, f"{check!r} missing:\n{out[-4000:]}"
        assert f"process {i}: DONE" in out


def _step(**options):
    step, params, opt, batch = setup(MLP((16, 4)), (8, 8), num_classes=4)
    return step, params, opt, batch, jaxwap.auto_shard(step, params, cache=False, verify=0,
                                                       **options)


PLANS = [{"num_devices": 1}, {"mesh_shape": {"data": 2, "model": 1}},
         {"mesh_shape": {"data": 4, "model": 2}}]


@pytest.mark.parametrize("options", PLANS)
def test_the_first_call_consumes_jax_initial_state_on_every_plan(options):
    """Whatever the plan (one device: the arrays are taken in place; a mesh: copied onto
    it), every jax array the step donates (its state: the parameters, Adam's moments and
    count) is deleted once the first call has run; the batch is kept, and the step is
    jax.jit's."""
    step, params, opt, batch, wrapped = _step(**options)
    want = jax.jit(step)(copy_tree(params), copy_tree(opt), batch)
    got = wrapped(params, opt, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves((params, opt)))
    assert not any(x.is_deleted() for x in jax.tree.leaves(batch))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_host_initial_state_and_donate_false_are_left_alone():
    """numpy state is never touched; with donate=False nothing given is deleted and the
    same state may be passed again."""
    step, params, opt, batch, wrapped = _step(mesh_shape={"data": 2, "model": 1})
    host = jax.tree.map(np.asarray, (params, opt))
    before = jax.tree.map(np.copy, host)
    wrapped(*host, batch)
    jax.tree.map(np.testing.assert_array_equal, before, host)
    kept = jaxwap.auto_shard(step, params, cache=False, verify=0, donate=False,
                             mesh_shape={"data": 2, "model": 1})
    first = kept(params, opt, batch)
    again = kept(params, opt, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves((params, opt)))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_repeated_array_at_donated_leaves_runs_on_a_one_device_plan():
    """The same returned array at two donated leaves (an EMA set to the params mid-run) is
    given a buffer of its own where jax would fail ("donate the same buffer twice"); on
    a one-device plan that is safe to try in this process. The step is jax.jit's."""
    step, params, opt, batch, wrapped = _step(num_devices=1)
    params, opt, _ = wrapped(params, opt, batch)
    adam = opt[0]
    twice = (adam._replace(nu=adam.mu), *opt[1:])
    want = jax.jit(step)(copy_tree(params), jax.tree.map(jnp.copy, twice), batch)
    got = wrapped(params, twice, batch)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_state_the_step_hands_back_is_donated_a_constant_it_returns_untouched_is_not():
    """Beside the parameters and their moments, the step donates what it hands back at the
    same path (Adam's count here, batch statistics in a ResNet), as jax.jit of the state
    arguments does; a constant it returns as it came in (`scale`) is no state and stays
    the user's, to pass again."""
    step, params, opt, batch = setup(MLP((16, 4)), (8, 8), num_classes=4)

    def scaled(params, opt_state, batch, scale):
        p, o, m = step(params, opt_state, batch)
        return p, o, {"loss": m["loss"] * scale[0]}, scale

    scale = jnp.full((3,), 2.0)
    wrapped = jaxwap.auto_shard(scaled, params, cache=False, verify=0, num_devices=1)
    want = jax.jit(scaled)(copy_tree(params), copy_tree(opt), batch, scale)
    p, o, metrics, back = wrapped(params, opt, batch, scale)
    assert opt[0].count.is_deleted() and not scale.is_deleted()
    p, o, metrics, back = wrapped(p, o, batch, scale)     # the same constant again
    assert not scale.is_deleted()
    want = jax.jit(scaled)(*want[:2], batch, scale)
    np.testing.assert_allclose(metrics["loss"], want[2]["loss"], rtol=1e-5)
