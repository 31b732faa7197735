"""`Plan.explain()`: the report a person reads about a plan.

The decision, the layout, the figures (predicted, compiled, measured, each labelled),
the power limit and what it saves, and every candidate with why it lost.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from jax.sharding import PartitionSpec as P

from jaxwap.core.records import (
    COMPILED,
    DATA,
    MEASURED,
    MODEL,
    PREDICTED,
    REPLICA,
    STAGE,
    mesh_dims,
    mesh_stages,
)
from jaxwap.core.units import id_ranges, named_mesh, si

if TYPE_CHECKING:
    from jaxwap.plans.plan import Plan


def _memory_summary(plan: Plan) -> str:
    """The memory repairs on the step line: optimizer state sharded over data (ZeRO-1) or
    kept in host memory, counted in parameters ('' where none)."""
    zero1 = sum(1 for p in plan.params if p.state_spec is not None)
    off = sum(1 for p in plan.params if p.offload)
    parts = []
    if zero1:
        parts.append(f"optimizer state of {zero1} params sharded over data (ZeRO-1)")
    if off:
        parts.append(f"optimizer state of {off} params in host memory")
    return ("   memory: " + "; ".join(parts)) if parts else ""


def _nodes_summary(plan: Plan) -> list[str]:
    """Which mesh axis spans nodes, on a cluster of several."""
    hw = plan.hardware
    if hw.num_nodes <= 1:
        return []
    d, m, r = mesh_dims(plan.mesh_shape)
    inner = hw.devices_in_node(d, m)
    nodes = -(-plan.num_devices // hw.node_size)
    p = mesh_stages(plan.mesh_shape)
    if p > 1:
        where = (f"the {STAGE} axis of {p} "
                 + ("spans nodes (its sends cross the network)" if plan.num_devices
                    > hw.node_size else "stays inside one node"))
    elif inner >= d:
        where = f"the whole mesh inside {'one node' if nodes == 1 else f'{nodes} nodes'}"
    elif r > 1:
        # a replica's data devices: one node's (HSDP as usual), or several nodes' where
        # the data axis is hybrid-sharded because it divides too few weights
        di, inner_d = d // r, hw.devices_in_node(d // r, m)
        span = "inside each node" if inner_d >= di else f"across {di // inner_d} nodes"
        where = (f"the {REPLICA} axis spans {r} {'nodes' if inner_d >= di else 'node groups'}"
                 f" (HSDP: parameters sharded over the {di} {DATA} devices {span}, "
                 f"gradient shards all-reduced across the replicas)")
    else:
        where = (f"the {DATA} axis spans {d // inner} nodes ({inner} of its devices per "
                 f"node; its reductions inside a node first when cheaper)")
    return [f"nodes: {nodes} of {hw.num_nodes} used; {where}; the {MODEL} axis of {m} "
            f"stays inside a node"]


def _inside_stage(plan: Plan) -> str:
    """What a pipeline's other blocking communication is: each layer's gathers
    (FSDP inside a stage) and the model axis's collectives (tensor parallelism)."""
    what = [w for w, on in (("gathering each layer's weights and reduce-scattering "
                             "their gradients", plan.step.stage_sharded), (
        f"the {MODEL} axis's collectives", plan.step.stage_tensor_parallel)) if on]
    rest = plan.predicted.tp_comm_time_s - plan.predicted.send_time_s
    return f"; {rest * 1e3:.3f} ms {' and '.join(what)}, every loop step" if what else ""


