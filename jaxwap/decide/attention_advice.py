"""Attention that materializes its scores, and what cuDNN's fused kernel would give instead.

Computed the unfused way (`jax.nn.dot_product_attention` with `implementation=None` or
`"xla"`, or `softmax(q @ k^T) @ v` written out), each attention layer writes its
B x heads x T x S scores to memory, and so do the softmax, its gradient and the matmuls
that read them: time and memory that grow with the square of the sequence. cuDNN's fused
kernel (`implementation="cudnn"`) keeps them on chip and saves only the log-sum-exp of
each query row for the backward pass.

`score_sites` finds such attention in a step's flat program, whatever wrote it: a
`dot_general` of two activations (neither a parameter) whose result, through
size-preserving ops, reaches an `exp` (the softmax) over its last two dims (T queries, S
keys) and is contracted with a third activation (the values); the *scores* are every
value of the program, forward and backward, with those T and S dims and a multiple of
that many elements that such ops make or read (probabilities, their gradients, a
residual saved for the backward pass), and the ops that make or read them. It builds the
same step priced with cuDNN's kernel in their place (the forward kernel where each score
product was, the backward kernel where each attention's backward pass ends; the scores
gone from memory, the log-sum-exp kept): a counterfactual `Graph` the cost model prices
like any other.

`attention_advice` prices both for a plan's candidate and says, where the scores take at
least `SHARE` of the step's predicted time or peak memory, what they take and what the
fused kernel would give (`Plan.attention`, rendered by `Plan.explain()`). Every figure is
predicted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxwap.analysis.dataflow import Dataflow, dataflow, op_kinds
from jaxwap.analysis.flatten import FlatProgram, flatten, itemsize_of
from jaxwap.analysis.fused_attention import (
    FUSED_BACKWARD,
    FUSED_FORWARD,
    fused_flops,
    kept_pairs,
    runs_fused_attention,
)
from jaxwap.analysis.grad_reductions import batch_split, partial_sums, reduced_copies
from jaxwap.analysis.graph import Graph
from jaxwap.analysis.liveness import gathered_whole, step_memory
from jaxwap.analysis.roles import LeafRole, ParamInfo
from jaxwap.analysis.tp_activations import model_splits
from jaxwap.core.records import Prediction
from jaxwap.core.units import si
from jaxwap.cost.mesh_cost import mesh_costs, op_model_split, predict
from jaxwap.cost.op_time import op_times
from jaxwap.hardware.cluster import Cluster
from jaxwap.hardware.device import DeviceSpec
from jaxwap.plans.advice import AttentionAdvice, scores_shape
from jaxwap.search.solve import MeshResult, SearchResult

#: Advise where the scores take at least this share of the step's predicted time or peak
#: memory per device (a threshold chosen, not measured: where less, the advice is noise).
SHARE = 0.10
#: How many size-preserving ops after a score product the softmax's `exp` and the values'
#: matmul may be (casts, the scale, a mask, the max subtracted, the normalization).
_CHAIN = 12
_EXP = ("exp", "exp2")
_MASKING = ("select_n", "add")   # where(mask, scores, -inf); scores + a -inf bias


@dataclass(frozen=True)
class _Site:
    """One attention's forward score product: op `op` makes `pairs` T x S score
    matrices per iteration; `value` is the op contracting them with the values."""

    op: int
    value: int
    q_len: int
    kv_len: int
    pairs: int
    qk_dim: int
    v_dim: int
    masked: bool
    dtype: str
    q_bytes: float
    k_bytes: float
    v_bytes: float
    o_bytes: float
    shape: tuple[int, ...]   # the scores as the softmax takes them

    @property
    def key(self) -> tuple[int, int, int]:
        return self.q_len, self.kv_len, self.pairs

    @property
    def size(self) -> int:
        return self.pairs * self.q_len * self.kv_len

    def fused(self, backward: bool) -> tuple[float, float]:
        """(flops, bytes) of cuDNN's kernel for this attention (`fused_attention.fused_flops`;
        causal where the scores are masked by a static mask), the traffic as the real
        kernel's rule counts it (`fused_attention.fused_cost`)."""
        kept = kept_pairs(self.q_len, self.kv_len, self.masked)
        lse = 4.0 * self.pairs * self.q_len
        io = self.q_bytes + self.k_bytes + self.v_bytes
        traffic = 2 * io + 2 * self.o_bytes + lse if backward else io + self.o_bytes + lse
        return fused_flops(self.pairs, kept, self.qk_dim, self.v_dim, backward), traffic


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


