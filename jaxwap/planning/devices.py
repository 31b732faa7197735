"""What a plan is made for: the cluster, how many of its devices the plan may use, and the
memory budget per device.

The hardware is the one given or the devices found; the devices usable are those present,
unless the plan is asked for a described cluster larger than this host
(`jaxwap.plan(..., hardware=Cluster("h100-sxm", 4096, ...))`), which is then planned
analytically; the budget is the one given, else the device's memory less a headroom. The
planner (`planner.make_plan`) settles these before it traces the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxwap.calibration.store import load_calibration
from jaxwap.hardware.cluster import Cluster, detect_cluster, device_memory_limit
from jaxwap.hardware.device import DeviceSpec
from jaxwap.options import PlanOptions

# Share of device memory kept free for XLA's workspace, fragmentation and the runtime.
MEMORY_HEADROOM = 0.10


def resolve_cluster(hardware: Cluster | DeviceSpec | str | None,
                    devices: Sequence[Any]) -> tuple[Cluster, str | None]:
    """The hardware to plan for: as given (a Cluster, or a DeviceSpec or profile name for
    one of each device; `PlanOptions` has checked the type), or the devices found (with
    their calibration, when `jaxwap calibrate` cached one for them)."""
    if hardware is None:
        return detect_cluster(devices, load_calibration(devices[0]))
    if isinstance(hardware, Cluster):
        return hardware, None
    return Cluster(hardware, len(devices)), None


def usable_devices(cluster: Cluster, present: int, for_hardware: bool, options: PlanOptions,
                   notes: list[str]) -> tuple[int, bool, PlanOptions]:
    """(devices the plan may use, whether they are the cluster's described devices rather
    than those present, the options to plan with), saying why in `notes`.

    The devices present, unless `for_hardware` and the cluster describes more: then the
    plan is for the described cluster, analytic, since verification compiles on the
    devices themselves (verification is switched off). A `num_devices` or `mesh_shape`
    asking for more than that is the user's error, raised here before anything is traced.
    """
    described = for_hardware and cluster.num_devices > present
    usable = cluster.num_devices if described else min(cluster.num_devices, present)
    if described:
        notes.append(f"planned for the {cluster.num_devices} devices the hardware describes, "
                     f"of which {present} are present: the plan is analytic (predicted), "
                     f"since verification compiles on the devices themselves")
        if options.verify:
            options = dataclasses.replace(options, verify=0)
    elif cluster.num_devices > present:
        notes.append(f"the hardware profile has {cluster.num_devices} devices but only "
                     f"{present} are present; planned for the {present} present")
    if options.num_devices is not None and not 1 <= options.num_devices <= usable:
        raise ValueError(f"num_devices={options.num_devices} is outside 1..{usable} "
                         f"(devices usable)")
    if options.mesh is not None and options.mesh[0] * options.mesh[1] > usable:
        raise ValueError(f"mesh_shape={dict(options.mesh_shape)} needs "
                         f"{options.mesh[0] * options.mesh[1]} devices; {usable} are usable")
    return usable, described, options


def memory_budget(options: PlanOptions, cluster: Cluster, device: Any | None) -> float:
    """Bytes per device a plan may use: as given, else the profile's memory or the present
    devices' own limit where JAX exposes it (`memory_stats()["bytes_limit"]`) and it is
    smaller (`device` None: planning for devices not present, the profile alone), less the
    headroom."""
    if options.memory_budget is not None:
        return options.memory_budget
    limit = None if device is None else device_memory_limit(device)
    memory = cluster.device.memory_bytes if limit is None else \
        min(cluster.device.memory_bytes, float(limit))
    return memory * (1 - MEMORY_HEADROOM)


def node_major(devices: Sequence[Any]) -> tuple[Any, ...]:
    """Devices numbered node by node (a process's devices are a node), as `Cluster` and
    `compile.make_mesh` lay meshes out: a mesh's innermost (model) axis then takes
    devices of one node, the data axis spans the nodes."""
    return tuple(sorted(devices, key=lambda d: (d.process_index, d.id)))


__all__ = ["MEMORY_HEADROOM", "memory_budget", "node_major", "resolve_cluster",
           "usable_devices"]
