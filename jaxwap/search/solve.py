"""The search: every mesh, the best strategy per parameter on each, then the objective.

Per mesh the layer weights form a chain (forward order) of groups of siblings (layers
reading one input: attention's q, k and v, a gated MLP's gate and up, which take one kind
together), and the communication a group costs depends only on what the group before it
leaves (column-then-row pairs need no gather in between), so a dynamic program along the
chain finds the per-parameter strategies that minimise modelled step time (`search/tp_chain.py`).
Gradient reduction overlaps backward compute, which makes its cost non-additive; the DP is
run with the reduction weighted 1, 1/2 and 0 and each result is priced exactly; FSDP's
moved activations, which hang on the layers before (`collectives.moved_in`), are estimated
as if every layer were FSDP, and searched again with none moving.
Non-layer parameters (norms, embeddings) choose independently; a bias that can ride with
its kernel's moved FSDP activations is decided with its kernel (`tp_chain._fold_riders`).
On a cluster of
nodes the best meshes are also tried hybrid-sharded (HSDP, `_hybrids`).

A mesh whose best layout leaves its model axis unused (its devices would run every layer
whole, duplicating the work) is searched again for its best layout that splits a layer
over that axis (`chain_dp`'s `must_split`), so every mesh's tensor-parallel candidate is
priced before the objective compares meshes. What the program's additive costs misjudge
(a data-axis trait's price: the gradient reduction hidden behind the backward pass, one
latency per kind of combined collective) is then corrected by exact prices, a class of
parameters moved between replicated, ZeRO-1 and FSDP at a time (`_polish`).

A candidate over the memory budget is repaired before it is declared not to fit
(`memory_repair.repair`: one parameter at a time, the move that frees the most memory at the
peak per second it adds, so the cheapest first: optimizer state sharded over the data axis
(ZeRO-1) costs almost nothing, the weight and gradient too (FSDP) costs gathers, optimizer
state in host memory costs PCIe transfers). What a step cannot free this way
(activations) is left to the planner's step variants: micro-batches. The meshes tried
come from `meshes`, each parameter's candidate layouts from `strategies`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from jaxwap.analysis.graph import Graph
from jaxwap.core.objective import Objective
from jaxwap.core.records import DATA, MODEL, REPLICA, STAGE, Prediction, StepVariant, Strategy
from jaxwap.cost.mesh_cost import MeshCosts, mesh_costs, predict
from jaxwap.hardware.cluster import Cluster
from jaxwap.search.constraints import LayoutRules
from jaxwap.search.memory_repair import memory_floor, micro_batch_floor, repair
from jaxwap.search.meshes import EXHAUSTIVE_DEVICES, device_counts, mesh_shapes
from jaxwap.search.strategies import (
    param_strategies,
    pins_hold,
    restrict,
    unsplit_reasons,
)
from jaxwap.search.tp_chain import biases_follow, chain_dp, flat_costs, pair_costs, per_param_of

_OVERLAP_WEIGHTS = (1.0, 0.5, 0.0)


@dataclass(frozen=True)
class MeshResult:
    """The best assignment found on one mesh and its prediction."""

    d: int
    m: int
    strategies: tuple[Strategy, ...]
    predicted: Prediction
    fits: bool
    variant: str = "planner"   # or "data-parallel": the baseline every user could write
    r: int = 1                 # replicas (HSDP): the data axis's part across nodes
    # a pipelined candidate's step (stages, micro-batches, rounds); None: the search's own
    step: StepVariant | None = None

    @property
    def stages(self) -> int:
        return self.step.stages if self.step is not None else 1

    @property
    def num_devices(self) -> int:
        return self.stages * self.d * self.m

    @property
    def mesh(self) -> tuple[tuple[str, int], ...]:
        """(axis, size) pairs of the mesh: (stage,) (replica,) data, model."""
        head = ((STAGE, self.stages),) if self.stages > 1 else ()
        head += ((REPLICA, self.r),) if self.r > 1 else ()
        return (*head, (DATA, self.d // self.r), (MODEL, self.m))

    def describe(self) -> str:
        return "x".join(str(s) for _, s in self.mesh)


@dataclass(frozen=True)
class SearchResult:
    """Per-mesh results (and the data-parallel baseline, when it differs), their scores,
    the analytic best, and the index of the best data-parallel baseline (or -1)."""

    results: tuple[MeshResult, ...]
    scores: tuple[float, ...]
    best: int
    skipped: tuple[str, ...]
    baseline: int = -1


def solve_mesh(graph: Graph, cluster: Cluster, d: int, m: int, budget: float,
               offload: bool = True, allowed: LayoutRules | None = None,
               r: int = 1) -> MeshResult:
    """The best layout on a (d, m) mesh that uses its model axis; with r replicas (HSDP),
    the data axis split into r replicas across nodes of d/r devices each, over which
    parameters shard.

    Where the best layout of all splits nothing over a model axis (layers too small for a
    split to gain time: its devices would run every layer whole), the mesh is searched
    again for the best layout that splits some layer over it (`chain_dp`'s `must_split`):
    the mesh's tensor-parallel candidate, which the objective weighs against the other
    meshes. Dropping the mesh instead left that candidate unpriced (Alpa's 256-wide MLP
    on 4 devices over slow links: the 1x4 mesh's tensor-parallel layouts never priced, a
    2x2 layout sending 3.6x the bytes of its Megatron pairs chosen). Only where no layer
    can be split does the result leave the axis unused (`uses_model_axis`)."""
    strategies = [param_strategies(graph, j, d // r, m, offload, allowed)
                  for j in range(len(graph.params))]
    floor, low = memory_floor(graph, strategies, d, m, r=r)
    if floor > budget:
        # no layout fits: skip the search and the repairs, report the least memory (and
        # price only that layout)
        picked = [(strategies[j][s],) for j, s in enumerate(biases_follow(graph, strategies, low))]
        mc = mesh_costs(graph, cluster, d, m, picked, r)
        return MeshResult(d, m, tuple(p[0] for p in picked),
                          predict(graph, cluster, mc, [0] * len(picked)), False, r=r)
    mc = mesh_costs(graph, cluster, d, m, strategies, r)
    tried = _tried(graph, cluster, mc, budget)
    key, fits = _best(tried, budget)
    if m > 1 and not _splits(mc, key):
        used = {k: p for k, p in tried.items() if _splits(mc, k)}
        used.update(_tried(graph, cluster, mc, budget, must_split=True))
        used = {k: p for k, p in used.items() if _splits(mc, k)}
        if used:
            tried = used
            key, fits = _best(used, budget)
    pred = tried[key]
    if fits:
        key, pred = _polish(graph, cluster, mc, key, pred, budget)
    return MeshResult(d, m, tuple(mc.strategies[j][s] for j, s in enumerate(key)),
                      pred, fits, r=r)


def _tried(graph: Graph, cluster: Cluster, mc: MeshCosts, budget: float,
           must_split: bool = False) -> dict[tuple[int, ...], Prediction]:
    """The choices the chain's program makes at each weighting of the gradient reduction
    (with `must_split`, among those splitting some layer over the model axis), each also
    repaired to fit, every one priced exactly."""
    tried: dict[tuple[int, ...], Prediction] = {}
    # the program searches with FSDP layers moving activations where they would were every
    # layer FSDP; a mixed choice may gather them instead (each choice is priced as its own
    # layers make it), so it searches again with nothing moving
    estimates = [mc]
    if any(x is not None for row in mc.moved_comm for x in row):
        estimates.append(dataclasses.replace(mc, grad_comm=mc.gathered_comm, riders=()))
    repaired: dict[tuple[int, ...], list[int]] = {}   # the weightings often agree
    for est in estimates:
        flat = flat_costs(est)
        for w in _OVERLAP_WEIGHTS:
            choice = chain_dp(graph, cluster, est, w, flat, must_split)
            if tuple(choice) not in repaired:
                repaired[tuple(choice)] = biases_follow(
                    graph, est.strategies, repair(graph, cluster, est, choice, budget),
                    per_param_of(flat, pair_costs(flat, w)))
            for c in (choice, repaired[tuple(choice)]):
                key = tuple(c)
                if key not in tried:
                    tried[key] = predict(graph, cluster, mc, c)
    return tried


def _best(tried: dict[tuple[int, ...], Prediction], budget: float
          ) -> tuple[tuple[int, ...], bool]:
    """The fastest choice that fits, else the one of least memory; and whether it fits."""
    fitting = {k: p for k, p in tried.items() if p.peak_memory_bytes <= budget}
    pool = fitting or tried
    return min(pool, key=lambda k: (pool[k].step_time_s if fitting
                                    else pool[k].peak_memory_bytes)), bool(fitting)


_TRAITS = ("plain", "zero1", "fsdp")


def _trait(s: Strategy) -> str:
    """What a layout does over the data axis: nothing, ZeRO-1 (the optimizer state
    split) or FSDP (everything split)."""
    return "fsdp" if s.data_sharded else "zero1" if s.state_spec is not None else "plain"


def _polish(graph: Graph, cluster: Cluster, mc: MeshCosts, key: tuple[int, ...],
            pred: Prediction, budget: float) -> tuple[tuple[int, ...], Prediction]:
    """`key` improved by exact prices: a move takes every parameter of one data-axis trait
    (`_trait`), of one tensor-parallel kind or of all, to another trait (where it has that
    layout); the move that makes the step fastest while it still fits is kept, until none
    gains.

    The chain's program adds per-parameter costs; what a trait costs is not additive: the
    gradient reduction hides behind the backward pass except its tail, and the collectives
    of one kind are combined, their latency paid once (`mesh_cost._combined_latency`), so one
    parameter left FSDP among ZeRO-1 ones pays a latency the program cannot see (a GPT's
    tied embedding: 0.6% of its step on a 2x2 mesh), and leaving FSDP pays only when the
    last FSDP parameter leaves. A class moves at once, so the tensor-parallel chain (the
    kinds) is untouched and a move costs one pricing: a few dozen per mesh at most."""
    index: dict[tuple[int, str, bool, str], int] = {}
    for j, options in enumerate(mc.strategies):
        for s, st in enumerate(options):
            index.setdefault((j, st.tp, st.offload, _trait(st)), s)
    for _ in range(2 * len(_TRAITS)):         # each round gains: a few rounds at most
        now = [mc.strategies[j][s] for j, s in enumerate(key)]
        cls = [(st.tp, _trait(st)) for st in now]
        groups = sorted(set(cls)) + [(None, t) for t in sorted({t for _, t in cls})]
        moves = {tuple(index.get((j, now[j].tp, now[j].offload, to), s)
                       if cls[j][1] == trait and tp in (None, cls[j][0]) else s
                       for j, s in enumerate(key))
                 for tp, trait in groups for to in _TRAITS if to != trait}
        best = (key, pred)
        for c in sorted(moves - {key}):
            p = predict(graph, cluster, mc, c)
            if p.peak_memory_bytes <= budget and \
                    p.step_time_s < best[1].step_time_s * (1 - 1e-9):
                best = (c, p)
        if best[0] == key:
            break
        key, pred = best
    return key, pred


def _splits(mc: MeshCosts, choice: Sequence[int]) -> bool:
    """Whether the choice splits some parameter over the model axis."""
    return any(mc.strategies[j][s].tp != "none" for j, s in enumerate(choice))


def search(graph: Graph, cluster: Cluster, objective: Objective, num_devices: int,
           budget: float, num_devices_exact: int | None = None,
           micro_batches: int = 1, offload: bool = True, mesh: tuple[int, int] | None = None,
           allowed: LayoutRules | None = None, replicas: int = 1) -> SearchResult:
    """Every mesh worth trying (or only `mesh`, hybrid-sharded over `replicas` when more
    than 1), each with its best layout of the `allowed` strategy families and pins (a
    mesh where a pin cannot hold is skipped), and hybrid sharding (HSDP) tried on the
    best (`_hybrids`, not when `mesh` fixes the mesh), ranked by the objective."""
    node = cluster.node_size if cluster.num_nodes > 1 else None
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
    results = _solve_meshes(graph, cluster, objective, [(d, m, replicas) for d, m in shapes],
                            budget, offload, allowed, skipped,
                            prune=num_devices > EXHAUSTIVE_DEVICES)
    if mesh is None:
        results += _hybrids(graph, cluster, objective, results, budget, offload, allowed)
    if allowed is not None and allowed.forced:
        # a forced split must happen: a mesh where it cannot is no candidate
        families = ", ".join(sorted(allowed.families or ()))
        kept = [r for r in results if any(allowed.admits(s) for s in r.strategies)]
        skipped += [f"{r.describe()}: no parameter can take the strategies {families} on it"
                    for r in results if r not in kept]
        if not kept:
            raise ValueError(f"no mesh lets any parameter use the strategies {families} "
                             f"({'; '.join(skipped[-6:])})")
        results = kept
    rank = functools.partial(objective.rank, max_watts=cluster.device.max_watts,
                             num_devices_available=cluster.num_devices)
    # Plain data parallelism (every parameter replicated) is what a user would write by
    # hand; its best mesh is kept as a candidate of its own so verification can always
    # weigh the plan against it on XLA's figures (unless the strategies or pins forbid it).
    replicate_ok = allowed is None or not (allowed.forced or allowed.pins)
    dp = [data_parallel(graph, cluster, d, budget) for d, m in shapes
          if m == 1 and replicate_ok]
    dp = [r for r in dp if r.fits]
    baseline = -1
    if dp:
        b = dp[rank([r.predicted for r in dp]).best]
        same = next((i for i, r in enumerate(results)
                     if (r.d, r.m, r.r) == (b.d, 1, 1) and r.strategies == b.strategies),
                    None)
        if same is None:
            results.append(b)
            baseline = len(results) - 1
        else:
            baseline = same
    if not any(r.fits for r in results):
        best = min(range(len(results)), key=lambda i: results[i].predicted.peak_memory_bytes)
        return SearchResult(tuple(results), (float("inf"),) * len(results), best,
                            tuple(skipped), baseline)
    # the objective ranks fitting candidates only; within max_slowdown the "fastest"
    # is the fastest that fits
    ranking = rank([r.predicted if r.fits and uses_model_axis(r) else None for r in results])
    if ranking.best < 0:
        # every fitting mesh has a model axis that no layout can split a weight over
        m = max(r.m for r in results)
        why = unsplit_reasons(graph, m, allowed)
        if mesh is not None:
            advice = "use a model axis of 1"
            if allowed is not None and allowed.families is not None \
                    and "tp" not in allowed.families:
                advice = "force tensor parallelism with strategies=('tp', ...) or " + advice
            elif allowed is not None and allowed.pins:
                advice = "pin a layer's split with constraints= or " + advice
            raise ValueError(
                f"mesh_shape {mesh[0]}x{mesh[1]}: no layout splits any parameter over its "
                f"model axis of {mesh[1]} ({why}), so its devices would only duplicate "
                f"work: {advice}.")
        shown = ", ".join(r.describe() for r in results)
        raise ValueError(
            f"every usable mesh ({shown}) needs a model axis (batch "
            f"{graph.batch_size} cannot be split {num_devices_exact or num_devices} ways "
            f"over data), but no layout splits any parameter over it ({why}): the devices "
            f"would only duplicate work. Use fewer devices (num_devices=) or a batch "
            f"size divisible by the device count.")
    return SearchResult(tuple(results), ranking.scores, ranking.best, tuple(skipped), baseline)


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
        if (res.fits and res.variant == "planner" and 1 < inner < res.d
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


def data_parallel(graph: Graph, cluster: Cluster, d: int, budget: float) -> MeshResult:
    """Every parameter replicated over a (d, 1) mesh, the batch split d ways."""
    strategies = [param_strategies(graph, j, d, 1)[:1]
                  for j in range(len(graph.params))]
    mc = mesh_costs(graph, cluster, d, 1, strategies)
    pred = predict(graph, cluster, mc, [0] * len(strategies))
    return MeshResult(d, 1, tuple(s[0] for s in strategies), pred,
                      pred.peak_memory_bytes <= budget, "data-parallel")


def uses_model_axis(r: MeshResult) -> bool:
    """A mesh with a model axis that no parameter is sharded over only duplicates work."""
    return r.m == 1 or any(s.tp != "none" for s in r.strategies)


def _no_mesh_message(graph: Graph, n: int, exact: int | None, skipped: Sequence[str]) -> str:
    """Why no mesh of the devices can run a batch of this size: each mesh's own reason
    (the batch split, or no weight the model axis can split), not one reason for all."""
    what = f"exactly {exact}" if exact else f"up to {n}"
    more = f"; {len(skipped) - 6} more" if len(skipped) > 6 else ""
    return (f"no mesh of {what} devices can run batch size {graph.batch_size}: "
            f"{'; '.join(skipped[:6])}{more}. Change the batch size or the number of "
            f"devices.")


# the search's own names, and those of its parts that callers reach through it
__all__ = ["EXHAUSTIVE_DEVICES", "MeshResult", "SearchResult", "data_parallel",
           "device_counts", "mesh_shapes", "micro_batch_floor", "param_strategies",
           "restrict", "search", "solve_mesh", "uses_model_axis"]