# --------------------------------------------------------------------------- detection
def _dep_activation(flow: Dataflow, v: int) -> bool:
    return bool(flow.dep[v]) and int(flow.owner[v]) < 0


def _site(prog: FlatProgram, flow: Dataflow, readers: Sequence[list[int]],
          batch_axis: Sequence[int | None], k: int) -> _Site | None:
    """The attention whose score product op k is, or None: op k is a dot_general of two
    activations (queries and keys, in either order), its result reaching, through ops
    that keep its size, an `exp` (the softmax) whose last two dims are a free dim of each
    operand (T of the queries, S of the keys) and not the batch (`batch_axis`, where data
    parallelism splits each value: a contrastive loss's logits pair samples, not
    positions), and a dot_general with a third activation (the values)."""
    op = prog.ops[k]
    if op.prim != "dot_general" or len(op.ins) < 2 or not op.outs:
        return None
    lhs, rhs, out = op.ins[0], op.ins[1], op.outs[0]
    if not (_dep_activation(flow, lhs) and _dep_activation(flow, rhs)):
        return None
    (lc, rc), (lb, rb) = op.eqn.params["dimension_numbers"]
    ls, rs = prog.vars[lhs].shape, prog.vars[rhs].shape
    lfree = [ls[d] for d in range(len(ls)) if d not in lc and d not in lb]
    rfree = [rs[d] for d in range(len(rs)) if d not in rc and d not in rb]
    if not lfree or not rfree:
        return None
    size = int(prog.size[out])
    chain, frontier = {out}, [out]
    exp_in, values, masks = None, [], []
    for _ in range(_CHAIN):
        nxt = []
        for v in frontier:
            for j in readers[v]:
                r = prog.ops[j]
                if r.prim in _MASKING:   # a mask: not computed from data
                    masks += [prog.vars[i].shape for i in r.ins if not flow.dep[i]]
                if r.prim in _EXP and exp_in is None:
                    exp_in = r.ins[0]
                if r.prim == "dot_general" and j != k:
                    other = [i for i in r.ins[:2] if i != v]
                    if other and _dep_activation(flow, other[0]) and other[0] not in chain:
                        values.append(j)
                for o in r.outs:
                    if int(prog.size[o]) == size and o not in chain and flow.dep[o]:
                        chain.add(o)
                        nxt.append(o)
        frontier = nxt
        if not frontier:
            break
    exp_shape = () if exp_in is None else prog.vars[exp_in].shape
    if not values or len(exp_shape) < 2:
        return None
    a = batch_axis[exp_in]
    if a is not None and a >= len(exp_shape) - 2:
        return None
    T, S = exp_shape[-2], exp_shape[-1]
    if T in lfree and S in rfree:
        q, kk = lhs, rhs
    elif S in lfree and T in rfree:
        q, kk = rhs, lhs
    else:
        return None
    value = min(values)   # the forward one (the backward pass reads the scores later)
    pairs = size // (T * S)
    vop = prog.ops[value]
    vin = next(i for i in vop.ins[:2] if i not in chain)
    vout = vop.outs[0]
    masked = any(len(m) >= 2 and tuple(m[-2:]) == (T, S) for m in masks)
    return _Site(k, value, T, S, pairs, int(math.prod(ls[d] for d in lc)),
                 max(1, int(prog.size[vout]) // (pairs * T)), masked,
                 str(prog.vars[q].dtype), float(prog.nbytes[q]), float(prog.nbytes[kk]),
                 float(prog.nbytes[vin]), float(prog.nbytes[vout]), tuple(exp_shape))


def _readers(prog: FlatProgram) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in prog.vars]
    for k, op in enumerate(prog.ops):
        for i in set(op.ins):
            out[i].append(k)
    return out


