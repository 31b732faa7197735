"""Clusters: what the cost model knows about the devices a step runs on together.

A plan is a prediction, so the hardware it is made for must be explicit. A `Cluster` is
N devices (each a `device.DeviceSpec`) in nodes, joined by links of a
given bandwidth and latency. Planning for hardware that is not present is a feature:
tests ask what the planner would choose on 8 H100s while the chosen mesh still runs on
simulated CPU devices. `detect_cluster` builds the cluster of the devices jax sees.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxwap.core.objective import Objective, Ranking
from jaxwap.core.units import si
from jaxwap.hardware.builtin_profiles import (
    BUILTIN_PROFILES,
    KIND_PATTERNS,
    device_spec,
)
from jaxwap.hardware.device import DeviceSpec

if TYPE_CHECKING:  # the record imports this module (builtin_for_kind)
    from jaxwap.hardware.calibration import Calibration

# the kinds of memory-side work `HostMemory` keeps a slowdown for (its fields, in order)
HOST_KINDS = ("stream", "layout", "fresh")


@dataclass(frozen=True)
class HostMemory:
    """What `devices` devices in a row (processes of one host, a device each) do to each
    other's memory-side work when all of them run it at once: each kind takes that many
    times as long as one device alone (`jaxwap.calibrate` times each alone, in turn, and
    all at once on a CPU cluster): `stream`, an elementwise op at the bandwidth (and
    reductions); `layout`, a transposing one (layout changes); `fresh`, one writing a
    fresh output (scratch memory whose pages the OS maps). Accelerators' memories are
    their own: no record. With j of them at once each kind takes max(1, j x slowdown /
    devices) times as long: a shared resource whose whole is devices / slowdown devices'
    worth."""

    devices: int
    stream: float
    layout: float
    fresh: float

    def __post_init__(self) -> None:
        if not _is_int(self.devices) or self.devices < 1:
            raise ValueError(f"HostMemory devices must be a positive int, got {self.devices!r}")
        for kind in HOST_KINDS:
            v = getattr(self, kind)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
                    or not 1.0 <= v < np.inf:
                raise ValueError(f"HostMemory {kind} slowdown must be a finite number >= 1, "
                                 f"got {v!r}")

    def slowdown(self, kind: str, n: int) -> float:
        """How many times as long `kind` work takes on each of a mesh of n devices (one
        alone: 1, as measured, whatever the slowdown of all of them)."""
        if n <= 1:
            return 1.0
        return max(1.0, min(n, self.devices) * float(getattr(self, kind)) / self.devices)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostMemory:
        """From its record, or a calibration's `host_memory` (which keeps more)."""
        return cls(int(d["devices"]), *(float(d[kind]) for kind in HOST_KINDS))


