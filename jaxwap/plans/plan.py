"""The `Plan`: jaxwap's product, a frozen and serialisable record of a decision.

It holds the mesh, the devices, the PartitionSpec of every parameter, the predicted
figures, and every candidate considered with why it lost, so that a person can read
(`explain()`), keep (`to_json()`), and compare the decision later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxwap.core.objective import Objective
from jaxwap.core.records import (
    DATA,
    MODEL,
    CompiledFigures,
    Judged,
    Measurement,
    Prediction,
    StepVariant,
    Strategy,
    judge,
)
from jaxwap.core.units import named_mesh
from jaxwap.hardware.cluster import Cluster
from jaxwap.plans.advice import AttentionAdvice

PLAN_FORMAT = 1


class FrozenDict(dict):
    """A dict that cannot change and can be hashed, so a frozen Plan is frozen all through."""

    def _readonly(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a Plan is immutable; build a new one instead")

    __setitem__ = __delitem__ = _readonly  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]
    __ior__ = _readonly  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


def spec_to_json(spec: tuple[Any, ...]) -> list[Any]:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def spec_from_json(entries: list[Any]) -> tuple[Any, ...]:
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


@dataclass(frozen=True)
class ParamPlacement:
    """One parameter's layout: path in the params tree, shape, dtype, spec, strategy.

    `state_spec` is the layout of its optimizer state when that differs from the weight's
    (ZeRO-1: sharded over the data axis), `offload` says that state lives in pinned host
    memory between steps.
    """

    path: tuple[str, ...]
    keystr: str
    shape: tuple[int, ...]
    dtype: str
    spec: tuple[Any, ...]
    strategy: str
    state_spec: tuple[Any, ...] | None = None
    offload: bool = False

    @property
    def partition_spec(self) -> P:
        return P(*self.spec)

    @property
    def layout_of_state(self) -> tuple[Any, ...]:
        return self.spec if self.state_spec is None else self.state_spec

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def families(self) -> frozenset[str]:
        """The `STRATEGY_FAMILIES` this layout combines (`Strategy.families`)."""
        axes = {a for e in self.spec for a in (e if isinstance(e, tuple) else (e,))}
        return Strategy(self.strategy, tuple(self.spec), tp="col" if MODEL in axes else "none",
                        data_sharded=DATA in axes, state_spec=self.state_spec,
                        offload=self.offload).families

    def to_dict(self) -> dict[str, Any]:
        return {"path": list(self.path), "keystr": self.keystr, "shape": list(self.shape),
                "dtype": self.dtype, "spec": spec_to_json(self.spec), "strategy": self.strategy,
                "state_spec": None if self.state_spec is None else spec_to_json(self.state_spec),
                "offload": self.offload}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParamPlacement:
        state = d.get("state_spec")
        return cls(tuple(d["path"]), d["keystr"], tuple(d["shape"]), d["dtype"],
                   spec_from_json(d["spec"]), d["strategy"],
                   None if state is None else spec_from_json(state), bool(d.get("offload")))


@dataclass(frozen=True)
class Candidate:
    """One mesh considered: its best assignment's prediction and the verdict."""

    mesh_shape: tuple[tuple[str, int], ...]
    predicted: Prediction
    score: float
    fits: bool
    chosen: bool
    reason: str
    strategy_counts: tuple[tuple[str, int], ...]
    compiled: CompiledFigures | None = None   # XLA's figures, when verified
    verified: Prediction | None = None        # the model fed those figures
    variant: str = "planner"                  # or "data-parallel", the baseline layout
    measured: Measurement | None = None       # what it did on the devices (measure=)
    of: int | None = None   # a power-limited point: the index of the candidate it caps

    @property
    def power_limit_w(self) -> float | None:
        """The power limit per device the figures are for (None: the board default)."""
        return self.predicted.power_limit_w

    @property
    def judged(self) -> Judged:
        """The figures this candidate is judged on: measured, else compiled, else predicted."""
        return judge(self.predicted, self.verified, self.measured)

    @property
    def label(self) -> str:
        """Its mesh, axes named (size-1 axes left out), its variant, its power limit."""
        shape = named_mesh((a, s) for a, s in self.mesh_shape if s > 1)
        shape = shape if self.variant == "planner" else f"{shape} dp"
        w = self.power_limit_w
        return shape if w is None else f"{shape} @{w:.0f}W"

    @property
    def num_devices(self) -> int:
        n = 1
        for _, s in self.mesh_shape:
            n *= s
        return n

    def to_dict(self) -> dict[str, Any]:
        return {"mesh_shape": [list(x) for x in self.mesh_shape],
                "predicted": self.predicted.to_dict(),
                "score": self.score if self.score != float("inf") else None,
                "fits": self.fits, "chosen": self.chosen, "reason": self.reason,
                "strategy_counts": [list(x) for x in self.strategy_counts],
                "compiled": self.compiled.to_dict() if self.compiled else None,
                "verified": self.verified.to_dict() if self.verified else None,
                "variant": self.variant,
                "measured": self.measured.to_dict() if self.measured else None,
                "of": self.of}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        return cls(tuple((a, int(s)) for a, s in d["mesh_shape"]),
                   Prediction.from_dict(d["predicted"]),
                   float("inf") if d["score"] is None else d["score"], d["fits"],
                   d["chosen"], d["reason"], tuple((a, int(c)) for a, c in d["strategy_counts"]),
                   _opt(CompiledFigures, d.get("compiled")), _opt(Prediction, d.get("verified")),
                   d.get("variant", "planner"), _opt(Measurement, d.get("measured")),
                   d.get("of"))


