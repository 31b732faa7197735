"""The tensor-parallel chain's dynamic program: per mesh, each parameter's strategy
such that compute + weighted gradient communication + the model-axis communication along
the chain of sibling groups (`Graph.layer_groups`) is least.

The chain's communication depends on the groups' kinds only (col, row, none), so per
parameter and kind the cheapest strategy of that kind is taken first and the program runs
over kinds: a few transitions per group, however many strategies. Siblings take one kind
(`_combos`), and only Megatron pairs are proposed where one can form (`_pairs`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxwap.analysis.graph import Graph
from jaxwap.cost.collectives import group_kind, tp_final_cost, tp_group_cost
from jaxwap.cost.mesh_cost import MeshCosts
from jaxwap.cost.mesh_prediction import rides
from jaxwap.hardware.cluster import Cluster


@dataclass(frozen=True)
class FlatCosts:
    """A mesh's per-(parameter, strategy) costs as flat arrays, built once per mesh for
    the dynamic program's several weightings: `J` the parameter, `S` the strategy's index
    within it, `kind` its tensor-parallel kind's rank of first appearance within the
    parameter's strategies (0, 1, 2: the order the DP visits kinds in), and the parts of
    its own cost."""

    J: np.ndarray
    S: np.ndarray
    kind: np.ndarray
    kind_name: tuple[str, ...]
    time: np.ndarray
    grad: np.ndarray
    host: np.ndarray


def flat_costs(mc: MeshCosts) -> FlatCosts:
    sizes = [len(st) for st in mc.strategies]
    J = np.repeat(np.arange(len(sizes)), sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    names: list[str] = []
    kind = []
    for strats in mc.strategies:
        seen: dict[str, int] = {}
        for st in strats:
            seen.setdefault(st.tp, len(seen))
            kind.append(seen[st.tp])
        names.append(",".join(seen))
    return FlatCosts(J, np.arange(len(J)) - starts[J], np.asarray(kind, np.int64), tuple(names),
                 np.concatenate([np.asarray(x, np.float64) for x in mc.param_time]),
                 np.concatenate([np.asarray([g[0] for g in row], np.float64)
                                 for row in mc.grad_comm]),
                 np.concatenate([np.asarray(x, np.float64) for x in mc.host]))


def chain_dp(graph: Graph, cluster: Cluster, mc: MeshCosts, weight: float,
             flat: FlatCosts | None = None, must_split: bool = False) -> list[int]:
    """Strategy indices minimising compute + weight*grad comm + TP chain communication;
    with `must_split`, the least among those that split some layer over the model axis
    (where any layer can be): the best layout that uses a model axis, where the best of
    all leaves it unused and its devices would only duplicate work.

    The chain's communication depends on the layers' kinds only (col, row, none), so per
    layer and kind the cheapest strategy of that kind is taken first (the first of equals),
    and the dynamic program runs over kinds: a few transitions per layer, however many
    strategies."""
    f = flat or flat_costs(mc)
    own = pair_costs(f, weight)
    riding = _fold_riders(mc, f, own, weight)
    # per (parameter, kind): its cheapest strategy, the first of equals
    order = np.lexsort((f.S, own, f.kind, f.J))
    first = np.ones(len(order), bool)
    first[1:] = (f.J[order][1:] != f.J[order][:-1]) | (f.kind[order][1:] != f.kind[order][:-1])
    pick = order[first]
    per_param: dict[int, list[tuple[int, int, float]]] = {}
    for i in pick.tolist():
        per_param.setdefault(int(f.J[i]), []).append((int(f.kind[i]), int(f.S[i]),
                                                      float(own[i])))
    choice = [min(v, key=lambda t: (t[2], t[1]))[1] for _, v in sorted(per_param.items())]
    if not graph.layers:
        return choice
    choice = _chain(graph, cluster, mc, f, per_param, choice, must_split)
    for b, (k, s) in riding.items():
        if rides(mc.strategies[k][choice[k]], mc.strategies[b][s]):
            choice[b] = s
    return biases_follow(graph, mc.strategies, choice, per_param_of(f, own))


def pair_costs(f: FlatCosts, weight: float) -> np.ndarray:
    """Each (parameter, strategy) pair's own cost at a weighting of its gradient
    communication: compute, weighted reduction, and its optimizer state's host moves
    both ways."""
    return f.time + weight * f.grad + 2 * f.host


def per_param_of(f: FlatCosts, values: np.ndarray) -> list[np.ndarray]:
    """Values per flat (parameter, strategy) pair as one array per parameter."""
    return np.split(values, np.flatnonzero(np.diff(f.J)) + 1)


def biases_follow(graph: Graph, strategies: Sequence[Sequence[Any]], choice: Sequence[int],
                  cost: Sequence[Sequence[float]] | None = None) -> list[int]:
    """`choice` with each bias split over the model axis exactly where its kernel is
    column-parallel (Megatron's layout): where its kind must change, its cheapest layout
    of the other kind by `cost` (per parameter and strategy), or without costs the one
    nearest in its other traits (data axis, host memory); a bias with no such layout
    keeps its own.

    The bias is added to the column-split activation, so its gradient comes out split by
    feature: left whole, XLA updates it split and then gathers the bias and each optimizer
    moment (AlexNet-small's 1x2 step on the gloo cluster: 9 of its 15 collectives, 27 of
    its 46 ms of them, three gathers per column-parallel layer under Adam). Split while
    its kernel is not, it would be gathered for every use instead."""
    out = list(choice)
    for b, L in graph.bias_of.items():
        col = strategies[L.param][out[L.param]].tp == "col"
        now = strategies[b][out[b]]
        if (now.tp == "col") == col:
            continue
        near = [(0.0 if cost is None else float(cost[b][i]), s.offload != now.offload,
                 s.data_sharded != now.data_sharded,
                 (s.state_spec is None) != (now.state_spec is None), i)
                for i, s in enumerate(strategies[b]) if (s.tp == "col") == col]
        if near:
            out[b] = min(near)[-1]
    return out


def _fold_riders(mc: MeshCosts, f: FlatCosts, own: np.ndarray, weight: float
                 ) -> dict[int, tuple[int, int]]:
    """Each bias that may ride with its kernel's moved activations (`mesh_prediction.rides`) decided
    with its kernel: the kernel's layouts it rides with are priced (in `own`, in place)
    with the bias at its best riding, its own communication free, less the bias's best
    alone; so the kernel's choice weighs the bias's too. Per bias: (its kernel, its
    strategy when riding)."""
    starts = np.searchsorted(f.J, np.arange(len(mc.strategies) + 1))
    out: dict[int, tuple[int, int]] = {}
    for b, k in mc.riders:
        lo, hi = starts[b], starts[b + 1]
        sharded = np.array([st.data_sharded for st in mc.strategies[b]])
        riding = own[lo:hi] - np.where(sharded, weight * f.grad[lo:hi], 0.0)
        s = int(np.argmin(riding))
        if not sharded[s]:
            continue
        gain = float(riding[s] - own[lo:hi].min())
        for i, st in enumerate(mc.strategies[k]):
            if rides(st, mc.strategies[b][s]):
                own[starts[k] + i] += gain
        out[b] = (k, s)
    return out


def _chain(graph: Graph, cluster: Cluster, mc: MeshCosts, f: FlatCosts,
           per_param: dict[int, list[tuple[int, int, float]]], choice: list[int],
           must_split: bool = False) -> list[int]:
    """`choice` with the layers' strategies the dynamic program over the chain of
    sibling groups picks, per group and kind from `per_param`'s cheapest. With
    `must_split` a state also says whether a group so far is split over the model axis,
    and the program ends in one that is (where any is reachable)."""
    d, m = mc.d, mc.m
    # the communication of a group of siblings depends on their activation sizes and
    # kinds: the blocks of a deep model repeat a few of those, so each is priced once
    priced: dict[tuple[Any, ...], float] = {}

    def comm(group: tuple[Any, ...], prev: str, ks: tuple[str, ...]) -> float:
        rep = float(graph.repeat[group[0].op_index])
        key = (tuple((L.act_in_bytes, L.act_out_bytes, bool(L.needs_input_grad))
                     for L in group), prev, ks, rep)
        if key not in priced:
            priced[key] = tp_group_cost(group, prev, ks, d, m, cluster, rep)[0]
        return priced[key]

    # states: (kind the previous group leaves, whether a group so far is split) -> its
    # cost so far; without `must_split` the second is always False (one state per kind)
    states: dict[tuple[str, bool], float] = {("none", False): 0.0}
    # per group: state left -> (previous state, each sibling's strategy)
    back: list[dict[tuple[str, bool], tuple[tuple[str, bool], tuple[int, ...]]]] = []
    for group in graph.layer_groups:
        options = [[(f.kind_name[L.param].split(",")[ki], s, o)
                    for ki, s, o in per_param[L.param]] for L in group]
        nxt: dict[tuple[str, bool], float] = {}
        ptr: dict[tuple[str, bool], tuple[tuple[str, bool], tuple[int, ...]]] = {}
        kinds_of = {k for o in options for k, _, _ in o}
        for combo in _combos(options):
            ks = tuple(k for k, _, _ in combo)
            own_sum = sum(o for _, _, o in combo)
            left = group_kind(ks)
            split = must_split and left != "none"
            for (prev, used), c in states.items():
                if not _pairs(prev, ks, kinds_of):
                    continue
                cost = c + own_sum + comm(group, prev, ks)
                state = (left, used or split)
                if state not in nxt or cost < nxt[state]:
                    nxt[state], ptr[state] = cost, ((prev, used), tuple(s for _, s, _ in combo))
        states = nxt
        back.append(ptr)
    last = graph.layers[-1]
    rep = float(graph.repeat[last.op_index])
    ends = [k for k in states if k[1]] or list(states)
    k = min(ends, key=lambda k: states[k] + tp_final_cost(last, k[0], d, m, cluster, rep)[0])
    for group, ptr in zip(reversed(graph.layer_groups), reversed(back), strict=True):
        k, picked = ptr[k]
        for L, s in zip(group, picked, strict=True):
            choice[L.param] = s
    return choice


def _pairs(prev: str, ks: Sequence[str], kinds: set[str]) -> bool:
    """Whether the chain may go from a group that left `prev` to one of kinds `ks`.
    Megatron pairs (column-parallel, then row-parallel) compile as the chain prices them
    (a compiled Llama block's model-axis bytes within 3%); other sequences are left to
    XLA's sharding propagation, which reshards them in ways the chain underprices: an
    unpaired row-parallel layer (its input whole) has the producers upstream split and
    gathered in every block before it (16 extra activation gathers in a 2-block Llama),
    a column-parallel layer after another (GPT-2's attention projection after its fused
    q/k/v) cost 3x the bytes priced, and a replicated layer after a column-parallel one
    is not given its input gathered, as priced, but computed on the split input and its
    output all-reduced (ResNet-50's bottleneck convolutions on 1x8: 6.58 GB of
    collectives where the chain priced 1.57). So none is proposed where a pair can form
    instead: a row-parallel group only after a column-parallel one (or where the group
    has no other kind: a forced layout), and after a column-parallel group only a
    row-parallel one where it can be. (A row-parallel fused q/k/v projection and the
    attention projection after it, unpaired once the fused split was withheld, compiled
    2-layer GPT-2 on 1x2 to 0.40 GB where the chain priced 0.09; the MLPs' pairs alone,
    0.10 GB: XLA:CPU's f32 reductions of the 0.05 priced. ResNet-50 on 1x8, pairs only:
    2.02 GB against 0.83.)"""
    if "row" in ks and prev != "col" and kinds - {"row"}:
        return False
    return not (prev == "col" and "row" in kinds and "row" not in ks)


def _combos(options: Sequence[Sequence[tuple[str, int, float]]]
            ) -> list[tuple[tuple[str, int, float], ...]]:
    """The (kind, strategy, own cost) choices a group of siblings' dynamic-program step
    weighs, each layer's options given per kind. Siblings take one kind: mixing column-
    and row-parallel siblings makes XLA reshard the products they feed together (a
    compiled Llama block moved 1.5x the bytes the chain prices), so only uniform choices
    are weighed, a sibling that cannot take the kind not split ("none") instead, or at
    its cheapest where it has no unsplit option either."""
    out = []
    for kind in dict.fromkeys(k for o in options for k, _, _ in o):
        pick = []
        for o in options:
            same = [t for t in o if t[0] == kind] or [t for t in o if t[0] == "none"] or \
                [min(o, key=lambda t: t[2])]
            pick.append(same[0])
        out.append(tuple(pick))
    return out


__all__ = ["FlatCosts", "chain_dp", "flat_costs"]
