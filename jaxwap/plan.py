"""The `Plan`: jaxwap's product, a frozen and serialisable record of a decision.

It holds the mesh, the devices, the PartitionSpec of every parameter, the predicted
figures, and every candidate considered with why it lost, so that a person can read
(`explain()`), keep (`to_json()`), and compare the decision later.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from .hardware import Cluster
from .objective import Objective
from .records import (
    COMPILED,
    DATA,
    MEASURED,
    MODEL,
    REPLICA,
    STAGE,
    CompiledFigures,
    Judged,
    Measurement,
    Prediction,
    StepVariant,
    judge,
    mesh_dims,
    mesh_stages,
)
from .units import si

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

    @property
    def judged(self) -> Judged:
        """The figures this candidate is judged on: measured, else compiled, else predicted."""
        return judge(self.predicted, self.verified, self.measured)

    @property
    def label(self) -> str:
        shape = "x".join(str(s) for _, s in self.mesh_shape)
        return shape if self.variant == "planner" else f"{shape} dp"

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
                "measured": self.measured.to_dict() if self.measured else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        return cls(tuple((a, int(s)) for a, s in d["mesh_shape"]),
                   Prediction.from_dict(d["predicted"]),
                   float("inf") if d["score"] is None else d["score"], d["fits"],
                   d["chosen"], d["reason"], tuple((a, int(c)) for a, c in d["strategy_counts"]),
                   _opt(CompiledFigures, d.get("compiled")), _opt(Prediction, d.get("verified")),
                   d.get("variant", "planner"), _opt(Measurement, d.get("measured")))


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

    # ------------------------------------------------------------------ frontier
    def frontier(self) -> tuple[Candidate, ...]:
        """The fitting candidates on the Pareto frontier of step time vs energy per sample
        (each judged on `Candidate.judged`: measured, else compiled, else predicted),
        fastest first."""
        from .frontier import frontier

        return frontier(self.candidates)

    def plot_frontier(self, path: str | Path) -> Path:
        """Draw the candidates and the frontier, chosen point marked, as a PNG at `path`.
        Needs matplotlib (`pip install jaxwap[plot]`)."""
        from .frontier import plot_frontier

        return plot_frontier(self, path)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
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
            step=StepVariant.from_dict(d.get("step")))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    # ------------------------------------------------------------------ explain
    def _memory_summary(self) -> str:
        zero1 = sum(1 for p in self.params if p.state_spec is not None)
        off = sum(1 for p in self.params if p.offload)
        parts = []
        if zero1:
            parts.append(f"optimizer state of {zero1} params sharded over data (ZeRO-1)")
        if off:
            parts.append(f"optimizer state of {off} params in host memory")
        return ("   memory: " + "; ".join(parts)) if parts else ""

    def _nodes_summary(self) -> list[str]:
        """Which mesh axis spans nodes, on a cluster of several."""
        hw = self.hardware
        if hw.num_nodes <= 1:
            return []
        d, m, r = mesh_dims(self.mesh_shape)
        inner = hw.devices_in_node(d, m)
        nodes = -(-self.num_devices // hw.node_size)
        p = mesh_stages(self.mesh_shape)
        if p > 1:
            where = (f"the {STAGE} axis of {p} "
                     + ("spans nodes (its sends cross the network)" if self.num_devices
                        > hw.node_size else "stays inside one node"))
        elif inner >= d:
            where = f"the whole mesh inside {'one node' if nodes == 1 else f'{nodes} nodes'}"
        elif r > 1:
            where = (f"the {REPLICA} axis spans {r} nodes (HSDP: parameters sharded over "
                     f"the {d // r} {DATA} devices inside each node, gradient shards "
                     f"all-reduced across the replicas)")
        else:
            where = (f"the {DATA} axis spans {d // inner} nodes ({inner} of its devices per "
                     f"node; its reductions inside a node first when cheaper)")
        return [f"nodes: {nodes} of {hw.num_nodes} used; {where}; the {MODEL} axis of {m} "
                f"stays inside a node"]

    def _inside_stage(self) -> str:
        """What a pipeline's other blocking communication is: each layer's gathers
        (FSDP inside a stage) and the model axis's collectives (tensor parallelism)."""
        what = [w for w, on in (("gathering each layer's weights and reduce-scattering "
                                 "their gradients", self.step.stage_sharded), (
            f"the {MODEL} axis's collectives", self.step.stage_tensor_parallel)) if on]
        rest = self.predicted.tp_comm_time_s - self.predicted.send_time_s
        return f"; {rest * 1e3:.3f} ms {' and '.join(what)}, every loop step" if what else ""

    def explain(self, max_params: int = 40) -> str:
        """A report a person reads: the decision, the layout, the figures, the losers."""
        pr = self.predicted
        hw = self.hardware
        dev = hw.device
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        lines = [
            f"jaxwap plan: {self.num_devices} of {hw.num_devices} devices, mesh {mesh}, "
            f"objective {self.objective.describe()}",
            f"hardware: {hw.num_devices} x {hw.device.name} "
            f"({si(dev.peak_flops, 'flop/s')} bf16, {si(dev.memory_bandwidth, 'B/s')}, "
            f"{si(dev.memory_bytes, 'B')}), {hw.describe_links()}",
            f"devices: {list(self.device_ids)}   batch: {self.batch_size}   memory budget: "
            f"{si(self.memory_budget_bytes, 'B')} per device",
            f"step: {self.step.describe()}" + self._memory_summary(),
            *self._nodes_summary(),
            "",
            "predicted (model, not measured):",
            f"  step time       {pr.step_time_s * 1e3:10.3f} ms   "
            f"({pr.samples_per_s:,.0f} samples/s)",
            f"  compute         {pr.compute_time_s * 1e3:10.3f} ms   "
            f"utilization {pr.utilization:.0%}",
            f"  communication   {pr.exposed_comm_time_s * 1e3:10.3f} "
            f"ms exposed of "
            f"{pr.grad_comm_time_s * 1e3:.3f} ms gradient reduction; "
            f"{pr.tp_comm_time_s * 1e3:.3f} ms "
            f"{'blocking' if self.step.pipelined else 'tensor-parallel'}; "
            f"{si(pr.comm_bytes, 'B')} sent per device",
            f"  energy          {pr.energy_per_step_j:10.3f} J/step   "
            f"{pr.energy_per_sample_j * 1e3:.3f} mJ/sample   {pr.avg_power_w:.0f} W average",
            f"  peak memory     {si(pr.peak_memory_bytes, 'B'):>10} per device"
            + (f"; {pr.host_transfer_time_s * 1e3:.3f} ms moving optimizer state to and "
               f"from host memory" if pr.host_transfer_time_s else ""),
        ]
        if self.step.pipelined:
            lines.append(
                f"  pipeline        {pr.bubble_time_s * 1e3:10.3f} ms bubble "
                f"({pr.bubble_time_s / pr.step_time_s:.0%} of the step, devices idle); "
                f"{pr.send_time_s * 1e3:.3f} ms of stage sends and the stack's entry/exit "
                f"over the {STAGE} axis" + self._inside_stage())
        if self.compiled is not None:
            c, v = self.compiled, self.verified
            kinds = Counter(f"{x.kind} over {'+'.join(x.axes) or 'no axis'}"
                            for x in c.collectives)
            lines += [
                "",
                "compiled (XLA's own analysis of this plan, per device):",
                f"  memory          {si(c.memory_bytes, 'B'):>10}   "
                f"(model {_err(pr.peak_memory_bytes, c.memory_bytes)})   "
                f"argument {si(c.argument_bytes, 'B')}, output {si(c.output_bytes, 'B')}, "
                f"temp {si(c.temp_bytes, 'B')}, aliased {si(c.alias_bytes, 'B')}"
                + (f"; less {si(c.host_unverified_bytes, 'B')} of optimizer state planned "
                   f"for host memory, which this backend's analysis cannot show (modelled)"
                   if c.host_unverified_bytes else ""),
                f"  flops           {si(c.flops, 'flop'):>10}   "
                f"(model {_err(pr.flops_as_xla_counts, c.flops)})",
                f"  communication   {si(c.comm_bytes, 'B'):>10}   "
                f"(model {_err(pr.comm_bytes, c.comm_bytes)})   "
                f"{', '.join(f'{n} {k}' for k, n in sorted(kinds.items())) or 'no collectives'}",
            ]
            if v is not None:
                lines.append(f"  model fed these figures: step {v.step_time_s * 1e3:.3f} ms, "
                             f"{v.energy_per_step_j:.3f} J/step (what the choice was made on)")
        if self.measured is not None:
            ms = self.measured
            lines += ["", f"measured on the devices ({ms.steps} steps; energy "
                          f"{ms.energy_source}{': ' + ms.note if ms.note else ''}):",
                      f"  step time       {ms.step_time_s * 1e3:10.3f} ms   "
                      f"(model {pr.step_time_s * 1e3:.3f} ms)",
                      f"  energy          {ms.energy_per_step_j:10.3f} J/step "
                      f"(model {pr.energy_per_step_j:.3f} J/step)"]
        lines += [
            "",
            "parameters:",
        ]
        width = max((len(p.keystr) for p in self.params), default=10)
        width = min(max(width, 10), 60)
        sw = max([14] + [len(p.strategy) for p in self.params])
        lines.append(f"  {'path':<{width}}  {'shape':<20} {'size':>10}  {'strategy':<{sw}} spec")
        shown = sorted(self.params, key=lambda p: -p.nbytes)[:max_params]
        order = {id(p): i for i, p in enumerate(self.params)}
        for p in sorted(shown, key=lambda p: order[id(p)]):
            lines.append(f"  {p.keystr[:width]:<{width}}  {str(p.shape):<20} "
                         f"{si(p.nbytes, 'B'):>10}  {p.strategy:<{sw}} {P(*p.spec)}"
                         + (f"  state {P(*p.state_spec)}" if p.state_spec is not None else ""))
        if len(self.params) > max_params:
            lines.append(f"  ... {len(self.params) - max_params} smaller parameters not shown")
        lines += ["", "candidates (every mesh considered, by score):",
                  "  (basis: measured = run on the devices; XLA = the model fed XLA's "
                  "compiled figures; model = analytic; dp = plain data parallelism, the "
                  "baseline)",
                  f"  {'mesh':<12} {'step ms':>10} {'samples/s':>11} {'J/step':>9} "
                  f"{'W':>7} {'mem/dev':>9} {'basis':>8}  verdict"]
        basis = {MEASURED: "measured", COMPILED: "XLA"}
        batch = self.batch_size or 1
        for c in sorted(self.candidates, key=lambda c: (not c.chosen, c.score)):
            j = c.judged
            lines.append(f"  {c.label:<12} {j.step_time_s * 1e3:10.3f} "
                         f"{batch / j.step_time_s:11,.0f} {j.energy_per_step_j:9.3f} "
                         f"{j.avg_power_w:7.0f} {si(j.peak_memory_bytes, 'B'):>9} "
                         f"{basis.get(j.basis, 'model'):>8}  "
                         f"{'CHOSEN' if c.chosen else c.reason}")
        t = self.planning_time_s
        lines += ["", "planning time: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in t.items())]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def _err(predicted: float, actual: float) -> str:
    """The model's figure and its error relative to XLA's."""
    if actual == 0:
        return f"{predicted:.3g}"
    return f"{si(predicted, '')}, {100 * (predicted - actual) / actual:+.0f}%"


def _opt(cls: Any, d: dict[str, Any] | None) -> Any:
    return cls.from_dict(d) if d is not None else None
