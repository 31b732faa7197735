"""The plain records every stage passes along, at the bottom of the layers.

A strategy (how one parameter is laid out), a prediction (the model's figures for a
step), XLA's compiled figures, a measurement, a step variant, the mesh axis names, and
the one rule that says which of those figures judge a candidate. They hold data and the
arithmetic on their own fields, nothing else: every stage above imports them, none of
them imports a stage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Mesh axis names: the batch is split over DATA, tensor-parallel weights over MODEL. A
# hybrid-sharded (HSDP) plan splits the data axis in two: REPLICA across nodes, DATA inside
# each node; the batch is split over both, FSDP / ZeRO-1 shard over DATA alone. A
# pipelined plan's outermost axis is STAGE: the layers of a scanned stack split over it.
DATA, MODEL, REPLICA, STAGE = "data", "model", "replica", "stage"


def mesh_dims(mesh_shape: Any) -> tuple[int, int, int]:
    """(data parallelism in all, model, replicas) of a plan's `mesh_shape` mapping or a
    candidate's (axis, size) pairs: the batch is split replicas x data ways."""
    sizes = dict(mesh_shape)
    r = int(sizes.get(REPLICA, 1))
    return r * int(sizes.get(DATA, 1)), int(sizes.get(MODEL, 1)), r


def bubble_idles(stage_remat: bool, repeats: int) -> bool:
    """Whether a pipeline stage idles in the bubble (its layers skipped under `lax.cond`)
    or runs its layers there and drops the result: GPipe keeping only its loop steps'
    inputs, the schedule taken where memory binds, does the latter, since the backward
    cond hands out a whole stage share's weight gradient (`schedule._stage_step`)."""
    return not (stage_remat and repeats == 1)


def mesh_stages(mesh_shape: Any) -> int:
    """The pipeline stages of a plan's `mesh_shape` (1: not pipelined)."""
    return int(dict(mesh_shape).get(STAGE, 1))

PREDICTED, COMPILED, MEASURED = "predicted", "compiled", "measured"

# The families a parameter layout is built from, which `PlanOptions(strategies=...)` may
# restrict a plan to: replicated, tensor parallel over the model axis, optimizer state
# sharded over data (ZeRO-1), everything sharded over data (FSDP), state in host memory.
STRATEGY_FAMILIES: tuple[str, ...] = ("replicate", "tp", "zero1", "fsdp", "offload")

# Rematerialization policies a `make_train_step` step may be restructured with: the
# whole loss checkpointed ("dots", "dots_no_batch", "offload_dots"), each of its layers
# ("layer_*": what the backward pass keeps of a layer, `REMAT_WORDS`), or, in a pipeline,
# each loop step's stage ("stage": only its input kept).
REMAT_POLICIES: tuple[str, ...] = ("none", "dots", "dots_no_batch", "offload_dots",
                                   "layer_dots", "layer_full", "layer_offload", "stage")
REMAT_WORDS: dict[str, str] = {
    "dots": "the loss checkpointed, matmul outputs kept",
    "dots_no_batch": "the loss checkpointed, unbatched matmul outputs kept",
    "offload_dots": "the loss checkpointed, unbatched matmul outputs in host memory",
    "layer_dots": "each layer checkpointed, its weight matmuls' outputs kept (selective)",
    "layer_full": "each layer checkpointed, only its input kept (full recompute)",
    "layer_offload": "each layer checkpointed, its weight matmuls' outputs in host memory",
    "stage": "each loop step's stage checkpointed, only its input kept (its layers run "
             "again in the backward pass)"}