@dataclass(frozen=True)
class Cluster:
    """N identical devices, in nodes, joined by links.

    `link_bandwidth` is bytes/s per device per direction (what one ring step moves) over
    the links inside a node; `link_latency` is seconds per ring step on them. Both default
    to the device profile's own peer link (NVLink for SXM parts), so `Cluster("h100-sxm",
    8)` is an HGX box and `Cluster("h100-sxm", 8, link_bandwidth=25e9)` the same GPUs on
    PCIe.

    `devices_per_node` groups the devices into nodes of that many (None: one flat domain,
    every pair joined by the links above). Between nodes a device reaches
    `inter_node_bandwidth` bytes/s per direction (its share of the node's network
    adapters: 400 Gb/s InfiniBand per GPU is 50e9) with `inter_node_latency` per step;
    both default to the profile's `network_bandwidth` / `network_latency_s`. Devices are
    numbered node by node: devices i*devices_per_node .. (i+1)*devices_per_node-1 share
    node i, as `jax.devices()` orders them process by process.

    `shared_compute=True` says the devices are slices of one pool (simulated CPU devices
    on one host): a mesh of n of them runs at `num_devices / n` times the per-device
    figures, since the devices left out leave their share to those used.

    `host_memory` says how devices that share a host's memory slow each other's
    memory-side work (`HostMemory`; None where each device has memory of its own, as
    accelerators' HBM). A mesh of n devices prices its work on `co_running(n)`.
    """

    device: DeviceSpec
    num_devices: int
    link_bandwidth: float
    link_latency: float
    shared_compute: bool
    devices_per_node: int | None
    inter_node_bandwidth: float
    inter_node_latency: float
    host_memory: HostMemory | None

    def __init__(self, device: str | DeviceSpec, num_devices: int,
                 link_bandwidth: float | None = None,
                 link_latency: float | None = None, shared_compute: bool = False, *,
                 devices_per_node: int | None = None,
                 inter_node_bandwidth: float | None = None,
                 inter_node_latency: float | None = None,
                 host_memory: HostMemory | None = None) -> None:
        spec = device_spec(device)
        if not _is_int(num_devices) or num_devices < 1:
            raise ValueError(f"Cluster num_devices must be a positive int, got {num_devices!r}")
        if devices_per_node is not None:
            if not _is_int(devices_per_node) or devices_per_node < 1:
                raise ValueError(f"Cluster devices_per_node must be a positive int or None, "
                                 f"got {devices_per_node!r}")
            if num_devices % devices_per_node:
                raise ValueError(f"Cluster devices_per_node={devices_per_node} does not divide "
                                 f"num_devices={num_devices}: nodes must be whole")
        if host_memory is not None and not isinstance(host_memory, HostMemory):
            raise ValueError(f"Cluster host_memory must be a HostMemory or None, got "
                             f"{host_memory!r}")
        figures = (("link_bandwidth", link_bandwidth, spec.link_bandwidth, True),
                   ("link_latency", link_latency, spec.link_latency_s, False),
                   ("inter_node_bandwidth", inter_node_bandwidth, spec.network_bandwidth, True),
                   ("inter_node_latency", inter_node_latency, spec.network_latency_s, False))
        for name, given, default, strict in figures:
            v = default if given is None else given
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
                    or not (v > 0 if strict else v >= 0) or not np.isfinite(v):
                raise ValueError(f"Cluster {name} must be a finite number "
                                 f"{'> 0' if strict else '>= 0'}, got {v!r}")
            object.__setattr__(self, name, float(v))
        object.__setattr__(self, "device", spec)
        object.__setattr__(self, "num_devices", int(num_devices))
        object.__setattr__(self, "shared_compute", bool(shared_compute))
        object.__setattr__(self, "devices_per_node",
                           None if devices_per_node is None else int(devices_per_node))
        object.__setattr__(self, "host_memory", host_memory)

    @property
    def num_nodes(self) -> int:
        return 1 if self.devices_per_node is None else self.num_devices // self.devices_per_node

    @property
    def node_size(self) -> int:
        """Devices that share one node's links (all of them in a flat cluster)."""
        return self.num_devices if self.devices_per_node is None else self.devices_per_node

    @property
    def mesh_node_size(self) -> int | None:
        """The node size a mesh's model axis must stay inside (`meshes.mesh_shapes`), or
        None for a cluster of one node, whose every axis stays inside it."""
        return self.node_size if self.num_nodes > 1 else None

    def devices_in_node(self, size: int, stride: int = 1) -> int:
        """Of a group of `size` devices `stride` apart in the device numbering (a mesh
        axis: the last axis has stride 1, the one before it the last axis's size), how
        many share a node; `size` when the group never leaves one."""
        node = self.node_size
        if size * stride <= node:
            return size
        return max(1, min(size, node // stride))

    def speedup_when_using(self, n: int) -> float:
        """How much faster each device runs when a mesh uses n of them (see shared_compute)."""
        return self.num_devices / n if self.shared_compute else 1.0

    def ranker(self, objective: Objective) -> Callable[[Sequence[Any]], Ranking]:
        """`objective.rank` bound to this cluster: the balanced score weighs a step's time by
        the power of every device it could use (`max_watts` x the devices here), so every
        ranking of one plan (search, pipelines, verification) must pass the same two
        figures; binding them here builds them once."""
        return functools.partial(objective.rank, max_watts=self.device.max_watts,
                                 num_devices_available=self.num_devices)

    def co_running(self, n: int) -> Cluster:
        """This cluster as a mesh of n of its devices sees it, running together: its
        device's memory-side figures slowed as `host_memory` says (the bandwidth and
        reductions as streaming work, layout changes as transposing work, fresh memory as
        such); itself where nothing is shared or nothing slows."""
        host, dev = self.host_memory, self.device
        if host is None:
            return self
        stream, layout, fresh = (host.slowdown(k, n) for k in HOST_KINDS)
        if stream == layout == fresh == 1.0:
            return self

        def slowed(table: tuple[tuple[float, float], ...], by: float
                   ) -> tuple[tuple[float, float], ...]:
            return tuple((b, c * by) for b, c in table)

        spec = dataclasses.replace(
            dev, memory_bandwidth=dev.memory_bandwidth / stream,
            reduction_cost=slowed(dev.reduction_cost, stream),
            layout_change_cost=slowed(dev.layout_change_cost, layout),
            fresh_memory_cost=slowed(dev.fresh_memory_cost, fresh))
        return dataclasses.replace(self, device=spec, host_memory=None)

    def describe_links(self) -> str:
        """The links in words, for `explain()`."""
        inside = f"links {si(self.link_bandwidth, 'B/s')} / {self.link_latency * 1e6:.1f} us"
        if self.num_nodes <= 1:
            return inside
        return (f"{self.num_nodes} nodes of {self.devices_per_node}: {inside} inside a node, "
                f"{si(self.inter_node_bandwidth, 'B/s')} / "
                f"{self.inter_node_latency * 1e6:.1f} us per device between nodes")

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device.to_dict(), "num_devices": self.num_devices,
                "link_bandwidth": self.link_bandwidth, "link_latency": self.link_latency,
                "shared_compute": self.shared_compute,
                "devices_per_node": self.devices_per_node,
                "inter_node_bandwidth": self.inter_node_bandwidth,
                "inter_node_latency": self.inter_node_latency,
                # only where set: records and cache keys of other clusters stay as they were
                **({"host_memory": self.host_memory.to_dict()} if self.host_memory else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        return cls(DeviceSpec.from_dict(d["device"]), d["num_devices"],
                   d["link_bandwidth"], d["link_latency"], d.get("shared_compute", False),
                   devices_per_node=d.get("devices_per_node"),
                   inter_node_bandwidth=d.get("inter_node_bandwidth"),
                   inter_node_latency=d.get("inter_node_latency"),
                   host_memory=HostMemory.from_dict(d["host_memory"]) if d.get("host_memory")
                   else None)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def builtin_for_kind(kind: str, platform: str) -> DeviceSpec:
    """The built-in profile for a jax `device_kind` (a generic one, with a warning, when
    the kind is unknown)."""
    low = kind.lower()
    name = next((prof for pat, prof in KIND_PATTERNS if pat in low), None)
    if name is None and platform == "cpu":
        name = "cpu"
    if name is None:
        name = "h100-sxm" if platform == "gpu" else "cpu"
        warnings.warn(f"device kind {kind!r} has no built-in profile; planning with {name!r}. "
                      f"Run `jaxwap calibrate`, or pass hardware=jaxwap.Cluster("
                      f"jaxwap.DeviceSpec(...), n) for real figures.", stacklevel=3)
    return BUILTIN_PROFILES[name]


def detect_cluster(devices: Sequence[Any], calibration: Calibration | None = None
                   ) -> tuple[Cluster, str | None]:
    """The profile of the devices found: their `calibration` when the caller has one (the
    planner loads the one `jaxwap calibrate` cached for this device kind, driver and jax
    version), else the built-in profile; and a note saying which.

    Devices must be of one kind: a plan over mixed kinds would need a per-device model
    that v1 does not have, so that is an error rather than a silent average.
    """
    kinds = {d.device_kind for d in devices}
    if len(kinds) != 1:
        raise ValueError(f"devices of several kinds {sorted(kinds)}: jaxwap plans over "
                         f"one kind; pass devices= of one kind")
    kind = kinds.pop()
    platform = devices[0].platform
    cal = calibration
    note = None
    if cal is not None:
        spec = cal.spec
        note = f"profile calibrated on {cal.num_devices} x {cal.device_kind}"
    else:
        spec = builtin_for_kind(kind, platform)
        note = (f"device kind {kind!r}: built-in profile {spec.name!r}, not calibrated: "
                f"`jaxwap calibrate` measures this machine once, and every later plan "
                f"uses its figures")
    memory = device_memory_limit(devices[0])
    if memory is not None:
        spec = dataclasses.replace(spec, memory_bytes=float(memory))
    nodes = _process_nodes(devices, spec, cal)
    if platform == "cpu":
        # devices of one process share its host's cores; processes pinned to their own
        # cores (one device each) are separate machines as far as compute goes
        local = sum(1 for d in devices if d.process_index == devices[0].process_index)
        spec = _host_share(spec, devices, calibrated=cal is not None)
        # processes of one host share its memory: what the calibration measured of it
        host = cal.measurements.get("host_memory") if cal is not None else None
        return Cluster(spec, len(devices), nodes.get("link_bandwidth"),
                       nodes.get("link_latency"), shared_compute=local > 1,
                       host_memory=HostMemory.from_dict(host) if host else None,
                       **{k: v for k, v in nodes.items() if not k.startswith("link")}), note
    return Cluster(spec, len(devices), nodes.get("link_bandwidth"), nodes.get("link_latency"),
                   **{k: v for k, v in nodes.items() if not k.startswith("link")}), note


def _process_nodes(devices: Sequence[Any], spec: DeviceSpec,
                   cal: Calibration | None) -> dict[str, Any]:
    """With several processes, each process's devices are a node: devices_per_node from
    the process layout (when every process has as many), and the links between processes
    are the network. A calibration run across processes timed those links, so its link
    figures are the inter-node ones and the links inside a process are the built-in
    profile's. One process: nothing to add (one flat domain)."""
    counts: dict[int, int] = {}
    for d in devices:
        counts[d.process_index] = counts.get(d.process_index, 0) + 1
    if len(counts) <= 1 or len(set(counts.values())) != 1:
        return {}
    out: dict[str, Any] = {"devices_per_node": next(iter(counts.values()))}
    if cal is not None and cal.num_processes > 1:
        base = builtin_for_kind(cal.device_kind, cal.platform)
        out.update(inter_node_bandwidth=spec.link_bandwidth,
                   inter_node_latency=spec.link_latency_s,
                   link_bandwidth=base.link_bandwidth, link_latency=base.link_latency_s)
    return out


def _host_share(spec: DeviceSpec, devices: Sequence[Any], calibrated: bool = False
                ) -> DeviceSpec:
    """CPU devices of one process share the host's cores and memory bus: with 8 simulated
    devices on 2 cores each device holds a quarter core when all run, and one device alone
    gets both cores (XLA's CPU thread pool is shared). More devices add no compute, and
    the plan says so instead of promising a speed-up the host cannot give."""
    import os

    local = sum(1 for d in devices if d.process_index == devices[0].process_index)
    cores = host_cores()
    # the built-in profile is one core; a calibration measured one device alone, which
    # XLA runs on the whole host
    share = (1.0 if calibrated else cores) / max(local, 1)
    try:
        host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: keep the profile's figure
        host_memory = spec.memory_bytes * max(local, 1)
    return dataclasses.replace(
        spec, name=f"{spec.name} ({cores} cores / {local} devices)",
        peak_flops=spec.peak_flops * share,
        peak_flops_f32=(spec.peak_flops_f32 or spec.peak_flops) * share,
        memory_bandwidth=spec.memory_bandwidth * share, max_watts=spec.max_watts * share,
        small_input_conv_flops=None if spec.small_input_conv_flops is None
        else spec.small_input_conv_flops * share,
        small_input_conv_rates=tuple((w, r * share) for w, r in spec.small_input_conv_rates),
        layout_change_cost=tuple((b, c / share) for b, c in spec.layout_change_cost),
        reduction_cost=tuple((b, c / share) for b, c in spec.reduction_cost),
        conv_overhead_s=spec.conv_overhead_s / share,
        transcendental_s=spec.transcendental_s / share,
        # fresh pages are faulted in by the process's one allocator: a per-byte cost, and
        # a device's scratch is its own, so it is not shared out
        memory_bytes=float(host_memory) / max(local, 1),
        idle_watts=spec.idle_watts * share,
        # the efficiency curve's knee is a time (its flops over the peak): a share of the
        # host's peak reaches it at that share of the flops
        efficiency_half_flops=(spec.efficiency_half_flops or 0.0) * share)


def host_cores() -> int:
    """The cores this process may run on, which XLA's CPU thread pool sizes itself by (a
    process pinned with taskset gets the pinned cores, not the machine's). One function,
    so that the one figure of the CPU profile that depends on the machine can be set by a
    test that asserts a CPU decision for another core count."""
    import os

    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def device_memory_limit(device: Any) -> int | None:
    """The device's own memory limit where JAX exposes it (GPU/TPU), else None."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - CPU and some plugins raise; the profile then decides
        return None
    if not stats:
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


__all__ = ["HOST_KINDS", "Cluster", "HostMemory", "builtin_for_kind", "detect_cluster",
           "device_memory_limit", "host_cores"]
