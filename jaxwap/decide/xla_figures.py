"""Reading XLA's verdict: per-device figures of a compiled step.

After SPMD partitioning XLA knows, per device, what a sharded program costs:
`Compiled.memory_analysis()` (argument, output, temp and aliased bytes),
`Compiled.cost_analysis()` (flops, bytes accessed) and, in `Compiled.as_text()`, every
collective the partitioner inserted (there is no communication field, so the HLO text is
parsed: each collective's result shape gives its bytes, its replica groups the mesh axes
it spans, and the loops it sits in how often it runs per step).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxwap.core.records import DATA, MODEL, REPLICA, STAGE, Collective, CompiledFigures
from jaxwap.cost.collectives import collective_cost
from jaxwap.hardware.cluster import Cluster

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_INSTR = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\(")
_COMMENT = re.compile(r"/\*.*?\*/")
# calls into a vendor library (cuBLAS matmuls, cuDNN convolutions): XLA's cost analysis
# gives them no flops
_LIBRARY_CALL = re.compile(r'custom_call_target="(__cu(?:blas|dnn)[^"]*)"')
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


# --------------------------------------------------------------------------- HLO parsing
def library_calls(text: str) -> dict[str, int]:
    """{target: count} of the program's calls into a vendor library (XLA:GPU's cuBLAS
    matmuls and cuDNN convolutions). `Compiled.cost_analysis()` counts no flops for them:
    on an H200 it gave AlexNet's step 2.5e10 flops of the 7.8e11 its convolutions and
    matmuls do, GPT-2's 2.5e12 of 7.0e12 (`benchmarks/gpu/gpu_sweep.py`, 2026-11-26)."""
    out: dict[str, int] = {}
    for target in _LIBRARY_CALL.findall(text):
        out[target] = out.get(target, 0) + 1
    return out


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = int(np.prod([int(x) for x in dims.split(",") if x], dtype=np.int64)) if dims else 1
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