def _region(prog: FlatProgram, flow: Dataflow, sites: Sequence[_Site]
            ) -> tuple[np.ndarray, dict[int, tuple[int, int, int]]]:
    """(values that are scores, value -> its site's key): values of no parameter with the
    T and S dims of a site, connected to a site's scores through the ops that make or
    read them (forward, the backward pass, a scan's stacked residual), grown to a fixed
    point: activations of a multiple of its elements, and the masks built from positions
    (not from data) of a multiple of T x S elements."""
    keys = {s.key: s for s in sites}
    of: dict[int, tuple[int, int, int]] = {}

    def fits(v: int) -> tuple[int, int, int] | None:
        if int(flow.owner[v]) >= 0:
            return None
        shp, n = Counter(prog.vars[v].shape), int(prog.size[v])
        for key, s in keys.items():
            unit = s.size if flow.dep[v] else s.q_len * s.kv_len
            need = Counter((s.q_len, s.kv_len))
            if n % unit == 0 and all(shp[d] >= c for d, c in need.items()):
                return key
        return None

    for s in sites:
        of[prog.ops[s.op].outs[0]] = s.key
    changed = True
    while changed:
        changed = False
        for op in prog.ops:
            vals = (*op.ins, *op.outs)
            if not any(v in of for v in vals):
                continue
            for v in vals:
                if v not in of and (key := fits(v)) is not None:
                    of[v] = key
                    changed = True
    region = np.zeros(len(prog.vars), bool)
    region[list(of)] = True
    return region, of


_LAYOUT = ("transpose", "reshape", "convert_element_type", "copy", "copy_p")


def _relayouts(prog: FlatProgram, readers: Sequence[list[int]], region: np.ndarray
               ) -> list[int]:
    """The transposes around the score matmuls: of their operands (queries, keys, values,
    an output gradient, past reshapes and casts) into the layout the matmul reads, and of
    their results into the model's. The fused kernel reads and writes the model's layout
    (BTNH) itself."""
    made = {o: k for k, op in enumerate(prog.ops) for o in op.outs}
    found: set[int] = set()
    for k in np.flatnonzero(region).tolist():
        op = prog.ops[k]
        if op.prim != "dot_general":
            continue
        for v in op.ins[:2]:
            j = made.get(v)
            while j is not None and not region[j] and prog.ops[j].prim in _LAYOUT:
                if prog.ops[j].prim == "transpose":
                    found.add(j)
                j = made.get(prog.ops[j].ins[0]) if prog.ops[j].ins else None
        todo = list(op.outs)
        while todo:
            for j in readers[todo.pop()]:
                if not region[j] and prog.ops[j].prim in _LAYOUT and j not in found:
                    if prog.ops[j].prim == "transpose":
                        found.add(j)
                    todo.extend(prog.ops[j].outs)
    return sorted(found)


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
    prog = flatten(closed)
    if len(prog.ops) != len(graph.flops):
        raise ValueError(f"score_sites: the jaxpr has {len(prog.ops)} ops where the graph "
                         f"has {len(graph.flops)}: not the step the graph was made from")
    kinds, _ = op_kinds(prog)
    flow = dataflow(prog, kinds, in_roles, out_roles, params, graph.batch_size)
    readers = _readers(prog)
    split = batch_split(prog, in_roles)
    sites = [s for k in range(len(prog.ops)) if (s := _site(prog, flow, readers, split[0], k))]
    sites = [s for s in sites if itemsize_of(s.dtype) <= 2]
    if not sites:
        return None
    values, of = _region(prog, flow, sites)
    region = np.array([any(values[v] for v in (*op.ins, *op.outs)) for op in prog.ops])
    region[_relayouts(prog, readers, region)] = True
    fused, carriers, instances = _fused(graph, prog, values, of, region, sites)
    nbytes = np.where(values, 0.0, prog.nbytes)
    for s in sites:   # the log-sum-exp kept for the backward pass, with the output
        nbytes[prog.ops[s.value].outs[0]] += 4.0 * s.pairs * s.q_len
    live, tp_param, tp_kind = step_live(graph, prog, kinds, flow, in_roles, out_roles,
                                        params, nbytes, split)
    fused = dataclasses.replace(fused, live=live, tp_live_param=tp_param,
                                tp_live_kind=tp_kind)
    return ScoreSites(graph, fused, region, carriers, instances, sites[0].shape,
                      sites[0].dtype, any(s.masked for s in sites), search_fused)


