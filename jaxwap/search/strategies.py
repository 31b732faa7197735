"""A parameter's candidate layouts on a (data, model) mesh: replicated, tensor parallel
(column or row over the model axis), ZeRO-1, FSDP, and the optimizer state in host memory,
restricted to the families a caller allows. The search picks among them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from jaxwap.analysis.graph import Graph
from jaxwap.core.records import Strategy
from jaxwap.search.constraints import LayoutRules, path_string


def _largest_dim(shape: Sequence[int], dims: Sequence[int], k: int,
                 exclude: int | None = None) -> int | None:
    ok = [i for i in dims if i != exclude and shape[i] % k == 0 and shape[i] >= k]
    return max(ok, key=lambda i: (shape[i], -i)) if ok else None


def _spec(ndim: int, **axes: int | None) -> tuple[str | None, ...]:
    spec: list[str | None] = [None] * ndim
    for name, dim in axes.items():
        if dim is not None:
            spec[dim] = name
    return tuple(spec)


def param_strategies(graph: Graph, j: int, d: int, m: int, offload: bool = True,
                     rules: LayoutRules | None = None) -> tuple[Strategy, ...]:
    """Replicate; column / row over model; each also with its optimizer state sharded over
    data (ZeRO-1) or everything sharded over data (FSDP); and, for a parameter with
    optimizer state, each of those with the state kept in host memory. `rules` keeps
    only the layouts whose families it allows (see `restrict`) and, for a parameter it
    pins, those its constraint allows (`LayoutRules.apply`: empty where the pin cannot
    hold on this mesh); for one it keeps whole over data (`whole_over_data`), those that
    do not shard the weight over data, where any is left."""
    layer = graph.layer_of.get(j)
    dims = None if layer is None else (tuple(layer.out_dims), tuple(layer.in_dims))
    granules = (graph.tp_granule.get((j, "col"), 0), graph.tp_granule.get((j, "row"), 0))
    leaks = j in graph.tp_leaks
    if j in graph.bias_of and m > 1:
        # a bias is offered its kernel's column split (and only that), which it takes
        # with the kernel (`tp_chain.biases_follow`)
        kernel = graph.bias_of[j].param
        dims, leaks = _bias_col_dims(graph, j, m), kernel in graph.tp_leaks
        granules = (graph.tp_granule.get((kernel, "col"), 0), 0)
    # a pinned parameter chooses among every layout, not only the families allowed
    pin = None if rules is None else rules.pin(j)
    shape, has_state = tuple(graph.params[j].shape), bool(graph.resident_bytes[j] > 0)
    families = None if rules is None or pin is not None else rules.families
    stacked = int(graph.stacked_dim[j])
    out = _strategies_for(shape, dims, has_state, d, m, offload, families, stacked, granules,
                          leaks)
    if dims is not None and j in graph.bias_of and all(s.tp == "col" for s in out):
        # beside a kernel that is not column-parallel the bias needs a layout that is not
        # (replicated where no family allowed gives one): tensor parallelism alone allowed
        # would otherwise leave it only the split
        out = _strategies_for(shape, None, has_state, d, m, offload, families, stacked) + out
    out = out if pin is None else rules.apply(j, out, graph.params[j].shape, layer, m)
    if rules is not None and j in rules.whole_over_data:
        # a pin to FSDP wins over the search's own preference for the weight whole
        out = tuple(s for s in out if not s.data_sharded) or out
    return out


def _bias_col_dims(graph: Graph, j: int, m: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The bias j's dim its kernel's column split would split, as `_strategies_for` takes
    a layer's dims (col, row), or None where it has none: a bias is the kernel's output
    feature dims, trailing (a stacked one's stacked dim ahead of them)."""
    L = graph.bias_of[j]
    kernel, bias = graph.params[L.param].shape, graph.params[j].shape
    stacked = int(graph.stacked_dim[L.param])
    tdim = _largest_dim(kernel, [i for i in L.out_dims if i != stacked], m)
    lead = len(bias) - len(L.out_dims)
    if tdim is None or lead < 0 or tuple(bias[lead:]) != tuple(kernel[i] for i in L.out_dims):
        return None
    return (lead + L.out_dims.index(tdim),), ()


