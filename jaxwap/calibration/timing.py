"""How a calibration probe is timed: the median of calls, or the cost an op adds in a program.

Every probe is a timing, and how it is taken decides what it means. `time_it` is a call's
median after a warm-up; `in_program` (and `in_programs`, several in rounds) is what one
more repetition of an op adds inside one compiled program, which is what an op costs in a
training step (its own call would also pay the dispatch); `in_place` runs an update on
donated state, as a step does. `operand` makes operands whose products keep their scale,
`repeated` the dependent chains `in_program` times, and `fit_line` the least-squares fits
the probes turn timings into figures with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


# --------------------------------------------------------------------------- calls and fits
def time_it(fn: Callable[[], Any], repeats: int = 5, times: list[float] | None = None) -> float:
    """Median seconds of fn() after one warm-up call (fn must block until done); `times`,
    when given, receives every timing."""
    fn()
    times = [] if times is None else times
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def fit_line(x: Sequence[float], y: Sequence[float],
              relative: bool = False) -> tuple[float, float]:
    """Least-squares slope and intercept (intercept clipped at 0). `relative` weighs each
    point by 1/y, so a small (latency-bound) point counts as much as a large one."""
    ys = np.asarray(y, float)
    w = 1.0 / np.maximum(ys, 1e-12) if relative else None
    slope, intercept = np.polyfit(np.asarray(x, float), ys, 1, w=w)
    return float(slope), float(max(intercept, 0.0))


# --------------------------------------------------------------------------- in a program
def in_program(make: Callable[[int], Callable[..., Any]], args: Sequence[Any],
               reps: int, repeats: int = 7) -> float:
    """Seconds one repetition of an op takes inside a compiled program: `make(r)` builds a
    function that applies the op r times in a dependent chain, and the difference between
    r = reps + 1 and r = 1, over reps, is what each repetition adds. A training step runs
    its ops back to back inside one program, so this, not the time of a call of its own,
    is what an op costs there: a call of its own also pays the dispatch and the wake-up
    of the host's thread pool (about 50 us each on a 2-core CPU, far more than a small
    matmul). The two are timed in turn, not one after the other, so the machine's drift
    falls on both alike (`benchmarks/accuracy/calibration_spread.py`)."""
    return in_programs([(make, args, reps)], repeats)[0]


def in_programs(chains: Sequence[tuple[Callable[[int], Callable[..., Any]], Sequence[Any], int]],
                repeats: int = 7) -> list[float]:
    """`in_program` of several (make, args, reps) at once, every chain timed once in each
    of `repeats` rounds: a spell of the machine's drift falls on all of them alike, not on
    whichever was being timed (on this project's 2-core VM, dense layers timed size by
    size read 1.15-1.96x apart at one size across 12 curves in 3 processes, 1.10-1.36x
    timed in rounds: `benchmarks/accuracy/calibration_spread.py --dense`)."""
    progs = [(jax.jit(make(1)), jax.jit(make(reps + 1)), args, reps)
             for make, args, reps in chains]
    t1: list[list[float]] = [[] for _ in progs]
    tr: list[list[float]] = [[] for _ in progs]
    for _ in range(repeats):
        for i, (one, many, args, _) in enumerate(progs):
            time_it(lambda one=one, args=args: jax.block_until_ready(one(*args)), 1, t1[i])
            time_it(lambda many=many, args=args: jax.block_until_ready(many(*args)), 1, tr[i])
    return [max((float(np.median(b)) - float(np.median(a))) / reps, 1e-9)
            for a, b, (_, _, _, reps) in zip(t1, tr, progs, strict=True)]


def operand(device: Any, shape: tuple[int, ...], dtype: Any, fan_in: float = 1.0) -> Any:
    """A probe's operand whose products keep their scale: on a CPU the constant 1/fan_in
    (its speed does not depend on the data; the CPU figures in benchmarks/results were
    measured so), on an accelerator N(0, 1/fan_in): a GPU's matmul runs faster and draws
    less power on predictable data (13% faster on zeros on an H200 here), so its rate and
    power are measured on data like a training step's."""
    if device.platform == "cpu":
        return jax.device_put(jnp.full(shape, 1.0 / fan_in, dtype), device)
    with jax.default_device(device):
        return jax.random.normal(jax.random.key(0), shape, dtype) * (fan_in ** -0.5)



def repeated(link: Callable[..., Any]) -> Callable[[int], Callable[..., Any]]:
    """`make(k)` for `in_program`: a function of (v, *rest) that applies `v = link(v,
    *rest)` k times, each link depending on the one before."""
    def make(k: int) -> Callable[..., Any]:
        def f(v: Any, *rest: Any) -> Any:
            for _ in range(k):
                v = link(v, *rest)
            return v
        return f
    return make


def in_place(fn: Callable[..., Any], first: Any, *rest: Any, repeats: int = 5) -> float:
    """Seconds of `fn(first, *rest)` run as a training step runs its donated state: the
    last result is the next call's `first`, donated, so the output takes its memory
    (median of `repeats` calls)."""
    f = jax.jit(fn, donate_argnums=0)
    box = [f(first, *rest)]

    def step() -> None:
        box[0] = f(box[0], *rest)
        box[0].block_until_ready()

    return time_it(step, repeats)


__all__ = ["fit_line", "in_place", "in_program", "in_programs", "operand", "repeated", "time_it"]
