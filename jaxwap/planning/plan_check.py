"""Whether a plan made elsewhere can run here: one given with `plan=`, or one read back
from the plan cache.

Neither was searched for these devices and this step in this process, so neither is
trusted: a plan is checked against the devices present (its mesh needs no more than
there are, its device ids are theirs), the step's parameters (the same paths, shapes and
dtypes, each spec one entry per dim over the plan's own mesh axes, every split dim
divisible by its axes), the batch it was made for, and the options that fix a layout
(`mesh_shape=`, `num_devices=`). A cache key covers all of these, so a valid entry always
passes; a file edited by hand, copied from another machine or written by a bug does not,
and then costs one planning instead of an error on every call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jaxwap.analysis.trace import ArgLayout
from jaxwap.core.records import DATA, MODEL, REPLICA, STAGE, mesh_dims
from jaxwap.core.units import named_mesh
from jaxwap.options import PlanOptions
from jaxwap.plans.plan import Plan

_AXES = (STAGE, REPLICA, DATA, MODEL)


def plan_mismatch(plan: Plan, layout: ArgLayout, devices: Sequence[Any], usable: int,
                  options: PlanOptions, same_devices: bool = True) -> str | None:
    """Why `plan` cannot run this step (its arguments as `layout` holds them) on
    `devices` under `options` (None: it can). `usable`: the devices a plan may use.
    `same_devices`: the plan names these very devices (a cache entry made here), so its
    device ids must be theirs; a plan made ahead of time for a cluster numbers its own
    devices, and only its size is checked."""
    shape = dict(plan.mesh_shape)
    unknown = sorted(set(shape) - set(_AXES))
    if unknown:
        return f"its mesh names axes {unknown}, which jaxwap's meshes do not have {_AXES}"
    if any(not isinstance(s, int) or s < 1 for s in shape.values()):
        return f"its mesh {shape} has an axis size that is not a positive integer"
    n = plan.num_devices
    if n > usable:
        return (f"its mesh {named_mesh(shape.items())} needs {n} devices, but {usable} are usable "
                f"here")
    if same_devices and n <= len(devices):
        ids = [d.id for d in devices[:n]]
        if list(plan.device_ids) != ids:
            return (f"it runs on device ids {_ids(plan.device_ids)}, but the first {n} "
                    f"devices here are {_ids(ids)}")
    mine = [(p.path, tuple(p.shape), str(p.dtype)) for p in layout.params]
    theirs = [(tuple(p.path), tuple(p.shape), str(p.dtype)) for p in plan.params]
    if mine != theirs:
        diff = next(((a, b) for a, b in zip(mine, theirs, strict=False) if a != b), None)
        return (f"parameter {'/'.join(diff[0][0])} is {diff[0][1]} {diff[0][2]} here, "
                f"{'/'.join(diff[1][0])} {diff[1][1]} {diff[1][2]} in the plan" if diff else
                f"{len(mine)} parameters here, {len(theirs)} in the plan")
    for p in plan.params:
        why = _spec_mismatch(p.spec, p.shape, shape) or (
            None if p.state_spec is None else _spec_mismatch(p.state_spec, p.shape, shape))
        if why:
            return f"parameter {'/'.join(p.path)}: {why}"
    if plan.batch_size != layout.inputs.batch_size:
        return (f"it was made for batch size {plan.batch_size}, the arguments have "
                f"{layout.inputs.batch_size}")
    if options.mesh is not None and options.plan is None:
        d, m, _ = mesh_dims(shape)
        if (d, m) != tuple(options.mesh):
            return (f"its mesh {named_mesh(shape.items())} is not mesh_shape="
                    f"{dict(options.mesh_shape or {})}")
    if options.num_devices is not None and options.plan is None \
            and n != options.num_devices:
        return f"it uses {n} devices, not num_devices={options.num_devices}"
    return None


def _spec_mismatch(spec: Sequence[Any], dims: Sequence[int], mesh: dict[str, int]
                   ) -> str | None:
    """Why a PartitionSpec cannot lay out an array of `dims` on `mesh` (None: it can)."""
    if len(spec) != len(dims):
        return f"spec {tuple(spec)} has {len(spec)} entries for {len(dims)} dims"
    seen: list[str] = []
    for entry, size in zip(spec, dims, strict=True):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        missing = [a for a in axes if a not in mesh]
        if missing:
            return f"spec {tuple(spec)} names axes {missing} its mesh does not have"
        split = math.prod(mesh[a] for a in axes)
        if size % split:
            return f"spec {tuple(spec)} splits a dim of {size} {split} ways"
        seen += axes
    if len(seen) != len(set(seen)):
        return f"spec {tuple(spec)} uses one mesh axis for two dims"
    return None


def _ids(ids: Sequence[int]) -> str:
    ids = list(ids)
    return str(ids) if len(ids) <= 8 else f"[{ids[0]}, ..., {ids[-1]}] ({len(ids)})"


__all__ = ["plan_mismatch"]