@dataclass(frozen=True)
class Strategy:
    """How one parameter is laid out on the mesh.

    `spec` is a PartitionSpec as a tuple of per-dim entries (None or an axis name).
    `tp` is "col" (an output-feature dim over the model axis), "row" (a contracted dim
    over the model axis) or "none"; `data_sharded` marks ZeRO-3 / FSDP sharding over
    the data axis (weight, gradient and optimizer state). Memory-only variants:
    `state_spec` (when not None) lays out the parameter's optimizer state differently from
    the parameter: ZeRO-1, the state sharded over the data axis while the weight is not;
    `offload` keeps that state in pinned host memory between steps, moved in and out
    inside the compiled step.
    """

    name: str
    spec: tuple[str | None, ...]
    tp: str = "none"
    data_sharded: bool = False
    state_spec: tuple[str | None, ...] | None = None
    offload: bool = False

    def shard(self, d: int, m: int) -> int:
        """How many ways the weight (and its gradient) is split."""
        return (d if self.data_sharded else 1) * (m if self.tp != "none" else 1)

    def state_shard(self, d: int, m: int) -> int:
        """How many ways the optimizer state is split."""
        zero1 = self.state_spec is not None and DATA in self.state_spec
        return self.shard(d, m) * (d if zero1 and not self.data_sharded else 1)

    def divisors(self, d: int, m: int) -> tuple[float, float, float, float, float, float]:
        """Per-device share divisors of the WEIGHT, GRAD, OPT, RESIDENT, WHOLE and REDUCED
        classes (infinite: not in device memory between uses). WHOLE is what a
        data-sharded weight is gathered to (split over the model axis only); other layouts
        hold no such copy. REDUCED is the all-reduced copy of a gradient the data axis
        reduces whole (split as the weight is), on more than one data device; an FSDP
        gradient's is left out (WHOLE holds its whole gradient)."""
        w, s = float(self.shard(d, m)), float(self.state_shard(d, m))
        inf = float("inf")
        whole = float(m if self.tp != "none" else 1) if self.data_sharded else inf
        reduced = w if d > 1 and not self.data_sharded else inf
        return w, w, s, (inf if self.offload else s), whole, reduced

    @property
    def layout_of_state(self) -> tuple[str | None, ...]:
        return self.spec if self.state_spec is None else self.state_spec

    @property
    def families(self) -> frozenset[str]:
        """The `STRATEGY_FAMILIES` this layout combines ({"replicate"} when none)."""
        out = {name for name, on in (("tp", self.tp != "none"),
                                     ("zero1", self.state_spec is not None),
                                     ("fsdp", self.data_sharded), ("offload", self.offload))
               if on}
        return frozenset(out or {"replicate"})


@dataclass(frozen=True)
class Prediction:
    """The model's figures for one step of one candidate (per device unless stated).

    step time = compute + tensor-parallel (blocking) communication + the exposed part of
    the gradient reduction + the exposed part of host transfers + the host's call;
    `prediction.assemble` is the one place that adds them up.
    """

    step_time_s: float
    samples_per_s: float
    energy_per_step_j: float
    energy_per_sample_j: float
    avg_power_w: float            # all devices of the mesh together
    peak_memory_bytes: float      # per device
    comm_bytes: float             # bytes each device sends per step
    compute_time_s: float
    tp_comm_time_s: float
    grad_comm_time_s: float
    exposed_comm_time_s: float    # the gradient reduction the backward pass does not hide
    flops_per_device: float
    utilization: float
    num_devices: int
    busy_time_s: float = 0.0      # the roofline part of compute (no launch overhead)
    batched_time_s: float = 0.0   # compute of batched ops: the backward pass hides in it
    host_transfer_time_s: float = 0.0   # offloaded state moved in and out, seconds
    # flops XLA's cost analysis counts (a loop body once) over the true flops: what to
    # compare with compiled figures when the step has a scan (micro-batches)
    loop_flops_ratio: float = 1.0
    # the gradient reduction that can never overlap: the first layer's, produced last
    tail_comm_time_s: float = 0.0
    exposed_host_time_s: float = 0.0    # host transfers the step cannot hide
    # a pipelined step: seconds of its compute each device spends in the bubble (on
    # padding), and seconds of stage-to-stage sends and the stack's entry and exit
    bubble_time_s: float = 0.0
    send_time_s: float = 0.0
    # of busy at the board's default limit: compute-bound kernels (a power limit
    # stretches them), and their work at the device's full rate
    compute_bound_time_s: float = 0.0
    compute_bound_work_s: float = 0.0
    # the power limit per device the figures are for (None: the board default), and the
    # seconds it adds to compute (in compute_time_s and busy_time_s)
    power_limit_w: float | None = None
    power_stretch_s: float = 0.0
    # of compute: the host allocator mapping the step's scratch memory afresh
    # (`DeviceSpec.fresh_memory_cost`)
    fresh_memory_time_s: float = 0.0
    # of compute and busy: arrays the backend moves into another layout (the model's: an
    # all-reduced transposed gradient, `grad_reductions.relayouts`; fed XLA's, those it made)
    layout_change_time_s: float = 0.0
    # the host's call of the step: jax's dispatch of its arrays (`prediction.call_time`)
    call_time_s: float = 0.0

    @property
    def flops_as_xla_counts(self) -> float:
        return self.flops_per_device * self.loop_flops_ratio

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Prediction:
        return cls(**d)


