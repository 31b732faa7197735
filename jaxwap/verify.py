"""Verification: compile the finalists and believe XLA over the model.

After SPMD partitioning XLA knows, per device, what a sharded program costs:
`Compiled.memory_analysis()` (argument, output, temp and aliased bytes),
`Compiled.cost_analysis()` (flops, bytes accessed) and, in `Compiled.as_text()`, every
collective the partitioner inserted. This module reads those figures, feeds them back
into the cost model in place of its own guesses, and never lets a candidate XLA says
does not fit become the plan.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .cost import (
    BACKWARD_SHARE,
    DATA,
    MODEL,
    Prediction,
    all_gather,
    all_reduce,
    assemble,
    host_exposed,
)
from .hardware import Cluster

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_INSTR = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\(")
_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclass(frozen=True)
class Collective:
    """One collective in a compiled program: its kind, the bytes of its result on one
    device, the mesh axes its replica groups span, and the size of each group."""

    kind: str
    bytes: int
    axes: tuple[str, ...]
    group_size: int

    def cost(self, cluster: Cluster) -> tuple[float, float]:
        """(seconds, bytes sent per device) by the same ring formulas the model uses."""
        n = self.group_size
        if self.kind == "all-reduce":
            return all_reduce(self.bytes, n, cluster)
        if self.kind == "all-gather":
            return all_gather(self.bytes, n, cluster)
        if self.kind == "reduce-scatter":
            return all_gather(self.bytes * n, n, cluster)
        if self.kind == "all-to-all":
            return all_gather(self.bytes, n, cluster)
        if n <= 1:
            return 0.0, 0.0
        return self.bytes / cluster.link_bandwidth + cluster.link_latency, float(self.bytes)


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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["collectives"] = [asdict(c) for c in self.collectives]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompiledFigures:
        d = dict(d)
        d["collectives"] = tuple(Collective(c["kind"], c["bytes"], tuple(c["axes"]),
                                            c["group_size"]) for c in d["collectives"])
        return cls(**d)


# --------------------------------------------------------------------------- HLO parsing
def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = int(np.prod([int(x) for x in dims.split(",") if x], dtype=np.int64)) if dims else 1
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


def _iota_ids(spec: str) -> tuple[np.ndarray, list[int] | None]:
    """XLA's iota device lists: `[G,S]<=[dims]T(perm)` or `[dims]T(perm)` / `[dims]`:
    iota(prod dims) reshaped to dims and transposed, then (first form) reshaped to [G,S]."""
    m = re.match(r"\[([0-9,]+)\](?:<=\[([0-9,]+)\])?(?:T\(([0-9,]+)\))?", spec)
    if not m:
        raise ValueError(f"unrecognised replica_groups {spec!r}")
    first = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")] if m.group(2) else first
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(-1), (first if m.group(2) else None)


def _iota_groups(spec: str) -> list[list[int]]:
    ids, shape = _iota_ids(spec)
    groups = shape[0] if shape else 1
    return ids.reshape(groups, -1).tolist()


def _mesh_groups(spec: str) -> list[list[int]]:
    """`mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'a'}`: groups vary along the listed axes."""
    m = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", spec)
    if not m:
        raise ValueError(f"unrecognised replica_groups {spec!r}")
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    n = int(np.prod(sizes))
    if m.group(2):
        ids = _iota_ids(m.group(2).strip())[0]
    else:
        ids = np.arange(n)
    grid = ids.reshape(sizes)
    varying = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
    fixed = [i for i in range(len(sizes)) if i not in varying]
    grid = grid.transpose(fixed + varying)
    group = int(np.prod([sizes[i] for i in varying])) if varying else 1
    return grid.reshape(-1, group).tolist()


def replica_groups(line: str) -> list[list[int]] | None:
    """The replica groups of one HLO collective instruction (any of XLA's three syntaxes);
    None when the instruction has none (a single group of every device)."""
    m = re.search(r"replica_groups=(\{\{[^=]*?\}\}|\{\}|\[[^\s]*|mesh\[[^{]*\{[^}]*\})", line)
    if m is None:
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}?", line)
        if pairs:
            ids = sorted({int(x) for x in re.findall(r"\d+", pairs.group(1))})
            return [ids]
        return None
    spec = m.group(1)
    if spec.startswith("{{"):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}",
                                                                          spec[1:-1])]
    if spec == "{}":
        return None
    if spec.startswith("mesh"):
        return _mesh_groups(spec)
    return _iota_groups(spec.rstrip(","))


def axes_of(groups: list[list[int]] | None, mesh_shape: tuple[int, int]) -> tuple[str, ...]:
    """The mesh axes a set of groups spans: partition p sits at (p // model, p % model)."""
    d, m = mesh_shape
    if groups is None:
        return tuple(a for a, s in ((DATA, d), (MODEL, m)) if s > 1)
    spans = set()
    for g in groups:
        coords = np.array([(p // m, p % m) for p in g])
        if len(set(coords[:, 0])) > 1:
            spans.add(DATA)
        if len(set(coords[:, 1])) > 1:
            spans.add(MODEL)
    return tuple(a for a in (DATA, MODEL) if a in spans)


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(")
_WHILE = re.compile(r"body=%([\w.\-]+).*?known_trip_count\W+n\W+(\d+)")


def _loop_multipliers(lines: Sequence[str]) -> tuple[list[str], dict[str, int]]:
    """The computation each line belongs to, and how many times a loop body with a known
    trip count runs per step (a micro-batch scan reduces its gradients every iteration)."""
    owner, current = [], ""
    body_of: dict[str, tuple[str, int]] = {}
    for line in lines:
        mc = _COMPUTATION.match(line)
        if mc:
            current = mc.group(1)
        owner.append(current)
        mw = _WHILE.search(line) if " while(" in line else None
        if mw:
            body_of[mw.group(1)] = (current, int(mw.group(2)))

    def times(name: str, depth: int = 0) -> int:
        if name not in body_of or depth > 8:
            return 1
        parent, n = body_of[name]
        return n * times(parent, depth + 1)

    return owner, {name: times(name) for name in body_of}


def parse_collectives(hlo_text: str, mesh_shape: tuple[int, int]) -> list[Collective]:
    """Every collective in an HLO module's text (async `-start` forms counted once), its
    bytes multiplied by the trip count of the loops it sits in."""
    out = []
    n_all = mesh_shape[0] * mesh_shape[1]
    lines = hlo_text.splitlines()
    owner, mult = _loop_multipliers(lines)
    for line, comp in zip(lines, owner, strict=True):
        line = _COMMENT.sub("", line)  # tuple shapes carry /*index=5*/ markers
        mt = _INSTR.search(line)
        if mt is None:
            continue
        shape = mt.group("shape")
        nbytes = _shape_bytes(shape)
        if mt.group("start") and shape.startswith("(") and mt.group("kind") != "all-reduce":
            # async start ops return (operand, result[, ...]): count the result
            parts = _ARRAY.findall(shape)
            if len(parts) >= 2:
                nbytes = _shape_bytes("{}[{}]".format(*parts[1]))
        groups = replica_groups(line)
        size = len(groups[0]) if groups else n_all
        out.append(Collective(mt.group("kind"), nbytes * mult.get(comp, 1),
                              axes_of(groups, mesh_shape), size))
    return out


# --------------------------------------------------------------------------- figures
def compiled_figures(compiled: Any, mesh_shape: tuple[int, int], cluster: Cluster,
                     compile_time_s: float = 0.0, host_resident: float = 0.0
                     ) -> CompiledFigures:
    """Read memory, cost and collectives from a `jax.stages.Compiled`.

    `host_resident` is the per-device bytes the layout keeps in host memory. Where XLA
    reports host memory it is trusted; where it reports none (XLA:CPU compiles memory
    kinds to nothing) those bytes are taken out of the device figure and recorded as
    unverified, since only a backend that honours them can confirm the saving.
    """
    mem = compiled.memory_analysis()
    arg = float(getattr(mem, "argument_size_in_bytes", 0))
    out = float(getattr(mem, "output_size_in_bytes", 0))
    tmp = float(getattr(mem, "temp_size_in_bytes", 0))
    alias = float(getattr(mem, "alias_size_in_bytes", 0))
    host = sum(float(getattr(mem, f"host_{k}_size_in_bytes", 0) or 0)
               for k in ("argument", "output", "temp")) - \
        float(getattr(mem, "host_alias_size_in_bytes", 0) or 0)
    unverified = host_resident if host_resident > 0 and host <= 0 else 0.0
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0] if cost else {}
    cost = cost or {}
    colls = tuple(parse_collectives(compiled.as_text(), mesh_shape))
    comm = sum(c.cost(cluster)[1] for c in colls)
    return CompiledFigures(
        memory_bytes=arg + out + tmp - alias - unverified, argument_bytes=arg, output_bytes=out,
        temp_bytes=tmp, alias_bytes=alias, flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)), comm_bytes=comm,
        collectives=colls, compile_time_s=compile_time_s, host_bytes=host,
        host_unverified_bytes=unverified)


def with_compiled(pred: Prediction, figs: CompiledFigures, cluster: Cluster,
                  batch_size: int) -> Prediction:
    """The same cost model fed XLA's figures: memory is XLA's; compute time scales with
    XLA's flops over the model's; communication is priced from the collectives XLA
    actually inserted (data-axis ones overlap backward compute, the rest block)."""
    counted = pred.flops_as_xla_counts
    scale = figs.flops / counted if counted > 0 and figs.flops > 0 else 1.0
    compute = pred.compute_time_s * scale
    busy = pred.busy_time_s * scale
    overlappable = blocking = 0.0
    for c in figs.collectives:
        t = c.cost(cluster)[0]
        if c.axes == (DATA,):
            overlappable += t
        else:
            blocking += t
    exposed = max(overlappable - BACKWARD_SHARE * pred.batched_time_s * scale, 0.0)
    # host transfers of offloaded state are not collectives: the model's figure stands
    host = pred.host_transfer_time_s / 2
    exposed += host_exposed(host, pred.batched_time_s * scale)
    return assemble(cluster, pred.num_devices, batch_size, compute=compute, busy=busy,
                    blocking=blocking, grad_comm=overlappable, exposed=exposed,
                    comm_bytes=figs.comm_bytes, memory=figs.memory_bytes,
                    flops=figs.flops / pred.loop_flops_ratio,
                    batched_time=pred.batched_time_s * scale,
                    host_transfer=pred.host_transfer_time_s,
                    loop_flops_ratio=pred.loop_flops_ratio)


__all__ = ["Collective", "CompiledFigures", "compiled_figures", "parse_collectives",
           "replica_groups", "with_compiled"]


# --------------------------------------------------------------------------- the stage
@dataclass(frozen=True)
class Verification:
    """What compiling the finalists showed. `figures`/`predictions` are keyed by candidate
    index; `failed` holds candidates whose compile raised, with the error; `scores` are
    the objective's scores, on verified predictions for the verified candidates that fit."""

    best: int
    scores: tuple[float, ...]
    figures: dict[int, CompiledFigures]
    predictions: dict[int, Prediction]
    failed: dict[int, str]
    compiled_best: Any
    verify_time_s: float


def run_verification(fn: Any, layout: Any, result: Any, cluster: Cluster, objective: Any,
                     budget: float, devices: Sequence[Any], k: int, batch_size: int, *,
                     donate: bool = True, compiler_options: dict[str, Any] | None = None,
                     compile_candidate: Any = None) -> Verification:
    """Compile candidates in the order the analytic search ranks them until `k` of them
    fit by XLA's memory analysis; choose among those on the model fed XLA's figures.

    `compile_candidate(mesh_result) -> (CompiledFigures, compiled step or None)` replaces
    the compile (benchmarks replay figures they compiled once)."""
    import time

    from .compile import compile_layout, host_resident_bytes
    from .solve import uses_model_axis

    def compile_here(r: Any) -> tuple[CompiledFigures, Any]:
        cs = compile_layout(fn, layout, r.d, r.m, r.strategies, devices,
                            donate=donate, compiler_options=compiler_options)
        host = host_resident_bytes(layout, r.strategies, r.d, r.m, donate)
        return compiled_figures(cs.compiled, (r.d, r.m), cluster, cs.compile_time_s,
                                host), cs

    compile_candidate = compile_candidate or compile_here

    t0 = time.perf_counter()
    order = sorted((i for i, r in enumerate(result.results)
                    if uses_model_axis(r) and result.scores[i] != float("inf")),
                   key=lambda i: (result.scores[i], result.results[i].predicted.step_time_s))
    figures: dict[int, CompiledFigures] = {}
    preds: dict[int, Prediction] = {}
    failed: dict[int, str] = {}
    steps: dict[int, Any] = {}
    fitting: list[int] = []
    # the data-parallel baseline whatever its rank, then the analytic ranking until k of
    # the others fit
    baseline = getattr(result, "baseline", -1)
    queue = ([baseline] if baseline in order else []) + [i for i in order if i != baseline]
    for i in queue:
        if sum(1 for j in fitting if j != baseline) >= k:
            break
        r = result.results[i]
        try:
            figs, cs = compile_candidate(r)
        except Exception as e:  # noqa: BLE001 - XLA refusing a candidate is a verdict on it
            failed[i] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        figures[i] = figs
        preds[i] = with_compiled(r.predicted, figs, cluster, batch_size)
        if figs.memory_bytes <= budget:
            fitting.append(i)
            steps[i] = cs
    scores = [float("inf")] * len(result.results)
    if fitting:
        vs = objective.scores([preds[i] for i in fitting], max_watts=cluster.device.max_watts,
                              num_devices_available=cluster.num_devices)
        for i, s in zip(fitting, vs, strict=True):
            scores[i] = s
        best = min(fitting, key=lambda i: (scores[i], preds[i].step_time_s,
                                           result.results[i].d * result.results[i].m))
    else:
        best = -1
    return Verification(best, tuple(scores), figures, preds, failed, steps.get(best),
                        time.perf_counter() - t0)