def explain(plan: Plan, max_params: int = 40) -> str:
    """A report a person reads: the decision, the layout, the figures, the losers."""
    lines = [*_header(plan), "", *_predicted(plan)]
    if plan.attention is not None:
        lines += ["", "advice (predicted):", *plan.attention.lines()]
    if plan.compiled is not None:
        lines += ["", *_compiled(plan)]
    if plan.measured is not None:
        lines += ["", *_measured(plan)]
    lines += ["", *_parameters(plan, max_params)]
    lines += ["", *_candidates(plan)]
    t = plan.planning_time_s
    lines += ["", "planning time: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in t.items())]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _header(plan: Plan) -> list[str]:
    """What was decided and for what: the mesh and objective, the hardware (and how a
    host's shared memory slows this mesh), the devices, batch and budget, the step variant
    and its memory repairs, and which axis spans nodes."""
    hw = plan.hardware
    dev = hw.device
    mesh = named_mesh(plan.mesh_shape.items())
    return [
        f"jaxwap plan: {plan.num_devices} of {hw.num_devices} devices, mesh {mesh}, "
        f"objective {plan.objective.describe()}",
        f"hardware: {hw.num_devices} x {hw.device.name} "
        f"({si(dev.peak_flops, 'flop/s')} bf16, {si(dev.memory_bandwidth, 'B/s')}, "
        f"{si(dev.memory_bytes, 'B')}), {hw.describe_links()}" + (
            f"; {hw.host_memory.devices} devices share a host's memory: streaming "
            f"{hw.host_memory.slowdown('stream', plan.num_devices):.2f}x, layout changes "
            f"{hw.host_memory.slowdown('layout', plan.num_devices):.2f}x, fresh memory "
            f"{hw.host_memory.slowdown('fresh', plan.num_devices):.2f}x as long on this mesh"
            if hw.host_memory else ""),
        f"devices: {id_ranges(plan.device_ids)}   batch: {plan.batch_size}   memory budget: "
        f"{si(plan.memory_budget_bytes, 'B')} per device",
        f"step: {plan.step.describe()}" + _memory_summary(plan),
        *_nodes_summary(plan),
    ]


def _predicted(plan: Plan) -> list[str]:
    """The model's figures for the plan, labelled predicted: time and its parts, energy,
    memory, the power limit, and a pipeline's bubble and sends."""
    pr = plan.predicted
    lines = [
        "predicted (model, not measured):",
        f"  step time       {pr.step_time_s * 1e3:10.3f} ms   "
        f"({pr.samples_per_s:,.0f} samples/s)",
        f"  compute         {pr.compute_time_s * 1e3:10.3f} ms   "
        f"utilization {pr.utilization:.0%}",
        f"  communication   {pr.exposed_comm_time_s * 1e3:10.3f} "
        f"ms exposed of "
        f"{pr.grad_comm_time_s * 1e3:.3f} ms gradient reduction; "
        f"{pr.tp_comm_time_s * 1e3:.3f} ms "
        f"{'blocking' if plan.step.pipelined else 'tensor-parallel'}; "
        f"{si(pr.comm_bytes, 'B')} sent per device",
        *([f"  host's call     {pr.call_time_s * 1e3:10.3f} ms   jax's dispatch of the "
           f"step's arrays in and out, on each device, and its pytrees"] if pr.call_time_s else []),
        f"  energy          {si(pr.energy_per_step_j, 'J', small=True):>10}/step   "
        f"{si(pr.energy_per_sample_j, 'J', small=True)}/sample   {si(pr.avg_power_w, 'W')} "
        f"average",
        f"  peak memory     {si(pr.peak_memory_bytes, 'B'):>10} per device"
        + (f"; {pr.host_transfer_time_s * 1e3:.3f} ms moving optimizer state to and "
           f"from host memory" if pr.host_transfer_time_s else ""),
        _power_line(plan),
    ]
    if plan.step.pipelined:
        share = pr.bubble_time_s / pr.step_time_s
        bubble = (f"{pr.bubble_time_s * 1e3:10.3f} ms bubble ({share:.0%} of the step, "
                  f"devices idle)" if plan.step.bubble_idles else
                  f"bubble {plan.step.bubble_share:.0%} of the loop, its layers run on no "
                  f"micro-batch and dropped (busy; one stage share less memory than idling)")
        lines.append(
            f"  pipeline        {bubble}; "
            f"{pr.send_time_s * 1e3:.3f} ms of stage sends and the stack's entry/exit "
            f"over the {STAGE} axis" + _inside_stage(plan))
    return lines


def _compiled(plan: Plan) -> list[str]:
    """XLA's own analysis of the compiled plan beside the model's figures (their error),
    and the figures the model was fed for the choice."""
    c, v, pr = plan.compiled, plan.verified, plan.predicted
    assert c is not None
    kinds = Counter(f"{x.kind} over {'+'.join(x.axes) or 'no axis'}" for x in c.collectives)
    lines = [
        "compiled (XLA's own analysis of this plan, per device):",
        f"  memory          {si(c.memory_bytes, 'B'):>10}   "
        f"(model {_err(pr.peak_memory_bytes, c.memory_bytes)})   "
        f"argument {si(c.argument_bytes, 'B')}, output {si(c.output_bytes, 'B')}, "
        f"temp {si(c.temp_bytes, 'B')}, aliased {si(c.alias_bytes, 'B')}"
        + (f"; less {si(c.host_unverified_bytes, 'B')} of optimizer state planned "
           f"for host memory, which this backend's analysis cannot show (modelled)"
           if c.host_unverified_bytes else ""),
        f"  flops           {si(c.flops, 'flop'):>10}   "
        f"(model {_err(pr.flops_as_xla_counts, c.flops)})",
        f"  communication   {si(c.comm_bytes, 'B'):>10}   "
        f"(model {_err(pr.comm_bytes, c.comm_bytes)})   "
        f"{', '.join(f'{n} {k}' for k, n in sorted(kinds.items())) or 'no collectives'}",
    ]
    if v is not None:
        lines.append(f"  model fed these figures: step {v.step_time_s * 1e3:.3f} ms, "
                     f"{si(v.energy_per_step_j, 'J')}/step (what the choice was made on)")
    return lines


def _measured(plan: Plan) -> list[str]:
    """What ran on the devices, beside the model's figures."""
    ms, pr = plan.measured, plan.predicted
    assert ms is not None
    return [f"measured on the devices ({ms.steps} steps; energy "
            f"{ms.energy_source}{': ' + ms.note if ms.note else ''}):",
            f"  step time       {ms.step_time_s * 1e3:10.3f} ms   "
            f"(model {pr.step_time_s * 1e3:.3f} ms)",
            f"  energy          {si(ms.energy_per_step_j, 'J'):>10}/step "
            f"(model {si(pr.energy_per_step_j, 'J')}/step)"]


def _parameters(plan: Plan, max_params: int) -> list[str]:
    """The layout: the largest `max_params` parameters, in the model's order, with their
    specs (and their optimizer state's where sharded apart)."""
    lines = ["parameters:"]
    width = max((len(p.keystr) for p in plan.params), default=10)
    width = min(max(width, 10), 60)
    sw = max([14] + [len(p.strategy) for p in plan.params])
    lines.append(f"  {'path':<{width}}  {'shape':<20} {'size':>10}  {'strategy':<{sw}} spec")
    shown = sorted(plan.params, key=lambda p: -p.nbytes)[:max_params]
    order = {id(p): i for i, p in enumerate(plan.params)}
    for p in sorted(shown, key=lambda p: order[id(p)]):
        lines.append(f"  {p.keystr[:width]:<{width}}  {str(p.shape):<20} "
                     f"{si(p.nbytes, 'B'):>10}  {p.strategy:<{sw}} {P(*p.spec)}"
                     + (f"  state {P(*p.state_spec)}" if p.state_spec is not None else ""))
    if len(plan.params) > max_params:
        lines.append(f"  ... {len(plan.params) - max_params} smaller parameters not shown")
    return lines


_BASIS = {MEASURED: "measured", COMPILED: "XLA", PREDICTED: "model"}


def _candidates(plan: Plan) -> list[str]:
    """Every candidate, the chosen one first, then grouped by the basis each was judged on
    (measured, then XLA's figures, then the model's alone), by score within a group: a
    row judged on a cheaper basis can look better than the chosen one without being so,
    and sits below it under its own heading. Meshes with their axes named."""
    batch = plan.batch_size or 1
    labels = {id(c): c.label for c in plan.candidates}
    width = max([12, *map(len, labels.values())])
    out = ["candidates (every mesh considered):",
           "  (dp = plain data parallelism, the baseline; @W = at that power limit)",
           f"  {'mesh':<{width}} {'step ms':>10} {'samples/s':>11} {'energy':>9} "
           f"{'power':>8} {'mem/dev':>9}  verdict"]
    chosen = [c for c in plan.candidates if c.chosen]
    rest = [c for c in plan.candidates if not c.chosen]
    groups = [("chosen", chosen)] + [
        (f"judged on {_BASIS[b]} figures" if b != PREDICTED else
         "judged on the model alone (analytic)", sorted(
             (c for c in rest if c.judged.basis == b), key=lambda c: c.score))
        for b in (MEASURED, COMPILED, PREDICTED)]
    for title, cands in groups:
        if not cands:
            continue
        out.append(f"  -- {title}")
        for c in cands:
            j = c.judged
            energy = si(j.energy_per_step_j, "J", small=True)
            out.append(f"  {labels[id(c)]:<{width}} {j.step_time_s * 1e3:10.3f} "
                       f"{batch / j.step_time_s:11,.0f} {energy:>9} "
                       f"{si(j.avg_power_w, 'W'):>8} {si(j.peak_memory_bytes, 'B'):>9}  "
                       + (f"CHOSEN ({_BASIS[j.basis]} figures)" if c.chosen else c.reason))
    return out


def _power_line(plan: Plan) -> str:
    """The power limit chosen and what it saves against the same layout at the board's
    default, or why the default stands."""
    profile = plan.hardware.device.power_profile()
    default = profile.default_w
    w = plan.power_limit_w
    if w is None:
        why = ("the objective is throughput, which never caps" if plan.objective.kind ==
               "throughput" else "no accepted limit lowers the objective's score" if
               profile.limits() else "this device accepts no power limit")
        return ("  power limit     board default"
                + (f" ({default:.0f} W)" if default else "") + f": {why}")
    chosen = next(c for c in plan.candidates if c.chosen)
    base = plan.candidates[chosen.of].judged if chosen.of is not None else None
    now = chosen.judged
    saving = (f": {1 - now.energy_per_step_j / base.energy_per_step_j:.1%} less energy per "
              f"step for {now.step_time_s / base.step_time_s - 1:.1%} more step time than "
              f"the board default ({default:.0f} W)" if base is not None and default else "")
    return (f"  power limit     {w:10.0f} W per device, recommended (`power_limit=\"apply\"` "
            f"sets it){saving}; {profile.source}")


def _err(predicted: float, actual: float) -> str:
    """The model's figure and its error relative to XLA's."""
    if actual == 0:
        return f"{predicted:.3g}"
    return f"{si(predicted, '')}, {100 * (predicted - actual) / actual:+.0f}%"


__all__ = ["explain"]