def pins_hold(graph: Graph, rules: LayoutRules | None, d: int, m: int, offload: bool = True
              ) -> str | None:
    """Why `rules`' pins cannot all hold on a (d, m) mesh, or None (also without rules)."""
    if rules is None or not rules.pins:
        return None
    return rules.why_not(graph.params, d, m, graph.layer_of, lambda j: param_strategies(
        graph, j, d, m, offload, LayoutRules()))


@functools.lru_cache(maxsize=4096)
def _strategies_for(shape: tuple[int, ...], layer_dims: tuple[tuple[int, ...], ...] | None,
                    has_state: bool, d: int, m: int, offload: bool,
                    allowed: frozenset[str] | None, stacked: int = -1,
                    granules: tuple[int, int] = (0, 0), leaks: bool = False
                    ) -> tuple[Strategy, ...]:
    """`param_strategies` for a parameter of this shape (the blocks of a deep model share
    a few shapes, so each is worked out once). The dim a scan iterates over (`stacked`)
    is never split: each iteration slices one layer out of it, and a split stack would be
    gathered whole. A tensor-parallel kind whose activations' split dims (`granules`,
    col then row: heads, kv heads, hidden) the model axis does not divide is not offered:
    it would split inside a head (4 kv heads on a model axis of 8 compiled to all-to-alls
    and collective-permutes the chain does not price). Nor is a column split XLA would
    not keep (`leaks`: `Graph.tp_leaks`): one that reaches the residual stream reaches
    every later layer, and XLA keeps the stream split by feature from there (GPT-2's
    first attention projection column-parallel, paired across a residual add and a
    LayerNorm: 7.5 GB of collectives on 8 devices where the chain prices 0.6), and one
    that a fused q/k/v split cuts into parts XLA reshuffles."""
    nd = len(shape)
    all_dims = [i for i in range(nd) if i != stacked]
    bases: list[tuple[str, str, int | None]] = [("replicate", "none", None)]
    if m > 1 and layer_dims is not None:
        for kind, dims, g in (("col", layer_dims[0], granules[0]),
                              ("row", layer_dims[1], granules[1])):
            if (g and g % m) or (kind == "col" and leaks):
                continue
            tdim = _largest_dim(shape, [i for i in dims if i != stacked], m)
            if tdim is not None:
                bases.append((f"tp-{kind}", kind, tdim))
    out = []
    for name, tp, tdim in bases:
        spec = _spec(nd, model=tdim)
        out.append(Strategy(name, spec, tp=tp))
        f = _largest_dim(shape, all_dims, d, exclude=tdim) if d > 1 else None
        if f is None:
            continue
        sharded = _spec(nd, model=tdim, data=f)
        prefix = "" if tp == "none" else name + "+"
        if has_state:
            out.append(Strategy(prefix + "zero1", spec, tp=tp, state_spec=sharded))
        out.append(Strategy(prefix + "fsdp", sharded, tp=tp, data_sharded=True))
    if has_state and offload:
        out += [dataclasses.replace(s, name=s.name + "+offload", offload=True) for s in out]
    return restrict(out, allowed)


def shard_replicas(graph: Graph, d: int, m: int, rules: LayoutRules | None = None) -> int:
    """The replicas r that let the data axis of d shard the parameters best: 1 where d
    itself shards all but 5% of their bytes; else the r whose data sub-axis of d/r
    devices, replicated r times (HSDP), leaves the least weights, gradients and
    optimizer state on a device, taking fewer replicas unless more save 5% more.

    FSDP and ZeRO-1 split a dim the data axis divides, and a data axis takes the batch's
    factors, not the model's: 240 (1,920 GPUs at TP 8) divides no dim of a 16,384-wide
    model, whose weights then shard over the model axis alone, while 16 of the 240, each
    replicated 15 times, divide them all. Kept with the graph (`Graph.memo`): a search
    asks it on every mesh of every micro-batch count."""
    if d <= 1:
        return 1
    return graph.memoized(("shard_replicas", d, m, rules),
                          lambda: _shard_replicas(graph, d, m, rules))