@dataclass(frozen=True)
class Collective:
    """One collective in a compiled program: its kind, the bytes of its result on one
    device, the mesh axes its replica groups span, the size of each group and how many
    arrays it carries."""

    kind: str
    bytes: int
    axes: tuple[str, ...]
    group_size: int
    buffers: int = 1   # arrays it carries (XLA's combiner joins many into one tuple)


@dataclass(frozen=True)
class CompiledFigures:
    """XLA's own per-device figures for one compiled candidate."""

    memory_bytes: float        # argument + output + temp - alias
    argument_bytes: float
    output_bytes: float
    temp_bytes: float
    alias_bytes: float
    flops: float
    bytes_accessed: float
    comm_bytes: float          # sent per device by `collectives`, ring formulas
    collectives: tuple[Collective, ...]
    compile_time_s: float = field(default=0.0, compare=False)  # a timing, not a figure
    host_bytes: float = 0.0    # host-memory argument + output + temp XLA reports
    # state the plan keeps in host memory that this backend's analysis counts on the
    # device (XLA:CPU ignores memory kinds): taken out of memory_bytes, and unverified
    host_unverified_bytes: float = 0.0
    # ((array bytes, times per step), ...) XLA's layout assignment moves into another
    # layout (`xla_figures.layout_changes`)
    layout_changes: tuple[tuple[float, int], ...] = ()
    # calls into a vendor library (cuBLAS, cuDNN): where there are any, `flops` misses
    # their work (`xla_figures.library_calls`)
    library_calls: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["collectives"] = [asdict(c) for c in self.collectives]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompiledFigures:
        d = dict(d)
        d["collectives"] = tuple(Collective(c["kind"], c["bytes"], tuple(c["axes"]),
                                            c["group_size"], c.get("buffers", 1))
                                 for c in d["collectives"])
        d["layout_changes"] = tuple((float(b), int(t)) for b, t in d.get("layout_changes", ()))
        return cls(**d)


@dataclass(frozen=True)
class Measurement:
    """What one candidate did on the devices: per step, over `steps` steps."""

    step_time_s: float
    energy_per_step_j: float
    energy_source: str     # "nvml-energy-counter" | "nvml-power-polling" | "modeled"
    steps: int
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        return cls(**d)