_NAMED = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+[\w\-]+\((.*)$")


def operation_bytes(hlo_text: str) -> dict[str, int]:
    """{instruction: bytes} each instruction of the program reads and writes as a kernel
    of its own: its result's and its operands' (by their results' shapes). An XLA:CPU
    operation event carries its instruction's name, so this gives each operation's
    bandwidth in a profile (`benchmarks/accuracy/op_profile.py`)."""
    shapes, operands = {}, {}
    for line in hlo_text.splitlines():
        m = _NAMED.match(_COMMENT.sub("", line))
        if m:
            shapes[m.group(1)] = _shape_bytes(m.group(2))
            operands[m.group(1)] = re.findall(r"%([\w.\-]+)", m.group(3).split("calls=")[0])
    return {name: shapes[name] + sum(shapes.get(a, 0) for a in args)
            for name, args in operands.items()}


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


def axes_of(groups: list[list[int]] | None, mesh_shape: tuple[int, int],
            r: int = 1, stages: int = 1) -> tuple[str, ...]:
    """The mesh axes a set of groups spans: partition p sits at (p // model, p % model),
    and with r replicas the data index p // model at (replica, data) = divmod(it, d/r);
    a pipeline's stage index is outermost, p // (d * m)."""
    d, m = mesh_shape
    di = d // r
    sizes = ((STAGE, stages), (REPLICA, r), (DATA, di), (MODEL, m))
    if groups is None:
        return tuple(a for a, s in sizes if s > 1)
    spans = set()
    for g in groups:
        coords = np.array([(p // (d * m), p // m // di % r, p // m % di, p % m) for p in g])
        for k, (axis, _) in enumerate(sizes):
            if len(set(coords[:, k])) > 1:
                spans.add(axis)
    return tuple(a for a, _ in sizes if a in spans)


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(")
_WHILE = re.compile(r"body=%([\w.\-]+).*?known_trip_count\W+n\W+(\d+)")


def _owners(lines: Sequence[str]) -> list[str]:
    """The computation each line of an HLO module's text belongs to (its header's too)."""
    owner, current = [], ""
    for line in lines:
        mc = _COMPUTATION.match(line)
        if mc:
            current = mc.group(1)
        owner.append(current)
    return owner


def computations(hlo_text: str) -> dict[str, list[str]]:
    """Each computation of an HLO module's text (a fusion's, the entry's) -> its lines,
    the header's first."""
    lines = hlo_text.splitlines()
    out: dict[str, list[str]] = {}
    for line, comp in zip(lines, _owners(lines), strict=True):
        if comp:
            out.setdefault(comp, []).append(line)
    return out


def _loop_multipliers(lines: Sequence[str]) -> tuple[list[str], dict[str, int]]:
    """The computation each line belongs to, and how many times a loop body with a known
    trip count runs per step (a micro-batch scan reduces its gradients every iteration)."""
    owner = _owners(lines)
    body_of: dict[str, tuple[str, int]] = {}
    for line, current in zip(lines, owner, strict=True):
        mw = _WHILE.search(line) if " while(" in line else None
        if mw:
            body_of[mw.group(1)] = (current, int(mw.group(2)))

    def times(name: str, depth: int = 0) -> int:
        if name not in body_of or depth > 8:
            return 1
        parent, n = body_of[name]
        return n * times(parent, depth + 1)

    return owner, {name: times(name) for name in body_of}


def parse_collectives(hlo_text: str, mesh_shape: tuple[int, int],
                      r: int = 1, stages: int = 1) -> list[Collective]:
    """Every collective in an HLO module's text (async `-start` forms counted once), its
    bytes multiplied by the trip count of the loops it sits in; the mesh axes each spans
    on a (d, m) mesh of r replicas (`axes_of`)."""
    out = []
    n_all = mesh_shape[0] * mesh_shape[1] * stages
    lines = hlo_text.splitlines()
    owner, mult = _loop_multipliers(lines)
    for line, comp in zip(lines, owner, strict=True):
        line = _COMMENT.sub("", line)  # tuple shapes carry /*index=5*/ markers
        mt = _INSTR.search(line)
        if mt is None:
            continue
        shape = mt.group("shape")
        nbytes = _shape_bytes(shape)
        buffers = max(len(_ARRAY.findall(shape)), 1)
        if mt.group("start") and shape.startswith("(") and mt.group("kind") != "all-reduce":
            # async start ops return (operand, result[, ...]): count the result
            parts = _ARRAY.findall(shape)
            if len(parts) >= 2:
                nbytes = _shape_bytes("{}[{}]".format(*parts[1]))
                buffers = 1
        groups = replica_groups(line)
        size = len(groups[0]) if groups else n_all
        out.append(Collective(mt.group("kind"), nbytes * mult.get(comp, 1),
                              axes_of(groups, mesh_shape, r, stages), size,
                              buffers * mult.get(comp, 1)))
    return out


_OP = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<dtype>[a-z][a-z0-9]*)"
                 r"\[(?P<dims>[0-9,]*)\](?:\{(?P<layout>[0-9,]*)[^}]*\})?\s+"
                 r"(?P<op>[\w\-]+)\(%(?P<arg>[\w.\-]+)(?P<rest>.*)$")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_PERM = re.compile(r"dimensions=\{([0-9,]*)\}")


def _physical(dims: Sequence[int], layout: Sequence[int]) -> list[int]:
    """The dims of an array from major to minor in memory, size-1 dims left out."""
    return [j for j in reversed(layout) if dims[j] != 1]


def layout_changes(hlo_text: str) -> tuple[tuple[float, int], ...]:
    """((array bytes, times per step), ...) of every array XLA's layout assignment makes
    the program move into another layout: each `transpose` that is not a bitcast and each
    `copy` between layouts, in the entry and in the fusions it calls (where XLA:CPU's loop
    reads one side across rows), run as often as the loops they sit in. The model's own
    roofline cannot see them (they follow from XLA's layout choices), and a backend
    without a tiled transpose runs the large ones far below its memory bandwidth
    (`DeviceSpec.layout_change_cost`)."""
    lines = [_COMMENT.sub("", line) for line in hlo_text.splitlines()]
    owner, mult = _loop_multipliers(lines)
    caller: dict[str, str] = {}
    shapes: dict[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...] | None]] = {}
    ops = []
    for line, comp in zip(lines, owner, strict=True):
        m = _OP.match(line)
        if m is None:
            continue
        dims = tuple(int(x) for x in m["dims"].split(",") if x)
        layout = tuple(int(x) for x in m["layout"].split(",") if x) if m["layout"] else None
        shapes[(comp, m["name"])] = (dims, layout)
        for called in _CALLS.findall(m["rest"]):
            caller[called] = comp
        if m["op"] in ("transpose", "copy") and layout is not None and len(dims) > 1:
            ops.append((comp, m, dims, layout))
    out: dict[tuple[float, int], int] = {}
    for comp, m, dims, layout in ops:
        src_dims, src_layout = shapes.get((comp, m["arg"]), ((), None))
        if src_layout is None or len(src_dims) != len(dims):
            continue
        out_order = _physical(dims, layout)
        if m["op"] == "transpose":
            pm = _PERM.search(m["rest"])
            if pm is None:
                continue
            perm = [int(x) for x in pm.group(1).split(",") if x]
            out_order = [perm[j] for j in out_order]
        if out_order == _physical(src_dims, src_layout):
            continue   # a bitcast: the same bytes in the same order
        key = (float(np.prod(dims)) * _DTYPE_BYTES.get(m["dtype"], 4),
               mult.get(comp, mult.get(caller.get(comp, ""), 1)))
        out[key] = out.get(key, 0) + 1
    return tuple(sorted((b, t * k) for (b, t), k in out.items()))


def compiled_figures(compiled: Any, mesh_shape: tuple[int, int], cluster: Cluster,
                     compile_time_s: float = 0.0, host_resident: float = 0.0, r: int = 1,
                     stages: int = 1) -> CompiledFigures:
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
    text = compiled.as_text()   # megabytes for a large step: read once
    colls = tuple(parse_collectives(text, mesh_shape, r, stages))
    comm = sum(collective_cost(c, cluster, *mesh_shape, r=r)[1] for c in colls)
    return CompiledFigures(
        memory_bytes=arg + out + tmp - alias - unverified, argument_bytes=arg, output_bytes=out,
        temp_bytes=tmp, alias_bytes=alias, flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)), comm_bytes=comm,
        collectives=colls, compile_time_s=compile_time_s, host_bytes=host,
        host_unverified_bytes=unverified,
        layout_changes=layout_changes(text), library_calls=sum(library_calls(text).values()))


__all__ = ["axes_of", "compiled_figures", "computations", "layout_changes", "library_calls",
           "operation_bytes", "parse_collectives", "replica_groups"]
