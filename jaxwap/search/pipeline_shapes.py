"""The shapes and layouts a pipeline may take, for `pipeline_search` to price: the stage
counts tried, the (micro-batches, rounds) of each, the stage's layouts with the stack over
the stage axis (uneven splits stored along another dim), how the loop's carried
activations split over the model axis, and what the stack's layers keep for the backward
pass. No tracing here: arithmetic on shapes, specs and analysed graphs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxwap.analysis.graph import NUM_CLASSES, Graph
from jaxwap.core.records import DATA, MODEL, STAGE, Strategy
from jaxwap.cost.layout_memory import memory_weights
from jaxwap.runtime.layer_scan import LayerScan
from jaxwap.runtime.stage_layout import carry_split_dim, chunking

# Stage counts tried per plan: each costs a trace and an analysis of the stage step.
MAX_STAGE_COUNTS = 4
# Rounds of the circular schedule tried (1: GPipe).
REPEATS = (1, 2, 4)
# Micro-batch counts priced per stage mesh (pricing one is cheap: no trace).
MICRO_COUNTS = 12


def stage_counts(L: int, n: int, forced: dict[str, int] | None) -> list[int]:
    """Stage counts to try: the forced one, else those the n devices divide into that
    leave every stage >= 2 layers, at most `MAX_STAGE_COUNTS`: the fewest empty slots
    first (an uneven split pads its short chunks, `stage_layout.chunking`; a divisor of L
    has none), then powers of two; within each such class, counts spread from its fewest
    stages to its most (`_spread`). The fewest alone left out what the largest models
    need: 105 layers on 2,520 GPUs have six even splits, and 3, 5, 7 and 15 stages were
    tried where Megatron's 35 (each stage small enough to keep its layers' inputs for
    every micro-batch, with no forward pass run again) is the best priced."""
    if forced is not None:
        p = forced["stages"]
        return [p] if L // p >= 2 and p <= n else []
    ok = [p for p in range(2, min(L // 2, n) + 1) if n % p == 0]
    classes: dict[tuple[int, bool], list[int]] = {}
    for p in ok:
        classes.setdefault((-L % p, p & (p - 1) != 0), []).append(p)
    chosen: list[int] = []
    for key in sorted(classes):
        chosen += _spread(classes[key], MAX_STAGE_COUNTS - len(chosen))
    return sorted(chosen)


def _spread(counts: list[int], k: int) -> list[int]:
    """At most k of `counts` (ascending), evenly spaced by rank, the first and the last
    among them: the divisors of a layer or device count grow about geometrically, so this
    spreads them on a log scale."""
    if k <= 0:
        return []
    if len(counts) <= k:
        return counts
    if k == 1:
        return counts[:1]
    return [counts[round(i * (len(counts) - 1) / (k - 1))] for i in range(k)]


def schedule_shapes(rows: int, p: int, L: int, forced: dict[str, int] | None
                    ) -> list[tuple[int, int]]:
    """(micro-batches, rounds) worth pricing: micro-batch counts that divide the rows,
    from p (the least that keeps every stage busy in the steady state) to a row per
    device (at most `MICRO_COUNTS` of them, spread evenly on a log scale, the least and
    the most always among them), and rounds whose chunks of the L layers fill a stage's
    k = ceil(L / p) slots exactly (every round count dividing k, where p divides L;
    circular needs m >= p)."""
    ms = [mb for mb in range(p, rows + 1) if rows % mb == 0]
    if len(ms) > MICRO_COUNTS:
        picks = np.unique(np.round(np.geomspace(1, len(ms), MICRO_COUNTS)).astype(int) - 1)
        ms = [ms[int(i)] for i in picks]
    ms = ms or [mb for mb in range(1, min(rows, p) + 1) if rows % mb == 0][-1:]
    k = chunking(L, p)[0]

    def fills(r: int) -> bool:
        return L >= p * r and chunking(L, p, r)[0] * r == k
    rs = [r for r in REPEATS if fills(r)]
    if forced is not None:
        if "micro_batches" in forced:
            ms = [forced["micro_batches"]] if rows % forced["micro_batches"] == 0 else []
        if "repeats" in forced:
            rs = [forced["repeats"]] if fills(forced["repeats"]) else []
    return [(mb, r) for mb in ms for r in rs if r == 1 or mb >= p]


def staged_layouts(strategies: Sequence[Strategy], stacked: set[int], graph: Graph, p: int,
            d: int, m: int, uneven: bool) -> tuple[Strategy, ...] | None:
    """The stage step's layouts with each stacked parameter (and its optimizer state)
    split over the stage axis: along its leading (layer) dim; for an `uneven` split,
    whose layers do not divide over the stages, along the first other dim that divides
    (beside the axis already there, if any), the step laying the stack out by layers
    inside (`stage_layout.to_stages`). None: a stacked parameter has no such dim."""
    sizes = {DATA: d, MODEL: m}

    def over_stages(spec: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[Any, ...] | None:
        if not uneven:
            return (STAGE, *spec[1:])
        for dim in range(1, len(shape)):
            axes = () if spec[dim] is None else (spec[dim],)
            if shape[dim] % (math.prod(sizes[a] for a in axes) * p) == 0:
                return (None, *spec[1:dim], (*axes, STAGE) if axes else STAGE,
                        *spec[dim + 1:])
        return None

    out = []
    for j, s in enumerate(strategies):
        if j in stacked:
            shape = graph.params[j].shape
            spec = over_stages(tuple(s.spec), shape)
            state = None if s.state_spec is None else over_stages(tuple(s.state_spec), shape)
            if spec is None or (s.state_spec is not None and state is None):
                return None
            s = dataclasses.replace(s, name=f"stage+{s.name}", spec=spec, state_spec=state)
        out.append(s)
    return tuple(out)


def stage_specs(strategies: Sequence[Strategy], stacked: Sequence[int]
                 ) -> tuple[tuple[str | None, ...], ...]:
    """`StepVariant.stage_specs` of the stage's layouts: for each stacked parameter (in
    the scan's order) its spec beyond the layer dim (over data: FSDP, the loop gathers
    its layers; over model: tensor parallelism); empty when none is sharded."""
    specs = tuple(tuple(strategies[j].spec[1:]) for j in stacked)
    return specs if any(a is not None for spec in specs for a in spec) else ()


def carry_split(scan: LayerScan, m: int) -> int:
    """The ways the loop keeps its carried activations split over a model axis of m
    devices: m where a dim of the carry's row divides (`stage_layout.carry_split_dim`, the
    rule the pipelined step runs by), else 1."""
    return m if carry_split_dim(scan.carry_shape[1:], m) is not None else 1


def stack_kept(graph: Graph, twice: Graph, strategies: Sequence[Strategy], m: int
                ) -> float:
    """What the stack's layers keep for the backward pass (all devices' bytes, split
    over the model axis where `strategies` make them so): the most batched bytes live at
    once in the stage step with twice the layers, less in the stage step itself. Batched
    values only, those a tensor-parallel layout splits included (`Graph.tp_live_param`);
    the parameters' own bytes are the layouts' business."""
    def peak(g: Graph) -> float:
        w = memory_weights(g, 1, strategies, m)
        w[1:2 + NUM_CLASSES * len(g.params)] = 0.0
        return float(g.live_at(w).max()) if len(g.live) else 0.0
    return max(0.0, peak(twice) - peak(graph))


def inputs_split(kept: float, scan: LayerScan, k: int, rows: float, split: int) -> float:
    """What the stack's k layers keep for the backward pass (`stack_kept`, on `rows`
    rows), with each layer's input kept split `split` ways over the model axis, as a
    stage's chunk keeps it between its layers: the loop keeps its activations split so
    (`schedule.pipelined`'s `carry_axis`: sequence parallelism), and XLA carries that
    split into the layers (compiled on XLA:CPU, 2 stages x 2 data x 2 model, 16 layers
    under `jax.checkpoint`: 17.1 MB of peak, predicted 20.5 MB with this credit and 25.8
    MB without). Each layer keeps its input, one carried activation (all a checkpointed
    layer keeps), 1/split of it on each device of the axis. At most what they keep in all
    is credited so."""
    if split <= 1:
        return kept
    inputs = min(kept, k * scan.carry_row_bytes * rows)
    return kept - inputs * (1 - 1 / split)


__all__ = ["MAX_STAGE_COUNTS", "MICRO_COUNTS", "REPEATS", "carry_split", "inputs_split",
           "schedule_shapes", "stack_kept", "stage_counts", "stage_specs", "staged_layouts"]
