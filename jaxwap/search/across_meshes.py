"""The search across meshes: every mesh worth trying, each solved, then the objective.

Each mesh the devices allow (`meshes.mesh_shapes`; a mesh where a user's pin cannot hold
is skipped, with its reason) gets its best layout (`solve.solve_mesh`). On a cluster of
nodes the best meshes are also tried hybrid-sharded (HSDP, `_hybrids`); on a large
cluster, meshes whose best possible score cannot beat a fitting candidate already found
are skipped (branch and bound, `_solve_meshes`). Plain data parallelism's best mesh is
kept as a candidate of its own, the baseline verification weighs the plan against. The
objective then ranks the fitting candidates that use their model axis; where none fits,
the one of least memory is reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaxwap.analysis.graph import Graph
from jaxwap.core.objective import Objective, Ranking
from jaxwap.core.records import Prediction
from jaxwap.cost.mesh_cost import mesh_costs
from jaxwap.cost.mesh_prediction import predict
from jaxwap.hardware.cluster import Cluster
from jaxwap.search.constraints import LayoutRules
from jaxwap.search.meshes import EXHAUSTIVE_DEVICES, mesh_shapes
from jaxwap.search.solve import (
    MeshResult,
    SearchResult,
    data_parallel,
    solve_mesh,
    uses_model_axis,
)
from jaxwap.search.strategies import pins_hold, shard_replicas, unsplit_reasons


def search(graph: Graph, cluster: Cluster, objective: Objective, num_devices: int,
           budget: float, num_devices_exact: int | None = None,
           micro_batches: int = 1, offload: bool = True, mesh: tuple[int, int] | None = None,
           allowed: LayoutRules | None = None, replicas: int = 1) -> SearchResult:
    """Every mesh worth trying (or only `mesh`, hybrid-sharded over `replicas` when more
    than 1), each with its best layout of the `allowed` strategy families and pins (a
    mesh where a pin cannot hold is skipped), and hybrid sharding (HSDP) tried on the
    best (`_hybrids`, not when `mesh` fixes the mesh), ranked by the objective."""
    shapes, skipped = _usable_shapes(graph, cluster, num_devices, num_devices_exact,
                                     micro_batches, offload, mesh, allowed, replicas)
    triples = [(d, m, replicas) for d, m in shapes]
    if mesh is None and replicas == 1:
        # a data axis that divides too few of the weights also tried hybrid-sharded over
        # the part of it that does (`shard_replicas`)
        triples += [(d, m, r) for d, m in shapes
                    if (r := shard_replicas(graph, d, m, allowed)) > 1]
    results = _solve_meshes(graph, cluster, objective, triples,
                            budget, offload, allowed, skipped,
                            prune=num_devices > EXHAUSTIVE_DEVICES)
    if mesh is None:
        results += _hybrids(graph, cluster, objective, results, budget, offload, allowed)
    if allowed is not None and allowed.forced:
        results = _forced_only(results, allowed, skipped)
    rank = cluster.ranker(objective)
    baseline = _add_baseline(graph, cluster, shapes, budget, allowed, results, rank)
    if not any(r.fits for r in results):
        best = min(range(len(results)), key=lambda i: results[i].predicted.peak_memory_bytes)
        return SearchResult(tuple(results), (float("inf"),) * len(results), best,
                            tuple(skipped), baseline)
    # the objective ranks fitting candidates only; within max_slowdown the "fastest"
    # is the fastest that fits
    ranking = rank([r.predicted if r.fits and uses_model_axis(r) else None for r in results])
    if ranking.best < 0:
        raise _model_axis_unused(graph, results, mesh, allowed, num_devices, num_devices_exact)
    return SearchResult(tuple(results), ranking.scores, ranking.best, tuple(skipped), baseline)


def _usable_shapes(graph: Graph, cluster: Cluster, num_devices: int,
                   num_devices_exact: int | None, micro_batches: int, offload: bool,
                   mesh: tuple[int, int] | None, allowed: LayoutRules | None, replicas: int
                   ) -> tuple[list[tuple[int, int]], list[str]]:
    """The (d, m) meshes to solve, and why the others were skipped: the meshes the devices
    and the batch allow (only `mesh`, when given) where every pin can hold. None usable
    is an error that says why, each mesh's own reason."""
    node = cluster.mesh_node_size
    shapes, skipped = mesh_shapes(num_devices, graph.batch_size, graph, num_devices_exact,
                                  micro_batches, mesh, node)
    unpinned = [(dm, pins_hold(graph, allowed, *dm, offload)) for dm in shapes]
    shapes = [dm for dm, why in unpinned if why is None]
    if unpinned and not shapes:
        where = "the mesh asked for" if mesh else "any usable mesh"
        raise ValueError(f"constraints cannot hold on {where}: {unpinned[-1][1]}")
    skipped += [f"{d}x{m}: {why}" for (d, m), why in unpinned if why is not None]
    if not shapes:
        if mesh is not None:
            asked = (f"replica={replicas} x data={mesh[0] // replicas} x model={mesh[1]}"
                     if replicas > 1 else f"{mesh[0]}x{mesh[1]}")
            raise ValueError(f"mesh_shape {asked} cannot be used: "
                             f"{'; '.join(s.split(': ', 1)[1] for s in skipped)}")
        raise ValueError(_no_mesh_message(graph, num_devices, num_devices_exact, skipped))
    if replicas > 1 and any(d % replicas for d, _ in shapes):
        raise ValueError(f"{replicas} replicas do not divide the data axis of "
                         f"{shapes[0][0]}")
    return shapes, skipped


