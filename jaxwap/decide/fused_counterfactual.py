"""The step with cuDNN's fused attention kernel in place of its materialized scores.

cuDNN's fused kernel (`implementation="cudnn"`) keeps an attention's B x heads x T x S
scores on chip and saves only the log-sum-exp of each query row for the backward pass.
`score_sites` builds the step so priced, from the scores `decide.score_detection` finds:
the forward kernel where each score product was, the backward kernel where each
attention's backward pass ends, the scores gone from memory and the log-sum-exp kept. The
result, `ScoreSites`, holds both steps as counterfactual `Graph`s the cost model prices
like any other; `decide.attention_advice` prices them for a plan.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxwap.analysis.dataflow import Dataflow, dataflow, op_kinds
from jaxwap.analysis.flatten import FlatProgram, flatten, itemsize_of
from jaxwap.analysis.fused_attention import (
    FUSED_BACKWARD,
    FUSED_FORWARD,
    runs_fused_attention,
)
from jaxwap.analysis.grad_reductions import batch_split, partial_sums, reduced_copies
from jaxwap.analysis.graph import Graph
from jaxwap.analysis.graph_cache import kept
from jaxwap.analysis.liveness import StepMemory, gathered_whole, step_memory
from jaxwap.analysis.roles import LeafRole, ParamInfo
from jaxwap.analysis.tp_activations import model_splits
from jaxwap.decide.score_detection import (
    AttentionSite,
    attention_sites,
    readers_of,
    score_ops,
    score_values,
)
from jaxwap.hardware.device import DeviceSpec
from jaxwap.search.solve import MeshResult, SearchResult


@dataclass(frozen=True)
class ScoreSites:
    """A step's materialized attention scores and the same step with cuDNN's fused kernel
    in their place, both as the cost model prices them.

    `graph`: the step as planned; `fused`: the counterfactual; `region`: [ops] the ops
    that make or read the scores; `carriers`: [ops] where `fused` holds the kernels;
    `instances`: score products per step (each iteration of a scan counted: layers,
    micro-batches); `shape`, `dtype`: one product's scores as the softmax takes them and
    its queries' dtype; `masked`: a static (position-built) mask is applied, the fused
    kernel priced causal; `search_fused`: the planner's search, which `replanned` runs on
    the fused step once asked (the advice asks only where it advises)."""

    graph: Graph = field(repr=False)
    fused: Graph = field(repr=False)
    region: np.ndarray = field(repr=False)
    carriers: np.ndarray = field(repr=False)
    instances: int
    shape: tuple[int, ...]
    dtype: str
    masked: bool
    search_fused: Callable[[Graph], SearchResult] | None = field(default=None, repr=False,
                                                                 compare=False)

    @functools.cached_property
    def replanned(self) -> MeshResult | None:
        """The best candidate of the fused step that fits, by the planner's search (None:
        no search given, no mesh to search, or none fits)."""
        if self.search_fused is None:
            return None
        try:
            found = self.search_fused(self.fused)
        except ValueError:   # no mesh to search
            return None
        best = found.results[found.best]
        return best if best.fits else None


def score_sites(graph: Graph, jaxpr: Callable[[], Any] | Any, in_roles: Sequence[LeafRole],
                out_roles: Sequence[LeafRole], params: Sequence[ParamInfo],
                device: DeviceSpec,
                search_fused: Callable[[Graph], SearchResult] | None = None
                ) -> ScoreSites | None:
    """The step's materialized attention scores and its fused counterfactual, or None:
    the target does not run cuDNN's fused attention (`fused_attention.runs_fused_attention`),
    the step has no such attention, or its queries and keys are not 16-bit (the fused
    kernel takes fp16 or bf16: `fused_attention.MIN_CAPABILITY`'s source). `jaxpr`: the traced
    step `graph` was analyzed from (or a function giving it, called only when the target
    runs the kernel). `search_fused`: the planner's search, for the counterfactual's best
    plan (`ScoreSites.replanned`)."""
    if not runs_fused_attention(device):
        return None
    closed = jaxpr() if callable(jaxpr) else jaxpr
    # kept by the trace (jax hands back the same one for the same step): planning the
    # same step again finds the same sites; the search is this plan's
    sites = kept(("score sites", closed, tuple(in_roles), tuple(out_roles), tuple(params),
                  device), lambda: _score_sites(graph, closed, in_roles, out_roles, params))
    return None if sites is None else dataclasses.replace(sites, graph=graph,
                                                          search_fused=search_fused)


def _score_sites(graph: Graph, closed: Any, in_roles: Sequence[LeafRole],
                 out_roles: Sequence[LeafRole], params: Sequence[ParamInfo]
                 ) -> ScoreSites | None:
    """`score_sites` on the traced step, without the search."""
    prog = flatten(closed)
    if len(prog.ops) != len(graph.flops):
        raise ValueError(f"score_sites: the jaxpr has {len(prog.ops)} ops where the graph "
                         f"has {len(graph.flops)}: not the step the graph was made from")
    kinds, _ = op_kinds(prog)
    flow = dataflow(prog, kinds, in_roles, out_roles, params, graph.batch_size)
    readers = readers_of(prog)
    split = batch_split(prog, in_roles)
    sites = attention_sites(prog, flow, readers, split[0])
    sites = [s for s in sites if itemsize_of(s.dtype) <= 2]
    if not sites:
        return None
    values, of = score_values(prog, flow, sites)
    region = score_ops(prog, readers, values)
    fused, carriers, instances = _fused(graph, prog, values, of, region, sites)
    nbytes = np.where(values, 0.0, prog.nbytes)
    for s in sites:   # the log-sum-exp kept for the backward pass, with the output
        nbytes[prog.ops[s.value].outs[0]] += 4.0 * s.pairs * s.q_len
    mem = step_live(graph, prog, kinds, flow, in_roles, out_roles, params, nbytes, split)
    # (its `live` held as its row-to-row changes, as `graph.analyze` keeps it)
    fused = dataclasses.replace(
        fused, live=mem.live, tp_live_param=mem.tp_live_param, tp_live_kind=mem.tp_live_kind)
    return ScoreSites(graph, fused, region, carriers, instances, sites[0].shape,
                      sites[0].dtype, any(s.masked for s in sites))


def step_live(graph: Graph, prog: FlatProgram, kinds: Sequence[str], flow: Dataflow,
              in_roles: Sequence[LeafRole], out_roles: Sequence[LeafRole],
              params: Sequence[ParamInfo], nbytes: np.ndarray,
              split: tuple[Sequence[int | None], np.ndarray] | None = None
              ) -> StepMemory:
    """`Graph.live` (with its tensor-parallel columns) of the
    step `graph` was analyzed from, its values taking `nbytes` each: `graph.analyze`'s
    memory pass, run again on the same program with other sizes (`split`: its
    `grad_reductions.batch_split`, if known)."""
    tp = model_splits(prog, kinds, flow.owner, flow.perm, flow.batched, graph.layers,
                      params, graph.stacked_dim)
    whole = gathered_whole(prog.ops, prog.nbytes, graph.layers, graph.tp_param, flow.owner,
                           graph.stacked_dim)
    sums = partial_sums(prog, out_roles, split or batch_split(prog, in_roles))
    mem = step_memory(dataclasses.replace(prog, nbytes=np.asarray(nbytes, float)), kinds,
                      flow, in_roles, out_roles, len(params), tp, whole,
                      reduced_copies(prog, sums))
    return mem


def _fused(graph: Graph, prog: FlatProgram, values: np.ndarray,
           of: dict[int, tuple[int, int, int]], region: np.ndarray,
           sites: Sequence[AttentionSite]) -> tuple[Graph, np.ndarray, int]:
    """The graph's per-op figures with each attention's ops replaced by cuDNN's kernels:
    the ops that make or read the scores cost nothing, each score product carries the
    forward kernel, and the last matmul reading an attention's scores after its
    product's value matmul (its backward pass) carries the backward kernel."""
    by_key = {s.key: s for s in sites}
    site_at = {s.op: s for s in sites}
    groups = _attentions(prog, values, region)
    flops, traffic = graph.flops.copy(), graph.bytes.copy()
    kernels, matmul, lowp = graph.kernels.copy(), graph.is_matmul.copy(), \
        graph.low_precision.copy()
    attention = graph.attention.copy()
    zero = {name: getattr(graph, name).copy() for name in (
        "transcendentals", "reduced", "fixed_bytes", "dot_relayout_bytes",
        "window_taps", "window_grad_elems", "window_grad_bytes", "conv_grad_bytes")}
    transposed = graph.transposed.copy()
    ops = np.flatnonzero(region)
    for arr in (flops, traffic, kernels, *zero.values()):
        arr[ops] = 0.0
    matmul[ops] = lowp[ops] = transposed[ops] = False
    attention[ops] = 0
    carriers = np.zeros(len(prog.ops), bool)
    instances = 0

    def carry(k: int, s: AttentionSite, backward: bool) -> None:
        f, b = s.fused(backward)
        rep = prog.ops[k].repeat
        flops[k], traffic[k], kernels[k] = f * rep, b * rep, float(rep)
        matmul[k] = lowp[k] = carriers[k] = True
        attention[k] = FUSED_BACKWARD if backward else FUSED_FORWARD

    for members in groups:
        mine = [site_at[k] for k in members if k in site_at]
        for s in mine:
            carry(s.op, s, False)
            instances += prog.ops[s.op].repeat
        last_value = max((s.value for s in mine), default=-1)
        dots = [k for k in members if prog.ops[k].prim == "dot_general" and k > last_value
                and k not in site_at]
        if not dots:
            continue
        k = max(dots)
        key = next(of[v] for v in (*prog.ops[k].ins, *prog.ops[k].outs) if values[v])
        carry(k, by_key[key], True)
    fused = dataclasses.replace(graph, flops=flops, bytes=traffic, kernels=kernels,
                                is_matmul=matmul, low_precision=lowp, transposed=transposed,
                                attention=attention, **zero)
    return fused, carriers, instances


def _attentions(prog: FlatProgram, values: np.ndarray, region: np.ndarray
                ) -> list[list[int]]:
    """The ops of `region`, grouped by the scores they share (union-find over the score
    values each op makes or reads): one attention per group, or its backward part where
    a scan's stacked residual separates the two. Groups in the order of their first op."""
    parent = list(range(len(prog.ops)))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a
    maker: dict[int, int] = {}
    for k, op in enumerate(prog.ops):
        if not region[k]:
            continue
        for v in (*op.ins, *op.outs):
            if values[v]:
                if v in maker:
                    parent[find(k)] = find(maker[v])
                else:
                    maker[v] = k
    groups: dict[int, list[int]] = {}
    for k in np.flatnonzero(region).tolist():
        groups.setdefault(find(k), []).append(k)
    return list(groups.values())


__all__ = ["ScoreSites", "score_sites", "step_live"]