def step_live(graph: Graph, prog: FlatProgram, kinds: Sequence[str], flow: Dataflow,
              in_roles: Sequence[LeafRole], out_roles: Sequence[LeafRole],
              params: Sequence[ParamInfo], nbytes: np.ndarray,
              split: tuple[Sequence[int | None], np.ndarray] | None = None
              ) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """`Graph.live` (with its tensor-parallel columns) of the step `graph` was analyzed
    from, its values taking `nbytes` each: `graph.analyze`'s memory pass, run again on
    the same program with other sizes (`split`: its `grad_reductions.batch_split`, if known)."""
    tp = model_splits(prog, kinds, flow.owner, flow.perm, flow.batched, graph.layers,
                      params, graph.stacked_dim)
    whole = gathered_whole(prog.ops, prog.nbytes, graph.layers, graph.tp_param, graph.owner,
                           graph.stacked_dim)
    sums = partial_sums(prog, out_roles, split or batch_split(prog, in_roles))
    mem = step_memory(dataclasses.replace(prog, nbytes=np.asarray(nbytes, float)), kinds,
                      flow, in_roles, out_roles, len(params), tp, whole,
                      reduced_copies(prog, sums))
    return mem.live, mem.tp_live_param, mem.tp_live_kind


def _fused(graph: Graph, prog: FlatProgram, values: np.ndarray,
           of: dict[int, tuple[int, int, int]], region: np.ndarray,
           sites: Sequence[_Site]) -> tuple[Graph, np.ndarray, int]:
    """The graph's per-op figures with each attention's ops replaced by cuDNN's kernels:
    the ops that make or read the scores cost nothing, each score product carries the
    forward kernel, and the last matmul reading an attention's scores after its
    product's value matmul (its backward pass) carries the backward kernel."""
    # ops joined by the scores they share: one attention (or its backward part, where a
    # scan's stacked residual separates the two)
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
    by_key = {s.key: s for s in sites}
    site_at = {s.op: s for s in sites}
    groups: dict[int, list[int]] = {}
    for k in np.flatnonzero(region).tolist():
        groups.setdefault(find(k), []).append(k)
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

    def carry(k: int, s: _Site, backward: bool) -> None:
        f, b = s.fused(backward)
        rep = prog.ops[k].repeat
        flops[k], traffic[k], kernels[k] = f * rep, b * rep, float(rep)
        matmul[k] = lowp[k] = carriers[k] = True
        attention[k] = FUSED_BACKWARD if backward else FUSED_FORWARD

    for members in groups.values():
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


def _layout_prediction(graph: Graph, cluster: Cluster, r: MeshResult) -> Prediction:
    """The model's prediction of `graph` under candidate r's mesh and layouts."""
    mc = mesh_costs(graph, cluster, r.d, r.m, [[s] for s in r.strategies], r.r)
    return predict(graph, cluster, mc, [0] * len(r.strategies))


def _seconds(graph: Graph, ops: np.ndarray, cluster: Cluster, r: MeshResult) -> float:
    """Predicted seconds per step of `ops` under candidate r's splits (as
    `mesh_cost.mesh_costs` divides them: batched ops over the data axis, and over the model
    axis where the layouts split them)."""
    n = r.d * r.m
    split = np.where(graph.batched, float(r.d), 1.0) * op_model_split(graph, r.strategies, r.m)
    t = op_times(graph, cluster.co_running(n), split, cluster.speedup_when_using(n),
                 data=float(r.d))
    return float(t[ops].sum())


