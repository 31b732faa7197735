"""The compile stage: a layout (mesh shape + one PartitionSpec per parameter) becomes a
compiled `jax.jit` step. Verification and the run use the very same function, so what
XLA reports for a verified candidate is what runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .cost import DATA, MODEL
from .state import BATCH, PARAM, LeafTable

# Applied to GPU compiles only: overlap collectives with compute (XLA flag names checked
# on jax 0.10.2; their effect is measured on GPU, not assumed).
GPU_COMPILER_OPTIONS: dict[str, Any] = {"xla_gpu_enable_latency_hiding_scheduler": True}


def make_mesh(d: int, m: int, devices: Sequence[Any]) -> Mesh:
    """A (data, model) mesh over the first d*m devices, with Auto axes (XLA propagates)."""
    if d * m > len(devices):
        raise ValueError(f"a {d}x{m} mesh needs {d * m} devices, only {len(devices)} given")
    grid = np.array(list(devices[: d * m]), dtype=object).reshape(d, m)
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def leaf_specs(table: LeafTable, param_specs: Sequence[tuple[Any, ...]], d: int) -> list[P]:
    """The PartitionSpec of every leaf: a param's spec for it and its mirrors, the data
    axis for batch leaves (when the mesh splits data), replicated otherwise."""
    out = []
    for role in table.roles:
        if role.kind == PARAM:
            out.append(P(*param_specs[role.param]))
        elif role.kind == BATCH and d > 1:
            out.append(P(DATA))
        else:
            out.append(P())
    return out


@dataclass(frozen=True)
class CompiledStep:
    """A compiled step and what it takes to call it."""

    mesh: Mesh
    in_shardings: tuple[NamedSharding, ...]
    compiled: Any
    compile_time_s: float


def compile_layout(fn: Callable, layout: Any, d: int, m: int,
                   param_specs: Sequence[tuple[Any, ...]], devices: Sequence[Any], *,
                   donate: bool = True,
                   compiler_options: dict[str, Any] | None = None) -> CompiledStep:
    """Lower and compile `fn` (flattened per `layout`) for this mesh and parameter layout,
    from abstract arguments only: nothing is allocated and no user array is touched."""
    mesh = make_mesh(d, m, devices)
    in_sh = tuple(NamedSharding(mesh, s) for s in leaf_specs(layout.inputs, param_specs, d))
    out_sh = tuple(NamedSharding(mesh, s) for s in leaf_specs(layout.outputs, param_specs, d))
    donated = tuple(i for i, r in enumerate(layout.inputs.roles)
                    if r.kind == PARAM) if donate else ()
    treedef, names = layout.args_treedef, layout.kw_names

    def flat_step(*leaves: Any) -> tuple[Any, ...]:
        a, k = jax.tree_util.tree_unflatten(treedef, leaves)
        return tuple(jax.tree_util.tree_leaves(fn(*a, **dict(zip(names, k, strict=True)))))

    opts = compiler_options
    if opts is None:
        opts = GPU_COMPILER_OPTIONS if devices[0].platform == "gpu" else {}
    jitted = jax.jit(flat_step, in_shardings=in_sh, out_shardings=out_sh,
                     donate_argnums=donated)
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s,
                                     weak_type=getattr(a, "weak_type", False))
                for a, s in zip(layout.inputs.avals, in_sh, strict=True)]
    t0 = time.perf_counter()
    compiled = jitted.lower(*abstract).compile(compiler_options=opts or None)
    return CompiledStep(mesh, in_sh, compiled, time.perf_counter() - t0)
