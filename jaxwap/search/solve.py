"""One mesh's best layout: the best strategy per parameter on a (data, model) mesh.

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
(activations) is left to the planner's step variants: micro-batches. Each parameter's
candidate layouts come from `strategies`; the meshes tried, and the ranking of their
results, are `search/across_meshes.py`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from jaxwap.analysis.graph import Graph
from jaxwap.core.records import DATA, MODEL, REPLICA, STAGE, Prediction, StepVariant, Strategy
from jaxwap.cost.mesh_cost import MeshCosts, mesh_costs
from jaxwap.cost.mesh_prediction import predict
from jaxwap.hardware.cluster import Cluster
from jaxwap.search.constraints import LayoutRules
from jaxwap.search.memory_repair import memory_floor, repair
from jaxwap.search.strategies import param_strategies
from jaxwap.search.tp_chain import biases_follow, chain_dp, flat_costs, pair_costs, per_param_of

# the weights the chain's program gives the gradient reduction (hidden or not: `_tried`)
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
    the analytic best, and the index of the best data-parallel baseline (or -1): what
    `across_meshes.search` returns, kept beside the per-mesh record it holds."""

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
    of one kind are combined, their latency paid once (`mesh_prediction._combined_latency`), so one
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


__all__ = ["MeshResult", "SearchResult", "data_parallel", "solve_mesh", "uses_model_axis"]