@dataclass(frozen=True)
class StepVariant:
    """How a `make_train_step` step is restructured: micro-batches and a remat policy, or
    a pipeline: its scanned layer stack split into `stages` over the STAGE mesh axis, the
    batch cut into `micro_batches` that flow through them, each stage visiting its layers
    in `repeats` rounds (1: GPipe; more: the circular schedule). `stage_specs` says how a
    stage holds its share of each stacked parameter (in the order the layer scan reads
    them), beyond the layer dim: the mesh axis each further dim is sharded over, or None.
    A dim sharded over a data axis is FSDP inside the stage: each layer's weights are
    gathered where the loop runs it, their gradient reduce-scattered. A dim over the model
    axis is tensor parallelism inside the stage. Empty: every stage holds its share
    whole."""

    micro_batches: int = 1
    remat: str = "none"
    stages: int = 1
    repeats: int = 1
    stage_specs: tuple[tuple[str | None, ...], ...] = ()

    def __post_init__(self) -> None:
        for name in ("micro_batches", "stages", "repeats"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.repeats > 1 and self.stages == 1:
            raise ValueError(f"repeats={self.repeats} needs a pipeline (stages > 1)")
        if (self.remat == "stage") != (self.stages > 1 and self.remat != "none"):
            raise ValueError(f"remat={self.remat!r} with stages={self.stages}: a pipeline "
                             f"takes remat 'stage' or 'none', and 'stage' needs a pipeline")
        if self.repeats > 1 and self.micro_batches < self.stages:
            raise ValueError(f"the circular schedule (repeats={self.repeats}) needs at least "
                             f"as many micro-batches as stages: micro_batches="
                             f"{self.micro_batches} < stages={self.stages}")
        # a saved plan's JSON gives lists: the record keeps tuples (hashable, comparable)
        try:
            specs = tuple(tuple(spec) for spec in self.stage_specs)
        except TypeError:
            raise ValueError(f"stage_specs must be a sequence of specs (sequences of axis "
                             f"names or None), got {self.stage_specs!r}") from None
        bad = [dim for spec in specs for dim in spec if not (dim is None or
                                                            isinstance(dim, str))]
        if bad:
            raise ValueError(f"stage_specs entries must be mesh axis names or None, got "
                             f"{bad[0]!r} in {self.stage_specs!r}")
        if specs and not self.pipelined:
            raise ValueError(f"stage_specs={self.stage_specs!r} needs a pipeline "
                             f"(stages > 1)")
        object.__setattr__(self, "stage_specs", specs)

    @property
    def stage_sharded(self) -> bool:
        """Whether a stage shards a stacked parameter's share over a data axis (FSDP
        inside the stage: its layers are gathered in the loop)."""
        return any(dim in (DATA, REPLICA) for spec in self.stage_specs for dim in spec)

    @property
    def stage_tensor_parallel(self) -> bool:
        """Whether a stage splits a stacked parameter over the model axis (tensor
        parallelism inside the stage)."""
        return any(dim == MODEL for spec in self.stage_specs for dim in spec)

    @property
    def is_plain(self) -> bool:
        return self.micro_batches == 1 and self.remat == "none" and self.stages == 1

    @property
    def pipelined(self) -> bool:
        return self.stages > 1

    @property
    def bubble_idles(self) -> bool:
        """Whether a stage idles in the bubble (`bubble_idles`)."""
        return bubble_idles(self.remat == "stage", self.repeats)

    @property
    def bubble_share(self) -> float:
        """The share of the pipeline's loop a stage waits: (p - 1) / (m r + p - 1)."""
        p, m, r = self.stages, self.micro_batches, self.repeats
        return (p - 1) / (m * r + p - 1) if p > 1 else 0.0

    def describe(self) -> str:
        parts = []
        if self.pipelined:
            sched = "GPipe" if self.repeats == 1 else f"circular, {self.repeats} rounds"
            inside = ((", tensor-parallel layers" if self.stage_tensor_parallel else "")
                      + (", layers gathered per step" if self.stage_sharded else ""))
            parts.append(f"pipeline of {self.stages} stages x {self.micro_batches} "
                         f"micro-batches ({sched}; bubble {self.bubble_share:.0%} of the "
                         f"loop{'' if self.bubble_idles else ', computed and dropped'}"
                         f"{inside})")
        elif self.micro_batches > 1:
            parts.append(f"{self.micro_batches} micro-batches")
        if self.remat != "none":
            parts.append(f"remat {self.remat} ({REMAT_WORDS[self.remat]})")
        return ", ".join(parts) or "as written"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: the specs as lists, as a saved plan reads them back."""
        d = asdict(self)
        d["stage_specs"] = [list(spec) for spec in self.stage_specs]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> StepVariant:
        return cls(**d) if d else cls()


@dataclass(frozen=True)
class Judged:
    """The figures a candidate is judged on, and what they are (`basis`): measured on
    the devices, the model fed XLA's compiled figures, or the model alone. Memory is
    never measured: a measured candidate keeps its compiled (or predicted) memory."""

    basis: str
    step_time_s: float
    energy_per_step_j: float
    peak_memory_bytes: float
    num_devices: int

    @property
    def avg_power_w(self) -> float:
        return self.energy_per_step_j / self.step_time_s if self.step_time_s > 0 else 0.0


def judge(predicted: Prediction, verified: Prediction | None = None,
          measured: Measurement | None = None) -> Judged:
    """Which figures judge a candidate: measured, else compiled, else predicted. The one
    rule the search, verification, measured choice, the Plan and the frontier share."""
    ref = verified or predicted
    if measured is not None:
        return Judged(MEASURED, measured.step_time_s, measured.energy_per_step_j,
                      ref.peak_memory_bytes, ref.num_devices)
    return Judged(COMPILED if verified is not None else PREDICTED, ref.step_time_s,
                  ref.energy_per_step_j, ref.peak_memory_bytes, ref.num_devices)


__all__ = ["COMPILED", "DATA", "MEASURED", "MODEL", "PREDICTED", "REMAT_POLICIES", "REMAT_WORDS",
           "REPLICA", "STAGE", "STRATEGY_FAMILIES", "Collective", "CompiledFigures", "Judged",
           "Measurement", "Prediction", "StepVariant", "Strategy", "bubble_idles", "judge",
           "mesh_dims", "mesh_stages"]
