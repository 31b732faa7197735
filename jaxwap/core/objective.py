"""What "best" means: the objective that ranks candidate plans.

Fast and frugal pull against each other: more devices usually cut step time but each
one draws power, and past some point communication eats the gain. The objective turns a
candidate's predicted time and energy into one score (lower is better).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

KINDS = ("throughput", "energy", "balanced", "max_slowdown")
# what `objective=` accepts as a string: a name, or max_slowdown with its number
_FORMS = "'throughput', 'energy', 'balanced', 'max_slowdown=X' (e.g. 'max_slowdown=0.05')"


class _Scored(Protocol):
    step_time_s: float
    energy_per_step_j: float
    num_devices: int


@dataclass(frozen=True)
class Ranking:
    """The objective's verdict on a list of candidates: one score each (inf where not
    eligible or excluded) and the index of the best (-1 when none is eligible)."""

    scores: tuple[float, ...]
    best: int


@dataclass(frozen=True)
class Objective:
    """How candidates are ranked.

    - "throughput": least step time.
    - "energy": least energy per step (the batch is fixed, so also per sample).
    - "balanced": Zeus's cost eta*E + (1-eta)*P_max*N*T, with N the devices available
      to the job: time is charged at the whole allocation's peak power, so using fewer
      devices is only rewarded when it does not stretch the step much.
    - `Objective(max_slowdown=x)`: least energy among candidates within (1+x) of the
      fastest candidate's step time.
    """

    kind: str = "balanced"
    eta: float = 0.5
    max_slowdown: float | None = None

    def __post_init__(self) -> None:
        if self.max_slowdown is not None:
            if self.kind not in ("balanced", "max_slowdown"):
                raise ValueError(f"Objective(kind={self.kind!r}) does not take max_slowdown")
            if not self.max_slowdown >= 0:
                raise ValueError(f"Objective max_slowdown must be >= 0, got {self.max_slowdown!r}")
            object.__setattr__(self, "kind", "max_slowdown")
        if self.kind not in KINDS:
            raise ValueError(f"objective must be {_FORMS} or jaxwap.Objective(...), got "
                             f"{self.kind!r}")
        if self.kind == "max_slowdown" and self.max_slowdown is None:
            raise ValueError("objective 'max_slowdown' needs its number: 'max_slowdown=0.05' "
                             "or jaxwap.Objective(max_slowdown=0.05) (least energy within 5% "
                             "of the fastest step)")
        if not 0.0 <= self.eta <= 1.0:
            raise ValueError(f"Objective eta must be in [0, 1], got {self.eta!r}")

    @classmethod
    def parse(cls, objective: str | Objective) -> Objective:
        """An `Objective` from itself or a string: a kind's name, or "max_slowdown=X"
        (the command line's form of `Objective(max_slowdown=X)`)."""
        if isinstance(objective, Objective):
            return objective
        if isinstance(objective, str):
            name, eq, value = objective.partition("=")
            if not eq:
                return cls(kind=objective)
            if name.strip() != "max_slowdown":
                raise ValueError(f"objective must be {_FORMS} or jaxwap.Objective(...), "
                                 f"got {objective!r}")
            try:
                slowdown = float(value)
            except ValueError:
                raise ValueError(f"objective {objective!r}: {value!r} is not a number") \
                    from None
            return cls(max_slowdown=slowdown)
        raise TypeError(f"objective must be {_FORMS} or jaxwap.Objective(...), got "
                        f"{type(objective).__name__}")

    def scores(self, preds: Sequence[_Scored], *, max_watts: float,
               num_devices_available: int) -> list[float]:
        """One score per prediction (lower is better); inf where the objective excludes it."""
        if not preds:
            return []
        if self.kind == "throughput":
            return [p.step_time_s for p in preds]
        if self.kind == "energy":
            return [p.energy_per_step_j for p in preds]
        if self.kind == "balanced":
            return [self.eta * p.energy_per_step_j
                    + (1 - self.eta) * max_watts * num_devices_available * p.step_time_s
                    for p in preds]
        fastest = min(p.step_time_s for p in preds)
        limit = fastest * (1 + float(self.max_slowdown or 0.0)) * (1 + 1e-12)
        return [p.energy_per_step_j if p.step_time_s <= limit else float("inf")
                for p in preds]

    def rank(self, figures: Sequence[_Scored | None], *, max_watts: float,
             num_devices_available: int) -> Ranking:
        """The one ranking of candidates: score the eligible ones (None is not eligible)
        together, and pick the lowest score, then the least step time, then the fewest
        devices, then the first listed. Search, verification and measured choice all
        rank with this, each on the figures that judge its candidates."""
        idx = [i for i, f in enumerate(figures) if f is not None]
        got = self.scores([figures[i] for i in idx], max_watts=max_watts,
                          num_devices_available=num_devices_available)
        scores = [float("inf")] * len(figures)
        for i, s in zip(idx, got, strict=True):
            scores[i] = s
        best = min(idx, key=lambda i: (scores[i], figures[i].step_time_s,
                                       figures[i].num_devices, i), default=-1)
        return Ranking(tuple(scores), best)

    def describe(self) -> str:
        if self.kind == "balanced":
            return f"balanced (Zeus cost, eta={self.eta:g})"
        if self.kind == "max_slowdown":
            return f"least energy within {100 * float(self.max_slowdown or 0):g}% of the fastest"
        return self.kind

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "eta": self.eta, "max_slowdown": self.max_slowdown}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Objective:
        return cls(kind=d["kind"], eta=d["eta"], max_slowdown=d["max_slowdown"])