def _forced_only(results: list[MeshResult], allowed: LayoutRules,
                 skipped: list[str]) -> list[MeshResult]:
    """The results where some parameter takes a forced strategy: a forced split must
    happen, so a mesh where it cannot is no candidate (and is said so in `skipped`)."""
    families = ", ".join(sorted(allowed.families or ()))
    kept = [r for r in results if any(allowed.admits(s) for s in r.strategies)]
    skipped += [f"{r.describe()}: no parameter can take the strategies {families} on it"
                for r in results if r not in kept]
    if not kept:
        raise ValueError(f"no mesh lets any parameter use the strategies {families} "
                         f"({'; '.join(skipped[-6:])})")
    return kept


def _add_baseline(graph: Graph, cluster: Cluster, shapes: Sequence[tuple[int, int]],
                  budget: float, allowed: LayoutRules | None, results: list[MeshResult],
                  rank: Callable[[list[Prediction]], Ranking]) -> int:
    """The index in `results` of the best data-parallel baseline that fits, appended
    where no result has its layout already; -1 for none.

    Plain data parallelism (every parameter replicated) is what a user would write by
    hand; its best mesh is kept as a candidate of its own so verification can always
    weigh the plan against it on XLA's figures (unless the strategies or pins forbid it)."""
    replicate_ok = allowed is None or not (allowed.forced or allowed.pins)
    dp = [data_parallel(graph, cluster, d, budget) for d, m in shapes
          if m == 1 and replicate_ok]
    dp = [r for r in dp if r.fits]
    if not dp:
        return -1
    b = dp[rank([r.predicted for r in dp]).best]
    same = next((i for i, r in enumerate(results)
                 if (r.d, r.m, r.r) == (b.d, 1, 1) and r.strategies == b.strategies),
                None)
    if same is None:
        results.append(b)
        return len(results) - 1
    return same


def _model_axis_unused(graph: Graph, results: Sequence[MeshResult],
                       mesh: tuple[int, int] | None, allowed: LayoutRules | None,
                       num_devices: int, num_devices_exact: int | None) -> ValueError:
    """The error where every fitting mesh has a model axis that no layout can split a
    weight over: its devices would only duplicate work. It says why no layer splits, and
    what to change."""
    m = max(r.m for r in results)
    why = unsplit_reasons(graph, m, allowed)
    if mesh is not None:
        advice = "use a model axis of 1"
        if allowed is not None and allowed.families is not None \
                and "tp" not in allowed.families:
            advice = "force tensor parallelism with strategies=('tp', ...) or " + advice
        elif allowed is not None and allowed.pins:
            advice = "pin a layer's split with constraints= or " + advice
        return ValueError(
            f"mesh_shape {mesh[0]}x{mesh[1]}: no layout splits any parameter over its "
            f"model axis of {mesh[1]} ({why}), so its devices would only duplicate "
            f"work: {advice}.")
    shown = ", ".join(r.describe() for r in results)
    return ValueError(
        f"every usable mesh ({shown}) needs a model axis (batch "
        f"{graph.batch_size} cannot be split {num_devices_exact or num_devices} ways "
        f"over data), but no layout splits any parameter over it ({why}): the devices "
        f"would only duplicate work. Use fewer devices (num_devices=) or a batch "
        f"size divisible by the device count.")

@dataclass(frozen=True)
class _Bound:
    """The best figures a mesh could reach, for the objective's score: all its flops at
    the device's peak rate, perfectly split, and every device drawing at least idle power
    for that long."""

    step_time_s: float
    energy_per_step_j: float
    num_devices: int