def _shard_replicas(graph: Graph, d: int, m: int, rules: LayoutRules | None) -> int:
    sizes = [float(p.nbytes) for p in graph.params]

    def layouts(g: int) -> list[tuple[Strategy, ...]]:
        return [param_strategies(graph, j, g, m, False, rules) for j in range(len(sizes))]

    def held(g: int, options: list[tuple[Strategy, ...]]) -> float:
        # the least bytes a device holds with the parameters sharded over g
        return sum(min(2 * w / s.shard(g, m) + float(state) / s.state_shard(g, m)
                       for s in ss)
                   for w, state, ss in zip(sizes, graph.resident_bytes, options, strict=True))

    at_d = layouts(d)
    whole = sum(b for b, ss in zip(sizes, at_d, strict=True)
                if not any(s.data_sharded for s in ss))
    if whole <= 0.05 * sum(sizes):   # d shards (nearly) every byte: nothing to gain
        return 1
    best, least = 1, held(d, at_d)
    for g in sorted((g for g in range(2, d) if d % g == 0), reverse=True):
        if (h := held(g, layouts(g))) < 0.95 * least:
            best, least = d // g, h
    return best


def unsplit_reasons(graph: Graph, m: int, rules: LayoutRules | None = None,
                    limit: int = 6) -> str:
    """Why no layer weight can be split over a model axis of m, for an error to show:
    the strategies allowed exclude tensor parallelism, or per weight (its path and shape)
    a pin, no dim the layer rule splits that m divides, a head count m does not divide, or
    a column split XLA would not keep."""
    head = ""
    if rules is not None and rules.families is not None and "tp" not in rules.families:
        head = (f"the strategies allowed ({', '.join(sorted(rules.families))}) exclude "
                f"tensor parallelism ('tp'); layer weights: ")
    out = []
    for j, L in sorted(graph.layer_of.items()):
        if j in graph.bias_of:
            continue
        p, stacked = graph.params[j], int(graph.stacked_dim[j])
        where = f"{path_string(p.path)} {tuple(p.shape)}"
        if head:
            out.append(where)
            continue
        if rules is not None and rules.pin(j) is not None:
            out.append(f"{where}: pinned to {rules.pin(j).describe()}")
            continue
        why = []
        for kind, dims in (("column", L.out_dims), ("row", L.in_dims)):
            kept = [i for i in dims if i != stacked]
            g = graph.tp_granule.get((j, "col" if kind == "column" else "row"), 0)
            if _largest_dim(p.shape, kept, m) is None:
                why.append(f"{kind} dims {[p.shape[i] for i in kept]} not divisible by {m}")
            elif g and g % m:
                why.append(f"{kind} split cuts {g} heads {m} ways")
            elif kind == "column" and j in graph.tp_leaks:
                why.append("column split not kept by XLA")
        out.append(f"{where}: {', '.join(why)}")
    more = f", {len(out) - limit} more" if len(out) > limit else ""
    return head + (", ".join(out[:limit]) + more if out else "the step has no layer weights")


def restrict(options: Sequence[Strategy], allowed: frozenset[str] | None
             ) -> tuple[Strategy, ...]:
    """The layouts every family of which is allowed; replicated when none is (a parameter
    no axis divides cannot take the split asked for). `options[0]` is the replicated one."""
    if allowed is None:
        return tuple(options)
    return tuple(s for s in options if s.families <= allowed) or (options[0],)


__all__ = ["param_strategies", "pins_hold", "restrict", "shard_replicas", "unsplit_reasons"]
