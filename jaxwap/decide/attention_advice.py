"""The advice on attention that materializes its scores, priced for a plan's candidate.

Computed the unfused way, each attention layer writes its B x heads x T x S scores to
memory: time and memory that grow with the square of the sequence, where cuDNN's fused
kernel (`implementation="cudnn"`) keeps them on chip. `decide.score_detection` finds the
scores in a step's flat program and `decide.fused_counterfactual` builds the same step
with the fused kernel in their place (`ScoreSites`); this module prices both.

`attention_advice` prices both for a plan's candidate and says, where the scores take at
least `SHARE` of the step's predicted time or peak memory, what they take and what the
fused kernel would give (`Plan.attention`, rendered by `Plan.explain()`).
`fused_alternative` says, where no plan of the step fits, what the fused kernel would
give instead. Every figure is predicted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxwap.analysis.graph import Graph
from jaxwap.analysis.roles import LeafRole, ParamInfo
from jaxwap.core.records import Prediction
from jaxwap.core.units import si
from jaxwap.cost.mesh_cost import mesh_costs, op_model_split
from jaxwap.cost.mesh_prediction import predict
from jaxwap.cost.op_time import op_times
from jaxwap.decide.fused_counterfactual import ScoreSites, score_sites
from jaxwap.hardware.cluster import Cluster
from jaxwap.hardware.device import DeviceSpec
from jaxwap.plans.advice import AttentionAdvice, scores_shape
from jaxwap.search.solve import MeshResult, SearchResult

#: Advise where the scores take at least this share of the step's predicted time or peak
#: memory per device (a threshold chosen, not measured: where less, the advice is noise).
SHARE = 0.10


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


__all__ = ["SHARE", "attention_advice", "fused_alternative", "planned_advice",
           "planned_score_sites"]
