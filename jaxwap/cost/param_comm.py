"""Each parameter's data-axis communication on one mesh, under each of its strategies.

The communication column of a mesh's table (`mesh_cost.MeshCosts`): per (parameter,
strategy), the (seconds, bytes) of its gradient reduction over the data axis as ring
collectives (`cost/collectives.py`): reduced where the weight is replicated (ZeRO-1: to
shards, the new weight then gathered), gathered and reduce-scattered where it is FSDP,
its shards also reduced across the replicas under HSDP. An FSDP layer whose activations
are smaller than its weight may instead have them moved (`collectives.fsdp_moves`); both
prices are kept, since which one a layout pays depends on its neighbours
(`mesh_prediction.grad_comms`). A parameter gathered in several passes (micro-batches)
or stacked over a scan's layers pays per pass and per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxwap.analysis.graph import Graph
from jaxwap.core.records import Strategy
from jaxwap.cost.collectives import fsdp_comm, grad_reduce_comm, hsdp_comm
from jaxwap.hardware.cluster import Cluster


def _gather_passes(graph: Graph) -> tuple[np.ndarray, np.ndarray]:
    """Per parameter, the passes its weight is gathered in and the layers its collectives
    run in: FSDP gathers once per loop iteration its own ops run in (micro-batches); a
    stacked parameter's collectives run in each layer of its scan, a slice each."""
    # loop iterations a parameter's own ops run in (micro-batches): FSDP gathers per pass
    passes = np.ones(len(graph.params))
    np.maximum.at(passes, graph.owner[graph.owner >= 0], graph.repeat[graph.owner >= 0])
    # a stacked parameter's ops repeat once per layer of its scan, each gathering one
    # layer's slice: the whole stack is gathered once per pass of the loops around it
    # ... and its collectives run in each layer iteration, a slice each
    layers = np.ones(len(graph.params))
    for j in np.flatnonzero(graph.stacked_dim >= 0):
        layers[j] = graph.params[j].shape[graph.stacked_dim[j]]
        passes[j] = max(1.0, passes[j] / layers[j])
    return passes, layers


def param_comm_costs(graph: Graph, cluster: Cluster,
                     strategies: Sequence[Sequence[Strategy]], d: int, m: int, r: int,
                     moves: set[int]
                     ) -> tuple[tuple[tuple[tuple[float, float], ...], ...],
                                tuple[tuple[tuple[float, float], ...], ...],
                                tuple[tuple[tuple[float, float] | None, ...], ...]]:
    """Per parameter and strategy, the (seconds, bytes) of its data-axis communication:
    the search's estimate (moved where `moves` says XLA moves activations, were every
    layer FSDP), gathered, and moved (None where its activations cannot move: not FSDP,
    HSDP, or activations no smaller than its weight)."""
    reps = graph.grad_repeat
    passes, layers = _gather_passes(graph)
    inner = cluster.devices_in_node(d, m)   # of the data axis: the model axis is innermost
    comm_of: dict[tuple[float, bool, bool, float, float, bool, float, float],
                  tuple[float, float]] = {}

    def price(j: int, st: Strategy, local: float, moved: bool) -> tuple[float, float]:
        # the blocks of a deep model repeat the same few shapes: price each once
        uses = float(graph.fsdp_gathers[j])
        key = (local, st.data_sharded, st.state_spec is not None, float(reps[j]),
               float(passes[j]), moved, float(layers[j]), uses)
        if key not in comm_of:
            if st.data_sharded and r > 1:
                comm_of[key] = hsdp_comm(local, d, r, cluster, reps[j], passes[j], uses,
                                         cluster.devices_in_node(d // r, m))
            elif st.data_sharded:
                # gathered where the batch meets it, each pass (a scan's backward loop
                # gathers it again), each partial gradient reduced
                comm_of[key] = fsdp_comm(local, d, cluster, reps[j], passes[j], inner,
                                         moved, layers[j], uses)
            else:
                comm_of[key] = grad_reduce_comm(local, d, cluster, reps[j],
                                                zero1=st.state_spec is not None,
                                                inner=inner, iterations=layers[j])
        return comm_of[key]

    g_comm, gathered, moved_c = [], [], []
    for j, strats in enumerate(strategies):
        row_g, row_m = [], []
        whole = graph.params[j].nbytes
        for st in strats:
            local = whole / (m if st.tp != "none" else 1)
            # under tensor parallelism too (the model axis splits the rest); not under
            # HSDP, whose replicas still all-reduce the weight's gradient shard
            act = graph.layer_of[j].act_in_bytes if j in graph.layer_of else np.inf
            row_g.append(price(j, st, local, False))
            row_m.append(price(j, st, act, True)
                         if st.data_sharded and r == 1 and act < local else None)
        g_comm.append(tuple(mv if mv is not None and j in moves else g
                            for g, mv in zip(row_g, row_m, strict=True)))
        gathered.append(tuple(row_g))
        moved_c.append(tuple(row_m))
    return tuple(g_comm), tuple(gathered), tuple(moved_c)


__all__ = ["param_comm_costs"]
