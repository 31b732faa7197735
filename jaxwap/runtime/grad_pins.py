"""What a compiled step pins inside it: a ZeRO-1 parameter's gradient made by a reduction
keeps the layout of its weight (and so does that of an FSDP parameter the step gathers
first, `compile.gathered_first`: a norm's scale, whose split XLA would otherwise carry from
the split moments into the statistics through the gradient).

ZeRO-1 keeps a weight whole on every device of the data axis and splits its optimizer
state over that axis: each device updates its share of the weight and the new weight is
all-gathered. XLA's partitioner is told only the layouts of the step's inputs and outputs.
It propagates the optimizer state's split backward, through the update into the gradient
and through the gradient into the ops that made it. A batch norm's scale and offset
gradients are per-channel sums over the batch of the very values its forward pass takes
its mean and variance from, so XLA split those statistics by channel too, and gathered
them back where the activations read them. ResNet-50-small (29 parameters) under ZeRO-1 on
2 devices compiled to 92 all-gathers, 63 of them inside the forward and backward passes,
where ZeRO-1 needs 29 (one per updated weight). On the two-process gloo cluster of
`benchmarks/accuracy/measured.py` that step measured 472 ms against 219 ms for data parallelism;
the model, pricing ZeRO-1, said 322.

So each such gradient is pinned to its weight's own layout (`with_sharding_constraint`)
where the reduction makes it, which stops the propagation there: the gradient is reduced
whole and each device slices its share, as the cost model prices it
(`collectives.grad_reduce_comm`; the same step compiles to 29 all-gathers). On GPU, XLA's
collective optimizations turn such an all-reduce and slice into a reduce-scatter
(`ReduceScatterCreator` in the "collective-optimizations" pipeline of
xla/service/gpu/gpu_compiler.cc; read in XLA's source, not verified here: no GPU).

Left alone: a weight gradient a matmul or convolution makes. There a split over the data
axis is XLA's own cost-based choice: each device computes its share of the gradient from
activations it moves, fewer flops and, where the batch is small, fewer bytes than the
whole gradient's reduction (AlexNet-small's 2 x 2 planner layout with every ZeRO-1
gradient pinned: 371 Mflop and 5.3 MB of collectives a device; with its weight gradients
left alone: 355 Mflop and 3.9 MB). And an FSDP weight's gradient, which XLA already
reduces to the weight's data-split layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxwap.analysis.dataflow import dataflow, op_kinds
from jaxwap.analysis.flatten import bind, evaluate, flatten
from jaxwap.analysis.primitives import FREE, MATMUL

Pins = dict[int, dict[int, P]]   # {top-level equation: {result index: its layout}}


def gradient_pins(closed: Any, layout: Any, weights: Mapping[int, P]) -> Pins:
    """Where a reduction in the step makes the gradient of a parameter in `weights`
    ({parameter: weight spec without the data axis}: the ZeRO-1 ones, and the FSDP ones
    gathered first), and the spec to pin it to.

    A gradient is a value that is a form of the parameter (`dataflow`'s ownership, which
    runs back from the new weight and optimizer state through elementwise ops), computed
    from the batch but without its batch dim (summed over it), shaped as the weight. The
    one pinned is the first such value on its path, so the optimizer's own values after
    it (the moments ZeRO-1 splits) are left alone, and only where an op other than a
    matmul or convolution makes it (see the module's docstring). Only values made at the
    top level of the traced step are pinned: a gradient made inside a nested call (a
    jitted function the user wrote, a micro-batch loop) is left to XLA as before.
    """
    if not weights:
        return {}
    prog = flatten(closed)
    kinds, _ = op_kinds(prog)
    flow = dataflow(prog, kinds, layout.inputs.roles, layout.outputs.roles, layout.params,
                    layout.inputs.batch_size)
    shapes = {p: tuple(layout.params[p].shape) for p in weights}

    def gradient(v: int) -> bool:
        p = int(flow.owner[v])
        return (p in weights and bool(flow.dep[v]) and not flow.batched[v]
                and prog.vars[v].shape == shapes[p])

    top = {id(e): k for k, e in enumerate(closed.jaxpr.eqns)}
    contracted: set[int] = set()   # made by a matmul or convolution, or a layout op of one
    pins: Pins = {}
    for op, kind in zip(prog.ops, kinds, strict=True):
        if kind == MATMUL or (kind == FREE and any(i in contracted for i in op.ins)):
            contracted.update(op.outs)
            continue
        k = top.get(id(op.eqn))
        if k is None or any(gradient(i) for i in op.ins):
            continue
        for j, v in enumerate(op.outs):
            if gradient(v):
                pins.setdefault(k, {})[j] = P(*weights[int(flow.owner[v])])
    return pins


def pinned(closed: Any, pins: Pins, mesh: Mesh) -> Callable[..., tuple[Any, ...]]:
    """The traced step as a function again, each pinned value constrained to its layout
    on `mesh` where its equation makes it."""
    place = {k: {j: NamedSharding(mesh, spec) for j, spec in outs.items()}
             for k, outs in pins.items()}

    def run(k: int, eqn: Any, ins: list[Any]) -> list[Any]:
        outs = bind(eqn, ins)
        for j, sharding in place.get(k, {}).items():
            outs[j] = jax.lax.with_sharding_constraint(outs[j], sharding)
        return outs

    def step(*leaves: Any) -> tuple[Any, ...]:
        return tuple(evaluate(closed.jaxpr, closed.consts, leaves, run))

    return step

