"""What communication costs: ring collectives, and the collectives a layout implies.

Every collective is priced by the same ring formulas, whether the model foresaw it (a
gradient all-reduce, the gathers around a tensor-parallel layer) or XLA put it in the
compiled program (`collective_cost` of a parsed `Collective`):
`2(n-1)/n * bytes / bw + 2(n-1) * latency` for an all-reduce and half that for an
all-gather or reduce-scatter.

What data parallelism reduces is found the way XLA's SPMD partitioner finds it
(`grad_reductions.batch_dims`): an op that sums over the batch dim leaves every device a
partial sum,
which is all-reduced over the data axis where it is made, before anything adds it to
another. So a weight used by several batched ops (a tied embedding: lookup and LM head)
has its gradient reduced once per use, not once per step; and a loss, a metric or a
batch-norm statistic is reduced too. (XLA:CPU compiles it so; XLA:GPU's
all-reduce-reassociate pass may merge `add(all-reduce(a), all-reduce(b))` into one when
only reshapes, pads, slices or converts stand between them, so there this is an upper
bound that verification corrects.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from jaxwap.core.records import DATA, MODEL, REPLICA, Collective, Strategy
from jaxwap.hardware.cluster import Cluster

if TYPE_CHECKING:
    from jaxwap.analysis.graph import Graph
    from jaxwap.analysis.op_splits import Layer


def _step(cluster: Cluster, across: bool) -> tuple[float, float]:
    """(bandwidth, latency) of one ring step inside a node or between nodes."""
    if across:
        return cluster.inter_node_bandwidth, cluster.inter_node_latency
    return cluster.link_bandwidth, cluster.link_latency


def _ring(nbytes: float, n: int, cluster: Cluster, factor: int, latency: bool,
          across: bool) -> float:
    """Seconds of a ring over n devices moving factor*(n-1)/n of nbytes, on the links
    inside a node or between nodes (a ring that leaves a node runs at its slowest link);
    with `latency`, its steps' latency and the collective's own overhead."""
    bw, lat = _step(cluster, across)
    if across:
        bw, lat = min(bw, cluster.link_bandwidth), max(lat, cluster.link_latency)
    return factor * (n - 1) / n * nbytes / bw \
        + latency * (factor * (n - 1) * lat + cluster.device.collective_overhead_s)


def ring_fit(all_reduce_s: float, all_gather_s: float, n: int) -> tuple[float, float]:
    """(latency per ring step, overhead per collective) that price a small all-reduce
    (2(n-1) steps) and all-gather (n-1 steps) over n devices as timed: the two unknowns
    of the two formulas. Where both cannot hold (a gather no cheaper than the all-reduce,
    or under half of it: noise), the all-reduce still does, and neither goes below 0."""
    lat = min(max(all_reduce_s - all_gather_s, 0.0), all_reduce_s / 2) / (n - 1)
    return lat, max(all_reduce_s - 2 * (n - 1) * lat, 0.0)


def all_reduce(nbytes: float, n: int, cluster: Cluster, latency: bool = True,
               inner: int | None = None) -> tuple[float, float]:
    """(seconds, bytes sent per device) of an all-reduce over n devices, `inner` of which
    share each node (None: all of them, one node).

    Inside one node, a ring: `2(n-1)/n * bytes / bw + 2(n-1) * latency`. Across nodes, the
    cheaper of a flat ring (paced by the slowest link it crosses) and the hierarchical
    reduction (seed 002's hybrid aggregation): reduce-scatter inside each node, all-reduce
    each 1/inner shard across the nodes (every device over its own network share), then
    all-gather inside. `latency=False` leaves out the per-step latency, for collectives
    XLA's combiner merges into one (gradient reductions): their latency is charged once
    per step.
    """
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    inner = n if inner is None else max(1, min(inner, n))
    flat_sent = 2 * (n - 1) / n * nbytes
    if inner >= n:
        return _ring(nbytes, n, cluster, 2, latency, False), flat_sent
    outer = n // inner
    flat = _ring(nbytes, n, cluster, 2, latency, True)
    inside = 2 * _ring(nbytes, inner, cluster, 1, latency, False) if inner > 1 else 0.0
    across = _ring(nbytes / inner, outer, cluster, 2, latency, True)
    if inside + across < flat:
        sent = 2 * (inner - 1) / inner * nbytes + 2 * (outer - 1) / outer * nbytes / inner
        return inside + across, sent
    return flat, flat_sent


def all_reduce_latency(n: int, cluster: Cluster, inner: int | None = None) -> float:
    """Seconds of latency alone in an all-reduce over n devices (`inner` per node): what a
    combined reduction pays once, whatever it carries."""
    if n <= 1:
        return 0.0
    inner = n if inner is None else max(1, min(inner, n))
    once = cluster.device.collective_overhead_s
    if inner >= n:
        return 2 * (n - 1) * cluster.link_latency + once
    flat = 2 * (n - 1) * max(cluster.inter_node_latency, cluster.link_latency) + once
    outer = n // inner
    # the hierarchical reduction is three collectives
    return min(flat, 2 * (inner - 1) * cluster.link_latency + 3 * once
               + 2 * (outer - 1) * max(cluster.inter_node_latency, cluster.link_latency))


def all_gather(nbytes: float, n: int, cluster: Cluster, latency: bool = True,
               inner: int | None = None) -> tuple[float, float]:
    """(seconds, bytes sent per device) of an all-gather (or reduce-scatter) whose full
    result is `nbytes`, over n devices `inner` of which share each node. Across nodes the
    cheaper of a flat ring and the hierarchical one: gather the 1/n pieces of the same
    rank across the nodes, then the node's pieces inside it."""
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    inner = n if inner is None else max(1, min(inner, n))
    flat_sent = (n - 1) / n * nbytes
    if inner >= n:
        return _ring(nbytes, n, cluster, 1, latency, False), flat_sent
    outer = n // inner
    flat = _ring(nbytes, n, cluster, 1, latency, True)
    across = _ring(nbytes / inner, outer, cluster, 1, latency, True)
    inside = _ring(nbytes, inner, cluster, 1, latency, False) if inner > 1 else 0.0
    if across + inside < flat:
        return across + inside, (outer - 1) / outer * nbytes / inner \
            + (inner - 1) / inner * nbytes
    return flat, flat_sent


def send(nbytes: float, cluster: Cluster, across: bool) -> float:
    """Seconds of one point-to-point send of `nbytes` per device (a pipeline stage handing
    its activation to the next), inside a node or between nodes."""
    bw, lat = _step(cluster, across)
    return lat + cluster.device.collective_overhead_s + nbytes / bw


def axis_inner(cluster: Cluster, axes: Sequence[str], d: int, m: int, r: int = 1) -> int:
    """How many devices of one group over these mesh axes share a node, on a (d, m) mesh
    (of r replicas: the data axis as (replica, data/r)) laid out node by node with the
    model axis innermost (`compile.make_mesh`)."""
    axes = tuple(axes)
    if axes == (MODEL,):
        return cluster.devices_in_node(m, 1)
    if axes == (REPLICA,):
        return cluster.devices_in_node(r, d // r * m)
    if axes == (DATA,) and r > 1:
        return cluster.devices_in_node(d // r, m)
    if axes in ((DATA,), (REPLICA, DATA)):
        return cluster.devices_in_node(d, m)
    return cluster.devices_in_node(d * m, 1)


def collective_cost(c: Collective, cluster: Cluster, d: int = 1,
                    m: int = 1, r: int = 1) -> tuple[float, float]:
    """(seconds, bytes sent per device) of a collective XLA inserted on a (d, m) mesh of r
    replicas, by the formulas the model uses for its own, on the links its group spans;
    each array past the first a combined collective carries adds the backend's latency
    per buffer (`buffer_latency`)."""
    n = c.group_size
    inner = axis_inner(cluster, c.axes, d, m, r) if c.axes else None
    extra = buffer_latency(c.buffers - 1, n, cluster)
    if c.kind == "all-reduce":
        t, b = all_reduce(c.bytes, n, cluster, inner=inner)
    elif c.kind in ("all-gather", "all-to-all"):
        t, b = all_gather(c.bytes, n, cluster, inner=inner)
    elif c.kind == "reduce-scatter":
        t, b = all_gather(c.bytes * n, n, cluster, inner=inner)
    elif n <= 1:  # collective-permute
        return 0.0, 0.0
    else:
        bw, lat = _step(cluster, inner is not None and inner < n)
        t, b = c.bytes / bw + lat + cluster.device.collective_overhead_s, float(c.bytes)
    return t + extra, b


def buffer_latency(buffers: float, d: int, cluster: Cluster) -> float:
    """Seconds `buffers` of XLA's combined collectives over d devices add where the
    backend reduces each buffer apart (`DeviceSpec.link_buffer_latency_s`: gloo on CPU;
    0 where the library groups them, as NCCL does)."""
    return buffers * cluster.device.link_buffer_latency_s if d > 1 else 0.0


def batch_reduce_comm(graph: Graph, d: int, cluster: Cluster,
                      inner: int | None = None) -> tuple[float, float]:
    """(seconds, bytes) of the partial sums over the batch that are not gradients (the
    loss, metrics, batch-norm statistics: `Graph.reduce_bytes`), all-reduced over the data
    axis whatever the parameters' layouts; the ring latency left to the combined
    reduction, each sum a buffer of its own."""
    t, b = all_reduce(graph.reduce_bytes, d, cluster, False, inner)
    return t + buffer_latency(graph.reduce_count, d, cluster), b


def grad_reduce_comm(param_bytes: float, d: int, cluster: Cluster, reductions: float = 1.0,
                     zero1: bool = False, inner: int | None = None, iterations: float = 1.0
                     ) -> tuple[float, float]:
    """(seconds, bytes) of reducing a gradient that is not data-sharded, once per partial
    gradient (`reductions`), each a buffer of the combined reduction. ZeRO-1 reduces it
    to shards and all-gathers the new weight. Where the backend combines collectives
    (`DeviceSpec.combines_collectives`): a reduce-scatter and the gather, the bytes of
    the all-reduce they replace in two combined buffers (textbook; unverified on a GPU).
    XLA:CPU all-reduces the whole gradient (each device slicing its share) and gathers
    each updated weight in a collective of its own, paying its latency (GPT-2-small's 28
    weights on 2 devices: one all-reduce of 30 buffers and 28 all-gathers). A layer
    scan's stacked weight is reduced in each of its `iterations`, a slice each, a buffer
    each (a scanned 4-layer MLP: 8 buffers for its two stacked parameters)."""
    t, b = all_reduce(param_bytes, d, cluster, False, inner)
    t, b = t * reductions, b * reductions
    buffers = buffer_latency(reductions * iterations, d, cluster)
    if not zero1:
        return t + buffers, b
    if cluster.device.combines_collectives:
        return t + buffer_latency(2 * reductions, d, cluster), b
    g_t, g_b = all_gather(param_bytes, d, cluster, True, inner)
    return t + buffers + g_t, b + g_b


def fsdp_moves(layers: Sequence[Layer], data_dim: Mapping[int, int]) -> set[int]:
    """The parameters whose FSDP layout XLA partitions by moving the batch's activations
    instead of gathering the weight, when every layer is FSDP-sharded on `data_dim` (per
    parameter, the dim its layout splits over the data axis).

    XLA's SPMD partitioner keeps a layer's weight sharded and moves the activations when
    the data operand of its matmul is the smaller operand and the weight's split lines up
    with the activations without resharding them along the contraction: the weight split
    on an output dim (the input is all-gathered over the batch, each device computes its
    output features), or on the contracted dim when the input arrives whole or split on
    those features, as it does from a layer that moved its activations (split output
    features, or partial sums all-reduced to every device). A weight split on the
    contracted dim against a batch-split input is gathered whole, however small the
    batch. `layers` in forward order; each follows the one before.

    Not captured: the partitioner also looks ahead. A 4096 x 4096 layer split on its
    output dim between ZeRO-1 layers (its output read batch-split) moved behind relu
    but was gathered behind tanh, gelu and sigmoid (161 MB where 10.7 is priced), while
    the same split feeding an FSDP layer split on its input dim moved behind tanh too.

    Checked on compiled programs (`tests/test_comm_fidelity.py`): 3-layer MLPs, f32 and
    bf16, widths 256-9216, batches 8-4096, data axes of 2 and 4, and the zoo's CNNs
    (AlexNet at batch 8 and 32 px moved, 0.6 MB where the weights' price was 130 MB; at
    batch 128 and 224 px it gathered them all, 386 MB)."""
    moved: set[int] = set()
    features_split = False   # the layer before left its output whole or feature-split
    for L in layers:
        f = data_dim.get(L.param)
        smaller = bool(L.weight_bytes) and L.act_in_bytes < L.weight_bytes
        on_out = f is not None and f in L.out_dims
        on_in = f is not None and f in L.in_dims
        features_split = smaller and (on_out or (on_in and features_split))
        if features_split:
            moved.add(L.param)
    return moved


def moved_in(layers: Sequence[Layer], chosen: Sequence[Strategy]) -> set[int]:
    """`fsdp_moves` for one layout: the data dims the chosen strategies (one per parameter)
    split, each data-sharded layer's own. A layer moves or gathers by what the layers
    before it chose, so a mixed layout has its own answer: a weight behind a ZeRO-1 layer
    is gathered where, behind an FSDP one, its activations would move (AlexNet-small's
    fc7 on 4x1, FSDP between ZeRO-1 layers: 195 MB compiled where the all-FSDP answer
    priced 21 MB)."""
    return fsdp_moves(layers, {j: st.spec.index(DATA) for j, st in enumerate(chosen)
                               if st.data_sharded and DATA in st.spec})


def fsdp_comm(param_bytes: float, d: int, cluster: Cluster, reductions: float = 1.0,
              passes: float = 1.0, inner: int | None = None, moved: bool = False,
              iterations: float = 1.0, uses: float = 1.0) -> tuple[float, float]:
    """(seconds, bytes) of a data-sharded (ZeRO-3 / FSDP) weight.

    Gathered, where the backend combines collectives (`DeviceSpec.combines_collectives`;
    unverified on a GPU): the textbook price, gathered for the forward and again for the
    backward pass in each of `passes` loop iterations (micro-batches), its gradient
    reduce-scattered once per partial gradient (`reductions`), each a combined buffer.
    XLA:CPU, as its compiled programs show: the SPMD partitioner gathers the weight
    `uses` times a pass (`fsdp_gathers.fsdp_gathers`): a matmul's weight once, where the
    forward pass first uses it, the backward pass of the same iteration reading that
    gather; a norm's scale, and the per-channel values computed from it, where each meets
    the batch (a batch norm's 7 times). Each gather is a collective of its own paying its
    latency; each partial gradient is all-reduced whole (each device slicing its share),
    a buffer of the combined reduction. A layer scan's stacked weight has its collectives
    in each of the scan's `iterations`, on a slice, and its backward loop gathers it
    again. GPT-2-small's 28 weights on 2 devices: 33 gathers of weights and one
    all-reduce of 30 buffers; the textbook price, on gloo, was 1.6x its measured step on
    2 processes. ResNet-50-small's 29: 85 gathers, where one a weight had priced its
    FSDP step on gloo at 0.67 of its measured time.

    Moved (`fsdp_moves`): `param_bytes` are the layer input's; three collectives of that
    size (XLA sent 1.0-1.6x that in f32 where the weights were 5 MB or more, twice it in
    bf16, whose activations XLA:CPU moved at f32 width), each a collective of its own
    between the layer's kernels, paying its latency (on gloo AlexNet-small's 24 on 2
    processes took about 45 ms of a 117 ms step)."""
    if moved or cluster.device.combines_collectives:
        t, sent = all_gather(param_bytes, d, cluster, moved, inner)
        k = 2 * passes + reductions
        return k * t + (0.0 if moved else buffer_latency(k, d, cluster)), k * sent
    gathers = passes * (2 if iterations > 1 else uses) * iterations
    g_t, g_b = all_gather(param_bytes / iterations, d, cluster, True, inner)
    r_t, r_b = all_reduce(param_bytes, d, cluster, False, inner)
    return (gathers * g_t + reductions * r_t
            + buffer_latency(reductions * iterations, d, cluster),
            gathers * g_b + reductions * r_b)


def hsdp_comm(param_bytes: float, d: int, r: int, cluster: Cluster,
              reductions: float = 1.0, passes: float = 1.0, uses: float = 1.0,
              inner: int | None = None) -> tuple[float, float]:
    """(seconds, bytes) of a weight sharded over d/r devices of the data axis and
    replicated across r replicas of them (HSDP, PyTorch's HYBRID_SHARD): FSDP's gathers
    and gradient reduce-scatters over the d/r devices, `inner` of them inside a node (all
    of them when None: a replica a node), then the gradient shard all-reduced across the
    replicas (over the network)."""
    di = d // r
    t_in, b_in = fsdp_comm(param_bytes, di, cluster, reductions, passes,
                           inner=di if inner is None else inner, uses=uses)
    t_x, b_x = all_reduce(param_bytes / di, r, cluster, False, 1)
    return t_in + reductions * t_x + buffer_latency(reductions, r, cluster), \
        b_in + reductions * b_x


def tp_group_cost(group: Sequence[Layer], prev: str, kinds: Sequence[str], d: float, m: int,
                  cluster: Cluster, repeat: float = 1.0) -> tuple[float, float]:
    """(seconds, bytes) of model-axis communication a group of sibling layers (one input,
    `Graph.layer_groups`) of the given kinds adds after a layer of kind `prev`:
    Megatron's column-then-row pairing costs one all-reduce forward and one backward; an
    unpaired layer pays gathers to restore a replicated activation. The siblings' shared
    input is gathered once; each column-parallel sibling's input gradient is a partial sum
    of its own, all-reduced (XLA:CPU combines them into one collective, bytes unchanged).
    A group in a loop (scanned layers, micro-batches) pays it in each of its `repeat`
    iterations, on one iteration's activations. A model axis wider than a node (a cluster
    of one device per node) pays the network's links."""
    if m <= 1:
        return 0.0, 0.0
    a_in = group[0].act_in_bytes / d
    inner = cluster.devices_in_node(m)   # the model axis is the innermost
    parts: list[tuple[float, float]] = []
    if prev == "col" and any(k != "row" for k in kinds):
        parts.append(all_gather(a_in, m, cluster, inner=inner))
    for layer, kind in zip(group, kinds, strict=True):
        if kind == "col" and layer.needs_input_grad:
            parts.append(all_reduce(a_in, m, cluster, inner=inner))
        elif kind == "row":
            parts.append(all_reduce(layer.act_out_bytes / d, m, cluster, inner=inner))
            if prev != "col" and layer.needs_input_grad:
                parts.append(all_gather(a_in, m, cluster, inner=inner))
    return repeat * sum(p[0] for p in parts), repeat * sum(p[1] for p in parts)


def group_kind(kinds: Sequence[str]) -> str:
    """What a group of siblings leaves for the next layer: split over the model axis
    ("col") if any sibling is column-parallel (what they feed together, attention or a
    gated product, is then split with it), else whole ("row" all-reduces its output)."""
    return "col" if "col" in kinds else ("row" if "row" in kinds else "none")


def tp_final_cost(layer: Layer, kind: str, d: float, m: int,
                  cluster: Cluster, repeat: float = 1.0) -> tuple[float, float]:
    """A column-sharded last layer leaves its output sharded: gather it for the loss (in
    each of its `repeat` loop iterations)."""
    if m <= 1 or kind != "col":
        return 0.0, 0.0
    t, b = all_gather(layer.act_out_bytes / d, m, cluster, inner=cluster.devices_in_node(m))
    return repeat * t, repeat * b


def tp_chain_cost(graph: Graph, kinds: Mapping[int, str], d: int, m: int,
                  cluster: Cluster, loop: tuple[int, float, int] | None = None
                  ) -> tuple[float, float]:
    """(seconds, bytes) of the model-axis communication of a whole chain of layers whose
    parameters are tensor-parallel of the given kinds (absent: not split). `loop =
    (repeat, split, times)`: the layers that repeat `repeat` times (a pipeline stage's
    layer stack) see their activations split `split` ways instead of d, and run `times`
    times as often (once per micro-batch, each a collective of its own)."""
    t = b = 0.0
    prev = "none"

    def at(op: int) -> tuple[float, float, float]:
        """(data split, repeat, times) of the layer at op."""
        rep = float(graph.repeat[op])
        if loop is not None and rep == loop[0]:
            return loop[1], rep, float(loop[2])
        return float(d), rep, 1.0

    for group in graph.layer_groups:
        ks = [kinds.get(L.param, "none") for L in group]
        dd, rep, times = at(group[0].op_index)
        dt, db = tp_group_cost(group, prev, ks, dd, m, cluster, rep)
        t, b, prev = t + times * dt, b + times * db, group_kind(ks)
    if graph.layers:
        last = graph.layers[-1]
        dd, rep, times = at(last.op_index)
        dt, db = tp_final_cost(last, prev, dd, m, cluster, rep)
        t, b = t + times * dt, b + times * db
    return t, b


__all__ = ["all_gather", "all_reduce", "all_reduce_latency", "axis_inner",
           "batch_reduce_comm", "buffer_latency", "collective_cost", "fsdp_comm",
           "fsdp_moves", "grad_reduce_comm", "group_kind", "hsdp_comm", "moved_in", "ring_fit",
           "tp_chain_cost", "tp_final_cost", "tp_group_cost"]
