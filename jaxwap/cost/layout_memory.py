"""A layout's memory per device: each live byte of the step weighed by how its layout
splits it (`Graph.live`'s columns), and the peak over the step's points."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxwap.analysis.graph import NUM_CLASSES, WHOLE, Graph
from jaxwap.core.records import Strategy
from jaxwap.cost.collectives import moved_in


def memory_weights(graph: Graph, d: int, strats: Sequence[Strategy], m: int,
                   r: int = 1) -> np.ndarray:
    """Per-bucket share of each live byte on one device: 1/d for batched values, 1 for the
    rest, per parameter and class one over how many ways that class is split (0 for
    state kept in host memory), and for the batched values a tensor-parallel layer's
    layout splits (`Graph.tp_live_param`) 1/(d*m) where that parameter's layout is of
    that kind, 1/d where it is not. With r replicas (HSDP) the data axis shards
    parameters d/r ways. What an FSDP layout gathers whole (WHOLE) counts where the
    layout's own layers gather it, not where they move activations (`collectives.moved_in`)."""
    P = len(graph.params)
    base = 2 + NUM_CLASSES * P
    w = np.empty(graph.live.shape[1])
    w[0] = 1.0 / d
    w[1] = 1.0
    div = divisor_rows(strats, d // r, m)
    if r == 1:
        # a layer whose activations XLA moves keeps its weight sharded: nothing whole
        div[sorted(moved_in(graph.layers, strats)), WHOLE] = np.inf
    w[2:base] = (1.0 / div.T[:NUM_CLASSES]).reshape(-1)
    if len(graph.tp_live_param):
        split = np.array([strats[j].tp == k for j, k in
                          zip(graph.tp_live_param.tolist(), graph.tp_live_kind, strict=True)])
        w[base:] = np.where(split, 1.0 / (d * m), 1.0 / d)
    return w


def divisor_rows(strats: Sequence[Strategy], d: int, m: int) -> np.ndarray:
    """[layouts, classes]: each layout's `Strategy.divisors` on a (d, m) mesh, computed
    once per layout object (the layers of a deep model share their layouts' objects, and
    a search weighs thousands of layouts)."""
    of: dict[int, tuple[float, ...]] = {}
    return np.array([of[id(s)] if id(s) in of else of.setdefault(id(s), s.divisors(d, m))
                     for s in strats], dtype=np.float64).reshape(len(strats), NUM_CLASSES)


def peak_memory(graph: Graph, d: int, m: int, strats: Sequence[Strategy],
                r: int = 1) -> tuple[float, int, float]:
    """(peak live bytes per device, index of the peak point, scratch bytes: the peak
    over what is live when the step starts, its state and batch; what a step allocates
    for itself, as XLA's temp allocation holds it)."""
    per_point = graph.live_at(memory_weights(graph, d, strats, m, r))
    k = int(np.argmax(per_point))
    return float(per_point[k]), k, float(per_point[k] - per_point[0])


__all__ = ["divisor_rows", "memory_weights", "peak_memory"]