def attention_advice(sites: ScoreSites | None, r: MeshResult, cluster: Cluster,
                     planned: Prediction, variant: str = "as written"
                     ) -> AttentionAdvice | None:
    """The advice for candidate r (the plan's, whose figures are `planned`), or None: no
    materialized scores, a pipelined candidate (priced from its stage step, not this
    step), or scores under `SHARE` of the step's time and of its peak memory. The step's
    figures are the plan's; the fused step's are the plan's less what the model predicts
    the fused kernels save on this candidate. `variant`: the plan's step variant (as
    written, micro-batches), which the fused step keeps."""
    if sites is None or r.stages > 1:
        return None
    base = _layout_prediction(sites.graph, cluster, r)
    fused = _layout_prediction(sites.fused, cluster, r)
    seconds = _seconds(sites.graph, sites.region, cluster, r)
    extra = base.peak_memory_bytes - fused.peak_memory_bytes
    step, peak = planned.step_time_s, planned.peak_memory_bytes
    if seconds < SHARE * step and extra < SHARE * peak:
        return None
    return AttentionAdvice(
        r.describe(), sites.instances, sites.shape, sites.dtype, sites.masked, seconds,
        float(step), float(extra), float(peak),
        _seconds(sites.fused, sites.carriers, cluster, r),
        float(step - (base.step_time_s - fused.step_time_s)), float(peak - extra),
        *((sites.replanned.describe(), float(sites.replanned.predicted.step_time_s),
           float(sites.replanned.predicted.peak_memory_bytes))
          if sites.replanned is not None else ("", 0.0, 0.0)), variant)


def _failed(what: str, e: BaseException) -> str:
    """An optional analysis's failure, as a note says it (the plan goes on without it)."""
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{what} not computed ({type(e).__name__}{': ' + first if first else ''})"


def planned_score_sites(notes: list[str], *args: Any, **kwargs: Any) -> ScoreSites | None:
    """`score_sites` for the planner: an optional analysis, whose failure is a note in
    `notes` and no advice, never the plan's failure."""
    try:
        return score_sites(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the advice is optional: the plan goes on
        notes.append(_failed("the attention advice", e))
        return None


def planned_advice(sites: ScoreSites | None, r: MeshResult, cluster: Cluster,
                   planned: Prediction, variant: str = "as written"
                   ) -> tuple[AttentionAdvice | None, str | None]:
    """`attention_advice` for the plan builder: (the advice, None), or (None, a note
    saying why it could not be priced): an optional part of the plan."""
    try:
        return attention_advice(sites, r, cluster, planned, variant), None
    except Exception as e:  # noqa: BLE001 - the advice is optional: the plan goes on
        return None, _failed("the attention advice", e)


def fused_alternative(graph: Graph | None, jaxpr: Any, in_roles: Sequence[LeafRole],
                      out_roles: Sequence[LeafRole], params: Sequence[ParamInfo],
                      device: DeviceSpec, search_fused: Callable[[Graph], SearchResult]
                      ) -> str:
    """Where no plan of the step fits, what cuDNN's fused attention would give (a
    sentence for the error, '' if the step materializes no attention scores or the
    target does not run the kernel): the search `search_fused` run on the fused
    counterfactual of `graph` (the step as written), its best plan, or the least memory
    its smallest candidate needs. Predicted."""
    if graph is None:
        return ""
    try:
        sites = score_sites(graph, jaxpr, in_roles, out_roles, params, device)
        found = None if sites is None else search_fused(sites.fused)
    except ValueError:   # no mesh to search
        return ""
    except Exception as e:  # noqa: BLE001 - an optional sentence of the error
        return f" ({_failed('What cuDNN fused attention would need', e)}.)"
    if sites is None or found is None:
        return ""
    best = found.results[found.best]
    pr = best.predicted
    head = (f" The step materializes its attention scores ({sites.instances} attention "
            f"score products of {scores_shape(sites.shape)}, {sites.dtype} queries and keys): "
            f"with "
            f"jax.nn.dot_product_attention(..., implementation=\"cudnn\""
            + (", is_causal=True" if sites.masked else "") + "), cuDNN's fused kernel, ")
    if best.fits:
        return head + (f"a plan fits: mesh {best.describe()}, step "
                       f"{pr.step_time_s * 1e3:.3f} ms, peak "
                       f"{si(pr.peak_memory_bytes, 'B')} per device (predicted).")
    return head + (f"the step as written would need {si(pr.peak_memory_bytes, 'B')} per "
                   f"device at the least (mesh {best.describe()}; predicted, before "
                   f"micro-batches: plan it with the fused kernel to see those).")


__all__ = ["SHARE", "ScoreSites", "attention_advice", "fused_alternative",
           "planned_advice", "planned_score_sites", "score_sites", "step_live"]
