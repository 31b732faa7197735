"""The step one pipeline stage runs, traced and analysed: what the pipelined search
solves for each stage count (`pipeline_search`).

A stage step is built anew from the traced loss (`layer_scan_rewrite.stack_cut`) each
time, so its analyses are kept (`graph_cache.kept`), keyed on what they follow from: the
loss and optimizer, the abstract arguments, the stack's cut and the rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxwap.analysis.graph import Graph, analyze
from jaxwap.analysis.graph_cache import abstract_key, kept
from jaxwap.analysis.trace import layout_of
from jaxwap.runtime.layer_scan import LayerScan, batch_at_rows
from jaxwap.runtime.layer_scan_rewrite import stack_cut
from jaxwap.runtime.train_step import TrainStep


def stage_step(fn: TrainStep, args: Sequence[Any], scan: LayerScan, layers: int,
               rows: int, remat_stack: bool = False) -> tuple[TrainStep, tuple[Any, ...]]:
    """The step one stage runs, and its (params, opt_state, batch), abstract: the loss
    over `layers` of the stack's layers (`layer_scan_rewrite.stack_cut`, from the traced
    jaxpr: the user's loss is never called with fewer layers), the stacked leaves cut to
    `layers` layers, the optimizer state made for them, the batch's rows cut to `rows`."""
    params, _, batch = args
    leaves, treedef = jax.tree_util.tree_flatten(params)
    stacked = set(scan.stacked)
    cut = [jax.ShapeDtypeStruct((layers, *x.shape[1:]) if i in stacked else x.shape,
                                x.dtype) for i, x in enumerate(leaves)]
    stage_params = jax.tree_util.tree_unflatten(treedef, cut)
    step = TrainStep(stack_cut(fn.loss_and_aux(), scan, layers, remat_stack), fn.optimizer,
                     has_aux=True)
    opt_state = jax.eval_shape(fn.init, stage_params)
    return step, (stage_params, opt_state, batch_at_rows(batch, rows))


def stage_graph(fn: TrainStep, args: Sequence[Any], scan: LayerScan, layers: int,
                rows: int, fixed_rows: bool, remat_stack: bool = False) -> Graph:
    """The analysed step of one stage: `layers` layers of the stack, `rows` rows (the
    batch size fixed by the user where `fixed_rows`); with `remat_stack` the stack
    checkpointed whole (`stack_cut`). Kept for the last few stage steps."""
    def build() -> Graph:
        step, stage_args = stage_step(fn, args, scan, layers, rows, remat_stack)
        layout, closed = layout_of(step, stage_args, {}, stage_args[0],
                                   rows if fixed_rows else None)
        return analyze(closed, layout.inputs.roles, layout.outputs.roles, layout.params,
                       rows)
    return kept(("stage", fn.loss_and_aux(), fn.optimizer, *abstract_key(args), scan,
                 layers, rows, remat_stack, fixed_rows), build)


__all__ = ["stage_graph", "stage_step"]
