"""Which meshes a search tries: the device counts worth a mesh, and the (data, model)
shapes of each that the batch, the layers and the cluster's nodes allow."""

from __future__ import annotations

from jaxwap.analysis.graph import Graph

# Clusters up to this many devices try every device count; larger ones powers of two
# (and the whole cluster), which is where the meshes that can win are (see device_counts).
EXHAUSTIVE_DEVICES = 64


def device_counts(num_devices: int, node_size: int | None = None) -> list[int]:
    """The device counts worth a mesh: every count up to `EXHAUSTIVE_DEVICES`; beyond,
    powers of two and the whole cluster (a count between two powers of two splits a
    power-of-two batch and model unevenly, and costs more than either neighbour in energy
    or time). With nodes (`node_size` devices each), a mesh larger than a node takes whole
    nodes: part of a node left idle is neither faster nor cheaper than the node's own
    counts."""
    n_max = num_devices
    if n_max <= EXHAUSTIVE_DEVICES:
        counts = set(range(1, n_max + 1))
    else:
        counts = {1 << k for k in range(n_max.bit_length()) if 1 << k <= n_max} | {n_max}
    if node_size is not None and node_size < n_max:
        counts = {n for n in counts if n <= node_size or n % node_size == 0}
        counts |= {node_size * (1 << k) for k in range(n_max.bit_length())
                   if node_size * (1 << k) <= n_max}
    return sorted(counts)


def mesh_shapes(num_devices: int, batch_size: int | None, graph: Graph,
                num_devices_exact: int | None = None, micro_batches: int = 1,
                mesh: tuple[int, int] | None = None, node_size: int | None = None
                ) -> tuple[list[tuple[int, int]], list[str]]:
    """Every (data, model) factorisation of n <= num_devices devices worth trying (with
    micro-batches, each micro-batch must split evenly over the data axis); only `mesh`
    when the caller fixes it. With nodes of `node_size` devices, the model axis stays
    inside a node (its size divides the node's), so tensor parallelism never crosses the
    network; the data axis spans the nodes. Nodes of one device have no inside: there
    the model axis may span nodes, priced on the network's links (`collectives.tp_group_cost`),
    or such a cluster could never split a layer."""
    shapes, skipped = [], []
    ns = [num_devices_exact] if num_devices_exact else device_counts(num_devices, node_size)
    if mesh is not None:
        ns = [mesh[0] * mesh[1]]
    for n in ns:
        for d in range(1, n + 1):
            if n % d or (mesh is not None and d != mesh[0]):
                continue
            m = n // d
            if node_size is not None and node_size > 1 and (m > node_size or node_size % m):
                skipped.append(f"{d}x{m}: the model axis of {m} would cross nodes of "
                               f"{node_size} devices")
                continue
            if batch_size is None and d > 1:
                skipped.append(f"{d}x{m}: the step has no batch dimension to split")
                continue
            if batch_size is not None and batch_size % (d * micro_batches):
                what = f"batch {batch_size}" if micro_batches == 1 else \
                    f"micro-batch {batch_size // micro_batches}"
                skipped.append(f"{d}x{m}: {what} is not divisible by data={d}")
                continue
            if m > 1 and not any(
                    any(graph.params[L.param].shape[i] % m == 0 for i in L.in_dims + L.out_dims)
                    for L in graph.layers):
                skipped.append(f"{d}x{m}: no layer weight has a dim divisible by model={m}")
                continue
            shapes.append((d, m))
    return shapes, skipped


__all__ = ["EXHAUSTIVE_DEVICES", "device_counts", "mesh_shapes"]