def _hybrids(graph: Graph, cluster: Cluster, objective: Objective,
             results: Sequence[MeshResult], budget: float, offload: bool,
             allowed: LayoutRules | None) -> list[MeshResult]:
    """Each fitting mesh whose data axis spans nodes and whose step waits for gradient
    communication, hybrid-sharded (HSDP): its layout's data-sharded parameters sharded
    over the d/r data devices inside each node, r replicas across the nodes, so FSDP's
    gathers stay on the node's links and only gradient shards cross the network.

    HSDP changes only how data-sharded parameters communicate and how much they hold (more
    than sharding over every data device): a mesh that does not fit gains nothing, nor
    one whose communication is hidden already, nor a step whose layouts may not shard
    over data. Each such mesh's own layout is priced again with the replicas (one pricing,
    where a search of a 4096-device mesh takes most of a second) and kept where it still
    fits; the best of them by the objective is also searched in full.
    `mesh_shape={"replica": r, ...}` searches a hybrid mesh in full."""
    if cluster.num_nodes <= 1 or not (allowed is None or allowed.families is None
                                      or {"fsdp", "zero1"} & allowed.families):
        return []
    eligible = []
    for res in results:
        inner = cluster.devices_in_node(res.d, res.m)
        pr = res.predicted
        if (res.fits and res.variant == "planner" and res.r == 1 and 1 < inner < res.d
                and not any(h.r > 1 and (h.d, h.m) == (res.d, res.m) for h in results)
                and res.d % inner == 0 and any(s.data_sharded or s.state_spec is not None
                                               for s in res.strategies)
                and pr.exposed_comm_time_s > HYBRID_EXPOSED * pr.step_time_s):
            eligible.append((res, res.d // inner))
    if not eligible:
        return []
    out = []
    for res, r in eligible:
        mc = mesh_costs(graph, cluster, res.d, res.m, [(s,) for s in res.strategies], r)
        hybrid = predict(graph, cluster, mc, [0] * len(res.strategies))
        if hybrid.peak_memory_bytes <= budget:
            out.append(dataclasses.replace(res, predicted=hybrid, r=r))
    # the most promising one searched in full: with gathers cheap inside the node, its
    # best layout may shard more than the mesh's own
    kw = {"max_watts": cluster.device.max_watts, "num_devices_available": cluster.num_devices}
    scores = objective.scores([res.predicted for res, _ in eligible], **kw)
    res, r = eligible[min(range(len(eligible)), key=lambda i: scores[i])]
    full = solve_mesh(graph, cluster, res.d, res.m, budget, offload, allowed, r)
    if full.fits:
        out = [h for h in out if (h.d, h.m) != (full.d, full.m)
               or h.predicted.step_time_s < full.predicted.step_time_s] + [full]
    return out


# a mesh whose step waits for less than this share of communication gains nothing
# from hybrid sharding worth a candidate
HYBRID_EXPOSED = 0.01


def _solve_meshes(graph: Graph, cluster: Cluster, objective: Objective,
                  shapes: Sequence[tuple[int, int, int]], budget: float, offload: bool,
                  allowed: LayoutRules | None, skipped: list[str], prune: bool
                  ) -> list[MeshResult]:
    """`solve_mesh` on every shape, in the shapes' order. With `prune` (a large cluster),
    branch and bound: meshes are solved from the most promising bound, and one whose best
    possible score cannot beat a fitting candidate already found is skipped (and said so
    in `skipped`). Those are meshes that cannot win, so only the candidate list (and the
    frontier drawn from it) is shorter."""
    if not prune or objective.kind not in ("throughput", "energy", "balanced"):
        return [solve_mesh(graph, cluster, d, m, budget, offload, allowed, r)
                for d, m, r in shapes]
    dev = cluster.device
    bounds = []
    for d, m, _ in shapes:
        n, speed = d * m, cluster.speedup_when_using(d * m)
        t = graph.total_flops / (n * dev.peak_flops * speed)
        bounds.append(_Bound(t, n * dev.idle_watts * speed * t, n))
    kw = {"max_watts": dev.max_watts, "num_devices_available": cluster.num_devices}
    lower = objective.scores(bounds, **kw)
    solved: dict[int, MeshResult] = {}
    best = float("inf")
    for i in sorted(range(len(shapes)), key=lambda i: lower[i]):
        d, m, reps = shapes[i]
        if lower[i] > best:
            name = f"{reps}x{d // reps}x{m}" if reps > 1 else f"{d}x{m}"
            skipped.append(f"{name}: cannot beat the best found (its flops at peak on "
                           f"{d * m} devices already score {lower[i] / best:.2f}x)")
            continue
        r = solve_mesh(graph, cluster, d, m, budget, offload, allowed, reps)
        solved[i] = r
        if r.fits and uses_model_axis(r) and (
                allowed is None or not allowed.forced
                or any(allowed.admits(s) for s in r.strategies)):
            best = min(best, objective.scores([r.predicted], **kw)[0])
    return [solved[i] for i in sorted(solved)]


def _no_mesh_message(graph: Graph, n: int, exact: int | None, skipped: Sequence[str]) -> str:
    """Why no mesh of the devices can run a batch of this size: each mesh's own reason
    (the batch split, or no weight the model axis can split), not one reason for all."""
    what = f"exactly {exact}" if exact else f"up to {n}"
    more = f"; {len(skipped) - 6} more" if len(skipped) > 6 else ""
    return (f"no mesh of {what} devices can run batch size {graph.batch_size}: "
            f"{'; '.join(skipped[:6])}{more}. Change the batch size or the number of "
            f"devices.")


__all__ = ["HYBRID_EXPOSED", "search"]
