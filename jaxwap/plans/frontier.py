"""The time/energy Pareto frontier of a plan's candidates, and a plot of it.

A candidate is on the frontier when no other candidate is at least as fast *and* at least
as frugal (per sample) while strictly better on one of the two. Every objective jaxwap
offers picks a point on it; which one depends on how it weighs time against energy.

Plotting needs matplotlib (`pip install jaxwap[plot]`), imported only when a plot is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxwap.plans.plan import Candidate, Plan


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates, minimising both coordinates.

    Returned ordered by (first, second, index), so along the result the first coordinate
    rises and the second falls. Exact duplicates dominate nothing, so all copies of a point
    on the front are kept (adjacent in the result). Points with a NaN or infinite coordinate
    are left out.
    """
    order = sorted((i for i, (x, y) in enumerate(points)
                    if math.isfinite(x) and math.isfinite(y)),
                   key=lambda i: (points[i][0], points[i][1], i))
    front: list[int] = []
    for i in order:
        x, y = points[i]
        if not front:
            front.append(i)
            continue
        lx, ly = points[front[-1]]
        if (x, y) == (lx, ly) or y < ly:
            # Sorted by x then y: a point is dominated iff some earlier point has y <= its y
            # (and is not an exact copy), and the last front point has the least y so far.
            front.append(i)
    return front


def frontier(candidates: Sequence[Candidate]) -> tuple[Candidate, ...]:
    """The fitting candidates on the (step time, energy per sample) frontier, fastest
    first, each judged on its best figures (`Candidate.judged`: measured, else compiled,
    else predicted). Every candidate of a plan processes the same batch, so energy per
    step orders them as energy per sample does."""
    fitting = [c for c in candidates if c.fits]
    pts = [(c.judged.step_time_s, c.judged.energy_per_step_j) for c in fitting]
    return tuple(fitting[i] for i in pareto_front(pts))


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plotting the frontier needs matplotlib: "
                          "pip install jaxwap[plot]") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_frontier(plan: Plan, path: str | Path) -> Path:
    """Draw the plan's candidates and their frontier to a PNG at `path`; returns the Path.

    x is step time (ms), y energy per sample (mJ). Every candidate is a light point, the
    frontier a line with markers, and the chosen candidate is highlighted and labelled.
    """
    plt = _pyplot()
    path = Path(path)
    front = frontier(plan.candidates)
    chosen = next((c for c in plan.candidates if c.chosen), None)
    basis = chosen.judged.basis if chosen is not None else "predicted"
    batch = plan.batch_size or 1

    def xy(cs: Sequence[Candidate]) -> tuple[list[float], list[float]]:
        return ([c.judged.step_time_s * 1e3 for c in cs],
                [c.judged.energy_per_step_j / batch * 1e3 for c in cs])

    fig, ax = plt.subplots(figsize=(7, 5), dpi=100)
    try:
        fit = [c for c in plan.candidates if c.fits]
        unfit = [c for c in plan.candidates if not c.fits]
        if fit:
            ax.scatter(*xy(fit), s=18, color="tab:blue", alpha=0.3, label="candidates")
        if unfit:
            ax.scatter(*xy(unfit), s=18, color="tab:gray", alpha=0.3, marker="x",
                       label="do not fit in memory")
        if front:
            ax.plot(*xy(front), "-o", color="tab:blue", markersize=5, label="Pareto frontier")
        if chosen is not None:
            (cx,), (cy,) = xy([chosen])
            ax.scatter([cx], [cy], s=140, color="tab:red", marker="*", zorder=5,
                       label="chosen")
            ax.annotate(chosen.label, (cx, cy), textcoords="offset points", xytext=(8, 8),
                        color="tab:red")
        ax.set_xlabel(f"step time (ms, {basis})")
        ax.set_ylabel(f"energy per sample (mJ, {basis})")
        ax.set_title(f"jaxwap candidates, objective: {plan.objective.describe()}")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path
