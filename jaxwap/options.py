"""The options of a planning, in one record.

`auto_shard`, `AutoShardedStep`, `jaxwap.plan` and the planner all take exactly these, so
an option is declared, checked and documented once. Values are checked and canonicalised
when the record is made (a bad value raises there, naming the option; one value's own
check is in `option_values.py`, the checks of options against each other and against a
plan given are here), and the record is part of the plan cache's key, so every option
that can change a plan changes the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxwap.core.objective import Objective
from jaxwap.core.records import mesh_dims
from jaxwap.hardware.cluster import Cluster
from jaxwap.hardware.device import DeviceSpec
from jaxwap.option_values import (
    canonical_measure,
    canonical_mesh_shape,
    canonical_pipeline,
    canonical_strategies,
    check_int,
    is_number,
)
from jaxwap.plans.cache import PlanCache
from jaxwap.plans.plan import Plan
from jaxwap.search.constraints import LayoutRules, parse_constraints, resolve

# What `power_limit=` may say: report the chosen limit, or set it while the step lives.
POWER_LIMIT_MODES = ("recommend", "apply")


@dataclass(frozen=True)
class PlanOptions:
    """How to plan (and run) a training step.

    Attributes:
      objective: "throughput", "energy", "balanced" or `jaxwap.Objective(max_slowdown=x)`.
      hardware: a `jaxwap.Cluster`, a `DeviceSpec` or a profile name to plan for; None:
        the devices found (their calibration when `jaxwap calibrate` cached one).
      devices: the devices the job may use (default `jax.devices()`); plans may use fewer.
      memory_budget: bytes per device; None: the device memory less 10% headroom.
      num_devices: use exactly this many devices instead of choosing.
      verify: compile the analytic search's best candidates until this many fit by XLA's
        own memory analysis, and choose among them on XLA's figures (0: trust the model).
      donate: donate the state arguments (params, their optimizer state and what else the
        step hands back at the same path) to the step, as `jax.jit(donate_argnums=...)`
        would: use the returned state, not the one passed in. The first call consumes the
        initial state alike on every plan (donated in place, or copied onto the mesh and
        deleted once the step ran); a deleted or donated array passed in is refused,
        naming its path.
      compiler_options: XLA options for the compile (None: latency hiding on GPU).
      cache: read back a plan made before for the same step and settings (True: the
        directory in $JAXWAP_CACHE_DIR or ~/.cache/jaxwap; a `jaxwap.PlanCache`; False).
      batch_size: the global batch size, when the most common leading dimension of the
        arguments that are not state is not it.
      measure: run the verified finalists on the devices before the first step (True: 5
        steps each after a warm-up, or this many) and choose on measured time and energy
        (NVML energy where available, modeled and labelled so otherwise). The measured
        choice is what the plan cache keeps.
      offload: allow plans that keep optimizer state in pinned host memory when nothing
        else fits (on a backend that ignores memory kinds, such as XLA:CPU, the saving is
        modelled, not verified, and the plan's notes say so).
      mesh_shape: use exactly this mesh, e.g. `{"data": 2, "model": 4}`, or hybrid-sharded
        (HSDP) `{"replica": 2, "data": 4}`: 2 replicas of 4 devices each (an axis left out
        has size 1) instead of searching over meshes; the per-parameter layouts are still
        chosen. With a pipeline, it is each stage's mesh: the stage axis is added outside
        it (`pipeline={"stages": 2}` and `{"data": 2, "model": 2}` use 8 devices).
      strategies: restrict every parameter's layout to these families of
        `jaxwap.STRATEGY_FAMILIES`: "replicate", "tp" (a feature dim over the model axis),
        "zero1" (optimizer state over the data axis), "fsdp" (weight, gradient and state
        over the data axis), "offload" (state in host memory). A layout qualifies when
        every family it combines is allowed; a parameter with no qualifying split (a bias
        no axis divides) stays replicated, and without "replicate" a mesh on which no
        parameter gets an allowed split is not a candidate. `("fsdp",)` forces FSDP.
      pipeline: pipelining of a `make_train_step` step whose loss runs a `lax.scan` over
        stacked layer parameters (`jaxwap.runtime.layer_scan`): None (the default) weighs pipelined
        candidates beside the others; False never pipelines; a dict of "stages" and
        optionally "micro_batches" and "repeats" (1: GPipe, more: the circular schedule)
        plans only pipelines of that shape (what is left out is chosen).
      constraints: pin the layout of chosen parameters, `{pattern: layout}`: `pattern` a
        regular expression searched in each parameter's path (its keys joined by "/",
        e.g. "blocks/w1"), `layout` a `PartitionSpec` over "data" and "model" (the
        weight's exact layout) or a family name of `STRATEGY_FAMILIES` (that family's
        layouts only); the first matching pattern pins a parameter, and the planner
        searches everything else around the pins (`jaxwap.logical_constraints` turns Flax
        partitioning metadata into these). A pattern matching no parameter, or a pin
        that holds on no mesh, raises naming the parameter, its shape, the spec and why.
      plan: run this plan (a `jaxwap.Plan`, or the path of its `to_json()` file) instead of
        planning: a plan made ahead of time for the cluster, by `jaxwap.plan(...,
        hardware=Cluster(...))` on another machine. The cluster it was made for must be
        the devices present (same count), and the step's parameters the plan's. An option
        the plan breaks (a mesh_shape, num_devices, strategies, constraints, offload=False
        or memory_budget it does not obey) is refused rather than ignored.
      power_limit: what to do with the power limit the plan chooses (`Plan.power_limit_w`)
        "recommend" (the default): report it, change nothing; "apply": set it through
        NVML on the devices the plan uses while the step object lives, and put the
        previous limits back when it is closed, garbage collected, at interpreter exit
        and after a step raises. Where setting limits is not permitted it warns once and
        runs uncapped. Not part of the plan's cache key: it does not change the plan.
    """

    objective: Objective = field(default_factory=Objective)
    hardware: Cluster | DeviceSpec | str | None = None
    devices: tuple[Any, ...] | None = None
    memory_budget: float | None = None
    num_devices: int | None = None
    verify: int = 3
    donate: bool = True
    compiler_options: Mapping[str, Any] | None = None
    cache: bool | PlanCache = field(default=True, compare=False)
    batch_size: int | None = None
    measure: int = 0
    offload: bool = True
    mesh_shape: Mapping[str, int] | None = None
    strategies: tuple[str, ...] | None = None
    plan: Plan | str | os.PathLike | None = None
    pipeline: bool | Mapping[str, int] | None = None
    constraints: Any = None
    power_limit: str = field(default="recommend", compare=False)

    def __post_init__(self) -> None:
        # in this order: where several options are wrong, the first named here is reported
        self._check_target()
        self._check_counts()
        self._check_switches()
        self._check_layout()
        if self.power_limit not in POWER_LIMIT_MODES:
            raise ValueError(f"power_limit must be one of {POWER_LIMIT_MODES}, got "
                             f"{self.power_limit!r}")
        self._check_plan()

    def _put(self, name: str, value: Any) -> None:
        """Keep an option's canonical form: the record is frozen to everyone else."""
        object.__setattr__(self, name, value)

    def _check_target(self) -> None:
        """What is planned for: the objective, the hardware, the devices (each once: a
        mesh holds a device once) and the memory budget per device."""
        self._put("objective", Objective.parse(self.objective))
        if self.hardware is not None and not isinstance(self.hardware,
                                                        (Cluster, DeviceSpec, str)):
            raise TypeError(f"hardware must be None, a jaxwap.Cluster, a DeviceSpec or a "
                            f"profile name, got {type(self.hardware).__name__}")
        if self.devices is not None:
            self._put("devices", tuple(self.devices))
            if not self.devices:
                raise ValueError("devices= is empty: jaxwap needs at least one device to "
                                 "plan for")
            twice = [d for i, d in enumerate(self.devices) if d in self.devices[:i]]
            if twice:
                raise ValueError(f"devices= lists {twice[0]} more than once: a mesh holds "
                                 f"each device once")
        if self.memory_budget is not None:
            if not is_number(self.memory_budget) or not self.memory_budget > 0:
                raise ValueError(f"memory_budget must be > 0 bytes, got {self.memory_budget!r}")
            self._put("memory_budget", float(self.memory_budget))

    def _check_counts(self) -> None:
        """The counts, kept as plain ints (a numpy int would give another cache key)."""
        # its range (1..the devices usable) is checked where the devices are known
        check_int("num_devices", self.num_devices, None, none_ok=True, exc=TypeError)
        check_int("verify", self.verify, 0, what="how many candidates to compile")
        check_int("batch_size", self.batch_size, 1, none_ok=True)
        self._put("verify", int(self.verify))
        if self.num_devices is not None:
            self._put("num_devices", int(self.num_devices))
        if self.batch_size is not None:
            self._put("batch_size", int(self.batch_size))
        self._put("measure", canonical_measure(self.measure))

    def _check_switches(self) -> None:
        """The compiler options, the cache, and the flags `donate` and `offload`."""
        if self.compiler_options is not None:
            if not isinstance(self.compiler_options, Mapping):
                raise TypeError(f"compiler_options must be a dict of XLA options, got "
                                f"{type(self.compiler_options).__name__}")
            self._put("compiler_options", dict(self.compiler_options))
        if not isinstance(self.cache, (bool, PlanCache)):
            raise TypeError(f"cache must be True, False or a jaxwap.PlanCache, got "
                            f"{type(self.cache).__name__}")
        for flag in ("donate", "offload"):
            # a string ("False" from a config file) would read as True: donate= would
            # delete the arrays of a user who asked to keep them
            if not isinstance(getattr(self, flag), (bool, np.bool_)):
                raise TypeError(f"{flag} must be True or False, got "
                                f"{getattr(self, flag)!r}")
            self._put(flag, bool(getattr(self, flag)))

    def _check_layout(self) -> None:
        """What the search may choose from: the mesh (which must agree with
        `num_devices`), the strategy families, the pins and the pipeline."""
        if self.mesh_shape is not None:
            self._put("mesh_shape", canonical_mesh_shape(self.mesh_shape))
            n = math.prod(s for _, s in self.mesh_shape)
            if self.num_devices is not None and self.num_devices != n:
                raise ValueError(f"num_devices={self.num_devices} contradicts mesh_shape="
                                 f"{dict(self.mesh_shape)} ({n} devices); give one of them")
        if self.strategies is not None:
            self._put("strategies", canonical_strategies(self.strategies))
        if self.constraints is not None:
            self._put("constraints", parse_constraints(self.constraints))
        self._put("pipeline", canonical_pipeline(self.pipeline))

    def _check_plan(self) -> None:
        """A plan given (read from its file when a path): the options it would otherwise
        ignore without a word must not contradict it (`_plan_contradicts`)."""
        if self.plan is not None and not isinstance(self.plan, Plan):
            if not isinstance(self.plan, (str, os.PathLike)):
                raise TypeError(f"plan must be a jaxwap.Plan or the path of a plan's JSON, "
                                f"got {type(self.plan).__name__}")
            path = Path(self.plan)
            try:
                self._put("plan", Plan.from_json(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"plan={str(path)!r} cannot be read as a jaxwap plan: "
                                 f"{e}") from e
        if self.plan is not None:
            # the plan fixes the mesh: a mesh_shape or num_devices that says otherwise
            # would be ignored without a word
            have = dict(self.plan.mesh_shape)
            if self.mesh_shape is not None and any(
                    int(have.get(axis, 1)) != size for axis, size in self.mesh_shape):
                raise ValueError(f"mesh_shape={dict(self.mesh_shape)} contradicts the plan "
                                 f"given (mesh {have}); give one of them")
            if self.num_devices is not None and self.num_devices != self.plan.num_devices:
                raise ValueError(f"num_devices={self.num_devices} contradicts the plan given "
                                 f"({self.plan.num_devices} devices, mesh {have}); give one "
                                 f"of them")
            why = _plan_contradicts(self)
            if why:
                raise ValueError(f"{why}: the plan given runs as saved, so give one of them "
                                 f"(or plan again without plan=)")

    @property
    def allowed(self) -> frozenset[str] | None:
        """The strategy families `strategies` allows, or None."""
        return None if self.strategies is None else frozenset(self.strategies)

    def rules(self, params: Sequence[Any]) -> LayoutRules | None:
        """What the search may give the step's parameters (`ParamInfo`s): the families
        `strategies` allows and the pins `constraints` set (None: anything)."""
        if self.strategies is None and not self.constraints:
            return None
        return resolve(self.constraints or (), params, self.allowed)

    @property
    def mesh(self) -> tuple[int, int] | None:
        """The (data, model) sizes `mesh_shape` fixes (data counting the replicas'), or
        None."""
        if self.mesh_shape is None:
            return None
        d, m, _ = mesh_dims(self.mesh_shape)
        return d, m

    @property
    def forced_pipeline(self) -> dict[str, int] | None:
        """The pipeline shape `pipeline` forces (stages, and maybe micro_batches and
        repeats), or None."""
        return dict(self.pipeline) if isinstance(self.pipeline, tuple) else None

    @property
    def replicas(self) -> int:
        """The replicas `mesh_shape` fixes (HSDP), 1 when it names none."""
        return 1 if self.mesh_shape is None else mesh_dims(self.mesh_shape)[2]

    @classmethod
    def of(cls, options: PlanOptions | None = None, **kwargs: Any) -> PlanOptions:
        """`options` with `kwargs` replacing its fields (a record of defaults when None);
        an unknown name is an error that lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(map(repr, unknown))}; jaxwap's "
                            f"options are {', '.join(sorted(known))}")
        if options is not None and not isinstance(options, PlanOptions):
            raise TypeError(f"options must be a jaxwap.PlanOptions, got "
                            f"{type(options).__name__}")
        return dataclasses.replace(options, **kwargs) if options else cls(**kwargs)

    @property
    def store(self) -> PlanCache | None:
        """The plan cache to read and write, or None."""
        if self.plan is not None:
            return None  # the plan is given: nothing to look up or keep
        if isinstance(self.cache, PlanCache):
            return self.cache
        return PlanCache() if self.cache else None


def _plan_contradicts(o: PlanOptions) -> str | None:
    """What in `o`'s planning options the plan it was given breaks (they would otherwise be
    ignored without a word), or None: a family `strategies` leaves out, a pin of
    `constraints`, `offload=False` under offloaded state, a `memory_budget` its memory is
    over (XLA's figure where the plan was verified)."""
    for p in o.plan.params:
        where = f"params{p.keystr} is {p.strategy} ({'/'.join(p.families)})"
        if not o.offload and p.offload:
            return f"offload=False contradicts the plan given: {where}"
        if o.strategies is not None and not p.families <= frozenset(o.strategies):
            return f"strategies={o.strategies} contradicts the plan given: {where}"
        c = next((c for c in o.constraints or () if re.search(c.pattern, "/".join(p.path))),
                 None)
        if c is not None and not (tuple(p.spec) == c.spec if c.spec is not None
                                  else c.family in p.families):
            return f"constraint {c.pattern!r}: {c.describe()} contradicts the plan given: {where}"
    memory = (o.plan.compiled.memory_bytes if o.plan.compiled is not None
              else o.plan.predicted.peak_memory_bytes)
    if o.memory_budget is not None and memory > o.memory_budget:
        return (f"memory_budget={o.memory_budget:.4g} contradicts the plan given: it needs "
                f"{memory:.4g} bytes per device")
    return None


def split_options(kwargs: dict[str, Any], step: Any = None
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(options, the rest): `jaxwap.plan(step, *args, **kwargs)` passes the step's own
    keyword arguments beside jaxwap's options; a name that is an option is an option. A
    keyword the `step` cannot take (its signature has no such parameter and no
    **kwargs) is refused here, naming the options it resembles: a misspelt option
    (`mesh_shap=`) would otherwise reach the step as its own argument."""
    names = {f.name for f in dataclasses.fields(PlanOptions)}
    rest = {k: v for k, v in kwargs.items() if k not in names}
    if rest and step is not None:
        try:
            sig = inspect.signature(step)
        except (TypeError, ValueError):   # a builtin or C callable: nothing to check by
            sig = None
        takes_any = sig is None or any(p.kind is inspect.Parameter.VAR_KEYWORD
                                       for p in sig.parameters.values())
        bad = [] if takes_any else [k for k in rest if k not in sig.parameters]
        if bad:
            hints = "; ".join(f"{k!r}: did you mean {', '.join(close)}?" for k in bad
                              if (close := difflib.get_close_matches(k, names, n=3)))
            raise TypeError(f"{', '.join(map(repr, bad))}: neither an option of jaxwap "
                            f"(PlanOptions: {', '.join(sorted(names))}) nor a keyword "
                            f"argument of the step{'; ' + hints if hints else ''}")
    return {k: v for k, v in kwargs.items() if k in names}, rest


__all__ = ["PlanOptions", "split_options"]