@dataclass(frozen=True)
class Plan:
    """How a training step is sharded, and why.

    `param_specs` is a pytree of `PartitionSpec` shaped like the params (a nested dict
    keyed by path tokens for a plan loaded from JSON, which has no treedef).
    """

    mesh_shape: dict[str, int]
    device_ids: tuple[int, ...]
    params: tuple[ParamPlacement, ...]
    objective: Objective
    predicted: Prediction
    candidates: tuple[Candidate, ...]
    hardware: Cluster
    batch_size: int | None
    memory_budget_bytes: float
    planning_time_s: dict[str, float] = field(compare=False)   # a timing, not the plan
    notes: tuple[str, ...] = ()
    version: str = ""
    compiled: CompiledFigures | None = None   # XLA's per-device figures for this plan
    verified: Prediction | None = None        # the model fed XLA's figures (what chose it)
    measured: Measurement | None = None       # what it did on the devices (measure=)
    # how a `make_train_step` step was restructured to fit (micro-batches, remat)
    step: StepVariant = field(default_factory=StepVariant)
    # where the step materializes attention scores that take a large share of it: their
    # figures and the fused kernel's (predicted, `attention_advice.attention_advice`)
    attention: AttentionAdvice | None = None
    _treedef: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh_shape", FrozenDict(self.mesh_shape))
        object.__setattr__(self, "planning_time_s", FrozenDict(self.planning_time_s))

    # ------------------------------------------------------------------ views
    @property
    def num_devices(self) -> int:
        n = 1
        for s in self.mesh_shape.values():
            n *= s
        return n

    @property
    def param_specs(self) -> Any:
        specs = [p.partition_spec for p in self.params]
        if self._treedef is not None:
            return jax.tree_util.tree_unflatten(self._treedef, specs)
        if len(self.params) == 1 and not self.params[0].path:
            return specs[0]
        tree: dict[str, Any] = {}
        for p, s in zip(self.params, specs, strict=True):
            node = tree
            for tok in p.path[:-1]:
                node = node.setdefault(tok, {})
            node[p.path[-1]] = s
        return tree

    @property
    def power_limit_w(self) -> float | None:
        """The power limit per device the plan chose (None: the board default). It is a
        recommendation unless `auto_shard(..., power_limit="apply")` sets it."""
        return self.predicted.power_limit_w

    # ------------------------------------------------------------------ frontier
    def frontier(self) -> tuple[Candidate, ...]:
        """The fitting candidates on the Pareto frontier of step time vs energy per sample
        (each judged on `Candidate.judged`: measured, else compiled, else predicted),
        fastest first."""
        from jaxwap.plans.frontier import frontier

        return frontier(self.candidates)

    def plot_frontier(self, path: str | Path) -> Path:
        """Draw the candidates and the frontier, chosen point marked, as a PNG at `path`.
        Needs matplotlib (`pip install jaxwap[plot]`)."""
        from jaxwap.plans.frontier import plot_frontier

        return plot_frontier(self, path)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        d = {
            "format": PLAN_FORMAT, "version": self.version,
            "mesh_shape": dict(self.mesh_shape), "device_ids": list(self.device_ids),
            "params": [p.to_dict() for p in self.params],
            "objective": self.objective.to_dict(), "predicted": self.predicted.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "hardware": self.hardware.to_dict(), "batch_size": self.batch_size,
            "memory_budget_bytes": self.memory_budget_bytes,
            "planning_time_s": dict(self.planning_time_s), "notes": list(self.notes),
            "compiled": self.compiled.to_dict() if self.compiled else None,
            "verified": self.verified.to_dict() if self.verified else None,
            "measured": self.measured.to_dict() if self.measured else None,
            "step": self.step.to_dict(),
        }
        if self.attention is not None:   # (a plan without advice reads as before it)
            d["attention"] = self.attention.to_dict()
        return d

    def to_json(self, indent: int | None = 2, timings: bool = False) -> str:
        """The plan as JSON: the same step planned for the same hardware gives the same
        bytes in any process, so the run's own timings (planning phases, compile times)
        are left out unless `timings` (`to_dict` and the plan cache keep them)."""
        d = self.to_dict()
        if not timings:
            d["planning_time_s"] = {}
            for c in [d["compiled"]] + [c["compiled"] for c in d["candidates"]]:
                if c is not None:
                    c["compile_time_s"] = 0.0
        return json.dumps(d, indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if not isinstance(d, dict):
            raise ValueError(f"a plan is a JSON object, got {type(d).__name__}")
        if d.get("format") != PLAN_FORMAT:
            raise ValueError(f"unsupported plan format {d.get('format')!r} "
                             f"(this jaxwap reads format {PLAN_FORMAT})")
        return cls(
            mesh_shape={k: int(v) for k, v in d["mesh_shape"].items()},
            device_ids=tuple(int(i) for i in d["device_ids"]),
            params=tuple(ParamPlacement.from_dict(p) for p in d["params"]),
            objective=Objective.from_dict(d["objective"]),
            predicted=Prediction.from_dict(d["predicted"]),
            candidates=tuple(Candidate.from_dict(c) for c in d["candidates"]),
            hardware=Cluster.from_dict(d["hardware"]), batch_size=d["batch_size"],
            memory_budget_bytes=d["memory_budget_bytes"],
            planning_time_s=dict(d["planning_time_s"]), notes=tuple(d["notes"]),
            version=d.get("version", ""), compiled=_opt(CompiledFigures, d.get("compiled")),
            verified=_opt(Prediction, d.get("verified")),
            measured=_opt(Measurement, d.get("measured")),
            step=StepVariant.from_dict(d.get("step")),
            attention=_opt(AttentionAdvice, d.get("attention")))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    # ------------------------------------------------------------------ explain
    def explain(self, max_params: int = 40) -> str:
        """A report a person reads: the decision, the layout, the figures, the losers."""
        from jaxwap.plans.explain import explain

        return explain(self, max_params)

    def __str__(self) -> str:
        return self.explain()


def _opt(cls: Any, d: dict[str, Any] | None) -> Any:
    return cls.from_dict(d) if d is not None else None
