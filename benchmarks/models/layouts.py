"""The layouts the benchmarks set beside the planner's own choice on a mesh.

Side-effect free (no device set-up), so both the compiled benchmarks (8 simulated
devices) and the measured ones (real devices) use it. A forced layout is what the planner
itself finds on that mesh with `PlanOptions(strategies=...)`: the same `solve.solve_mesh`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jaxwap
from jaxwap.analysis.graph import Graph
from jaxwap.search.constraints import LayoutRules
from jaxwap.search.solve import MeshResult, solve_mesh

# variant -> the strategy families it forces (None: the planner's own choice)
VARIANTS: dict[str, frozenset[str] | None] = {
    "planner": None, "data-parallel": frozenset({"replicate"}),
    "zero1": frozenset({"zero1"}), "fsdp": frozenset({"fsdp"})}


def variant_candidate(graph: Graph | None, r: MeshResult, variant: str,
                      cluster: jaxwap.Cluster) -> MeshResult:
    """The candidate `variant` names on r's mesh: r itself for "planner", else the planner's
    own best assignment with the variant's strategy families forced."""
    allowed = VARIANTS[variant]
    if allowed is None:
        return r
    assert graph is not None, "forced layouts need the analysed graph (not a cached plan)"
    budget = cluster.device.memory_bytes * 0.9
    return dataclasses.replace(solve_mesh(graph, cluster, r.d, r.m, budget,
                                          allowed=LayoutRules(allowed)),
                               variant=variant)


def mesh_candidate(planned: Any, d: int, m: int, variant: str,
                   cluster: jaxwap.Cluster) -> MeshResult:
    """`variant_candidate` on the (d, m) mesh of a planning's search (`make_plan`'s result):
    the candidate the benchmarks time there, as `measured.py` made it."""
    r = next(r for r in planned.search.results if (r.d, r.m) == (d, m)
             and r.variant == "planner")
    return variant_candidate(planned.graph, r, variant, cluster)
