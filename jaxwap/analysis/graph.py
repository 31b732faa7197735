"""From a step's jaxpr to the facts the cost model needs.

`analyze` runs a few passes over the step's flat program (`analysis/flatten.py`: calls inlined, a
`scan` inlined once with its ops repeated, dead code dropped):

- *dataflow*: which values carry the batch dimension, and which belong to one parameter
  (the parameter itself, a cast or transpose of it, its gradient, its optimizer moments,
  its update), with the map from a value's dims to its parameter's. Ownership flows
  forward from the parameter inputs through shape-preserving ops and backward from the
  parameter outputs (new params, new moments), which catches the gradient of a weight
  (`dW = x^T dy`) without a name for it. One iteration's slice of a stacked parameter (a
  scan over layers) is that parameter, its dims the parameter's past the stacked one, and
  so is the stack of the slices' gradients;
- *costs*: every op's flops and memory traffic (from jax's per-primitive roofline rules
  where they exist, `roofline_adapter.py`), with elementwise chains fused as XLA fuses them;
- *splits*: an op is *batched* (it splits over the data axis) or *owned* (it splits however
  its parameter is sharded); matmuls and convolutions that use a weight against batched
  data are the *layers* tensor parallelism can split, their weight dims contracted ("row")
  or not ("column") given by the primitive table's layer rules (`analysis/op_splits.py`);
- *model splits*: which batched values a layer's tensor-parallel layout also splits over
  the model axis (Megatron's activations between a column- and a row-parallel layer);
- *memory*: the live bytes at every point, split into buckets (`analysis/liveness.py`) so that a
  candidate's peak memory is one matrix-vector product.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse

from jaxwap.analysis.dataflow import dataflow, op_kinds, stacked_dims
from jaxwap.analysis.flatten import flatten
from jaxwap.analysis.fsdp_gathers import fsdp_gathers
from jaxwap.analysis.grad_reductions import (
    batch_split,
    conv_grad_relayouts,
    conv_relayouts,
    data_reductions,
    dot_relayouts,
    grad_repeat,
    partial_sums,
    reduced_copies,
    relayouts,
)
from jaxwap.analysis.live_matrix import LiveRows
from jaxwap.analysis.liveness import (
    GRAD,
    NUM_CLASSES,
    OPT,
    REDUCED,
    RESIDENT,
    WEIGHT,
    WHOLE,
    gathered_whole,
    step_memory,
)
from jaxwap.analysis.op_splits import Layer, op_splits
from jaxwap.analysis.op_work import (
    conv_kind,
    conv_out_width,
    conv_width,
    op_costs,
    transposed_matmul,
    unbatched_bytes,
)
from jaxwap.analysis.roles import LeafRole, ParamInfo
from jaxwap.analysis.roofline_adapter import roofline_rules
from jaxwap.analysis.tp_activations import column_leaks, model_splits, op_model_splits

__all__ = ["GRAD", "NUM_CLASSES", "OPT", "REDUCED", "RESIDENT", "WEIGHT", "WHOLE", "Graph",
           "analyze"]


@dataclass(frozen=True)
class Graph:
    """The step as the cost model sees it (struct of arrays over ops, for speed)."""

    params: tuple[ParamInfo, ...]
    batch_size: int | None
    flops: np.ndarray          # [ops] flops of the whole (unsharded) step
    bytes: np.ndarray          # [ops] memory traffic after fusion
    kernels: np.ndarray        # [ops] kernel launches
    is_matmul: np.ndarray      # [ops] bool
    low_precision: np.ndarray  # [ops] bool: 16-bit operands (tensor-core peak)
    batched: np.ndarray        # [ops] bool
    owner: np.ndarray          # [ops] int param index or -1
    tp_param: np.ndarray       # [ops] int: the weight whose TP sharding splits this matmul
    layers: tuple[Layer, ...]
    # [points, 2 + 4P + E] live bytes: batched, other, then per class (WEIGHT, GRAD, OPT,
    # RESIDENT) a column per param, then batched bytes a tensor-parallel layout splits
    # (`tp_live_param`, `tp_live_kind`); as the memory pass gives it, its changes from row
    # to row, a row summed when read (`LiveRows`)
    live: np.ndarray | LiveRows
    unmodeled: tuple[str, ...]
    op_class: np.ndarray       # [ops] class of the value an op produces (WEIGHT .. RESIDENT)
    repeat: np.ndarray         # [ops] iterations of the enclosing (inlined) scans
    resident_bytes: np.ndarray  # [P] bytes of each param's optimizer state (its mirrors)
    host_transfer: np.ndarray  # [ops] bool: a copy between device and host memory
    # [P] how many whole gradients of each parameter data parallelism all-reduces per
    # step: one per batched use (partial sums are reduced before they are added), in
    # every iteration of a scan over micro-batches (`grad_reductions.batch_dims`)
    grad_repeat: np.ndarray
    # [ops] 0: not a convolution, 1: a convolution, 2: one whose window is larger than its
    # input in some spatial dim (backends may compute those on a slow generic path)
    conv: np.ndarray
    # bytes of the other partial sums over the batch, all-reduced over the data axis per
    # step (loss, metrics, batch-norm statistics and their gradients), and how many
    reduce_bytes: float = 0.0
    reduce_count: float = 0.0     # each a buffer of its own all-reduce
    # [P] the dim of each parameter a scan iterates over (its layers stacked along it, one
    # slice per iteration: a mesh axis that split it would split the loop), -1 if none;
    # left out, every parameter gets -1
    stacked_dim: np.ndarray | None = field(default=None)
    # [E] the extra live columns after the per-class ones (`live[:, 2 + 4P + e]`): batched
    # bytes split over the model axis too when parameter `tp_live_param[e]` is
    # tensor-parallel of kind `tp_live_kind[e]` ("col" or "row"), over the data axis
    # alone otherwise (`tp_activations.model_splits`); left out, there are none
    tp_live_param: np.ndarray | None = field(default=None)
    tp_live_kind: tuple[str, ...] = ()
    # [ops] for a batched op that is no layer's matmul, the parameter whose
    # tensor-parallel layout splits what it computes over the model axis too (the
    # attention between q/k/v and o, the gated product between gate/up and down), when
    # that layout is of kind `TP_KINDS[tp_op_kind]`; -1 if none. Left out, none
    tp_op_param: np.ndarray | None = field(default=None)
    tp_op_kind: np.ndarray | None = field(default=None)
    # [P] bytes and reads per step of each parameter's gradient where a matmul makes it
    # transposed, which the backend relayouts for each read once it is all-reduced
    # (`grad_reductions.relayouts`); left out, none
    relayout_bytes: np.ndarray | None = field(default=None)
    relayout_reads: np.ndarray | None = field(default=None)
    # [P] bytes and moves per step of each convolution kernel as the backend's layout
    # assignment moves it (`grad_reductions.conv_relayouts`); left out, none
    conv_relayout_bytes: np.ndarray | None = field(default=None)
    conv_relayout_moves: np.ndarray | None = field(default=None)
    # (parameter, kind) -> the gcd of the activation dims that layout splits (heads, kv
    # heads, hidden): a model axis must divide it (`strategies`); absent, no constraint
    tp_granule: Mapping[tuple[int, str], int] = field(default_factory=dict)
    # parameters whose column split XLA would not keep as Megatron does: one that reaches
    # more than one other layer's matmul (the residual stream, not a row partner), kept
    # for the rest of the network; one a split or slice cuts into parts (a fused q/k/v
    # weight), reshuffled. `strategies` does not offer it; absent, none
    tp_leaks: frozenset[int] = frozenset()
    # [ops] of `bytes`, what a batched op moves whole whatever the batch split (weights
    # read, weight gradients written: `op_work.unbatched_bytes`); left out, none
    fixed_bytes: np.ndarray | None = field(default=None)
    # [ops] the input feature count of each convolution (`op_work.conv_width`), 0 for other
    # ops: what a backend's generic-loop rate depends on; left out, all 0
    conv_width: np.ndarray | None = field(default=None)
    conv_out_width: np.ndarray | None = field(default=None)   # [ops] `op_work.conv_out_width`
    # [ops] the transcendental elements each op evaluates (`op_work.TRANSCENDENTAL`: exp,
    # tanh, ...), priced by `DeviceSpec.transcendental_s`; left out, none
    transcendentals: np.ndarray | None = field(default=None)
    # [ops] the bytes each reduction (`op_work.REDUCTIONS`) reads, whatever fusion made
    # them, 0 for other ops: priced by `DeviceSpec.reduction_cost` where it has one;
    # left out, none
    reduced: np.ndarray | None = field(default=None)
    # arrays a call passes and gets back (argument and result leaves), what the host
    # handles per device each call (`DeviceSpec.call_cost`), and the Python calls a call
    # makes on their pytrees (`host_calls.tree_calls`, counted by the planner); left out, 0
    buffers: int = 0
    tree_calls: int = 0
    # [ops] the batched operands a kernel-gradient convolution reads, which a backend
    # copies into another layout first (`grad_reductions.conv_grad_relayouts`,
    # `DeviceSpec.relayouts_conv_grads`); left out, none
    conv_grad_bytes: np.ndarray | None = field(default=None)
    # [ops] matmuls that contract both operands over a dim that is not their last
    # (`op_work.transposed_matmul`); left out, none
    transposed: np.ndarray | None = field(default=None)
    # [ops] the window taps each pooling op visits (`op_work.window_taps`), the elements of
    # each pooling gradient's result (`DeviceSpec.window_tap_s`, `window_grad_s`) and the
    # bytes expanding it adds (`op_work.expanded_pool_grad`); left out, none
    window_taps: np.ndarray | None = field(default=None)
    window_grad_elems: np.ndarray | None = field(default=None)
    window_grad_bytes: np.ndarray | None = field(default=None)
    # [ops] bytes the backend copies into another layout around each batched matmul
    # (`grad_reductions.dot_relayouts`, `DeviceSpec.relayouts_batched_dots`); left out, none
    dot_relayout_bytes: np.ndarray | None = field(default=None)
    # [P] the gathers per pass XLA makes of each parameter and the values computed from
    # it when the data axis splits it (`fsdp_gathers.Gathers.per_pass`); left out, one each
    fsdp_gathers: np.ndarray | None = field(default=None)
    # [ops] 1: cuDNN's fused attention forward, 2: its backward, 0: another op
    # (`op_work.OpCosts.attention`, priced at `DeviceSpec.attention_*_efficiency`); left
    # out, none
    attention: np.ndarray | None = field(default=None)

    def __post_init__(self) -> None:
        if self.stacked_dim is None:
            object.__setattr__(self, "stacked_dim", np.full(len(self.params), -1, np.int64))
        if self.tp_live_param is None:
            object.__setattr__(self, "tp_live_param", np.zeros(0, np.int64))
        # per-op arrays left out: none of what they count
        for name, dtype in (("fixed_bytes", float), ("conv_width", np.int64),
                            ("conv_out_width", np.int64), ("transcendentals", float),
                            ("reduced", float), ("conv_grad_bytes", float),
                            ("window_taps", float), ("window_grad_elems", float),
                            ("window_grad_bytes", float),
                            ("transposed", bool), ("dot_relayout_bytes", float),
                            ("attention", np.int8)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros(len(self.flops), dtype))
        if self.tp_op_param is None:
            object.__setattr__(self, "tp_op_param", np.full(len(self.flops), -1, np.int64))
            object.__setattr__(self, "tp_op_kind", np.full(len(self.flops), -1, np.int64))
        for name, fill in (("relayout_bytes", 0.0), ("relayout_reads", 0.0),
                           ("conv_relayout_bytes", 0.0), ("conv_relayout_moves", 0.0),
                           ("fsdp_gathers", 1.0)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.full(len(self.params), fill))
        width = 2 + NUM_CLASSES * len(self.params) + len(self.tp_live_param)
        if len(self.tp_live_kind) != len(self.tp_live_param) or self.live.shape[1] != width:
            raise ValueError(f"Graph.live has {self.live.shape[1]} columns and "
                             f"{len(self.tp_live_param)} tp_live_param, "
                             f"{len(self.tp_live_kind)} tp_live_kind: expected {width} "
                             f"columns (2 + {NUM_CLASSES} x {len(self.params)} params + one "
                             f"per extra column) and as many kinds as parameters")

    @property
    def total_flops(self) -> float:
        return float(self.flops.sum())

    @functools.cached_property
    def live_changes(self) -> scipy.sparse.csc_array:
        """`live`'s changes from each row to the next (row 0: itself), sparse. Kept rows
        differ in a few buckets each (an activation made, a gradient produced), so a 70B
        model's 4739 x 4016 matrix changes in 16,622 cells: every per-point product is
        then a sparse product and a running sum (`live_at`), not a dense one."""
        live = self.live
        if isinstance(live, LiveRows):   # as the memory pass gave them
            return live.changes
        changes = np.empty_like(live)      # (np.diff with prepend= copies it thrice)
        if len(live):
            changes[0] = live[0]
            np.subtract(live[1:], live[:-1], out=changes[1:])
        return scipy.sparse.csc_array(changes)

    @functools.cached_property
    def _param_changes(self) -> dict[int, scipy.sparse.csc_array]:
        return {}

    @functools.cached_property
    def memo(self) -> dict[Any, Any]:
        """Results of pure functions of this graph, kept with it by their callers under
        keys naming the function and its other arguments: a search asks the same of one
        graph on every mesh and micro-batch count (`strategies.shard_replicas`)."""
        return {}

    def memoized(self, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
        """`build()`, kept in `memo` under `key` (its first item names the function, the
        rest its other arguments); built afresh each time where the key cannot be hashed
        (layout rules holding a dict)."""
        try:
            hash(key)
        except TypeError:
            return build()
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]

    def param_changes(self, j: int) -> scipy.sparse.csc_array:
        """`live_changes`' columns of parameter j's classes ([points, NUM_CLASSES]),
        sliced once per graph: a memory repair moves one parameter at a time, on every
        mesh the search tries."""
        if j not in self._param_changes:
            cols = 2 + np.arange(NUM_CLASSES) * len(self.params) + j
            self._param_changes[j] = self.live_changes[:, cols]
        return self._param_changes[j]

    def live_at(self, weights: np.ndarray) -> np.ndarray:
        """`live @ weights`, the bytes per device at every kept point, from the changes."""
        return np.cumsum(self.live_changes @ weights)

    @functools.cached_property
    def layer_of(self) -> dict[int, Layer]:
        """Each parameter's layer (its forward matmul against the batch), by index."""
        return {L.param: L for L in self.layers}

    @functools.cached_property
    def bias_of(self) -> dict[int, Layer]:
        """Each bias's layer (`Layer.bias`), by the bias's parameter index."""
        return {L.bias: L for L in self.layers if L.bias >= 0}

    @functools.cached_property
    def layer_groups(self) -> tuple[tuple[Layer, ...], ...]:
        """The layers in forward order, consecutive siblings (the same `input_id`)
        together: the unit the tensor-parallel chain is priced in (`collectives.tp_group_cost`)."""
        groups: list[list[Layer]] = []
        for L in self.layers:
            if groups and L.input_id >= 0 and groups[-1][-1].input_id == L.input_id:
                groups[-1].append(L)
            else:
                groups.append([L])
        return tuple(tuple(g) for g in groups)


def analyze(closed_jaxpr: Any, in_roles: Sequence[LeafRole], out_roles: Sequence[LeafRole],
            params: Sequence[ParamInfo], batch_size: int | None) -> Graph:
    """Flatten the step's jaxpr and derive per-op costs, splits, layers and liveness."""
    rules = roofline_rules()  # fails loudly, before any cost, on a jax it does not fit
    prog = flatten(closed_jaxpr)
    kinds, host_transfer = op_kinds(prog)
    flow = dataflow(prog, kinds, in_roles, out_roles, params, batch_size)
    costs = op_costs(prog, kinds, rules)
    splits = op_splits(prog, kinds, flow, params)
    stacked = stacked_dims(prog, flow, params)
    model_split = model_splits(prog, kinds, flow.owner, flow.perm, flow.batched,
                               splits.layers, params, stacked)
    split = batch_split(prog, in_roles)
    sums = partial_sums(prog, out_roles, split)   # each partial sum over the batch
    mem = step_memory(prog, kinds, flow, in_roles, out_roles, len(params), model_split,
                  gathered_whole(prog.ops, prog.nbytes, splits.layers, splits.tp_param,
                                 flow.owner, stacked),
                  reduced_copies(prog, sums))
    repeats, reduce_bytes, reduce_count = data_reductions(prog, sums, params)
    # where no partial sum was found, the old rule: once per step, or per scan iteration
    fallback = grad_repeat(prog.ops, splits.owner, mem.op_class, params, stacked)
    repeats = np.where(repeats > 0, repeats, fallback)
    tp_op_param, tp_op_kind = op_model_splits(prog, model_split, splits.batched,
                                              splits.tp_param)
    conv_bytes, conv_moves = conv_relayouts(prog, flow.owner, flow.batched, len(params))
    relayout_bytes, relayout_reads = relayouts(prog, kinds, flow.owner, flow.batched,
                                               len(params))
    return Graph(
        params=tuple(params), batch_size=batch_size, flops=costs.flops, bytes=costs.bytes,
        kernels=costs.kernels, is_matmul=costs.is_matmul, low_precision=costs.low_precision,
        batched=splits.batched, owner=splits.owner, tp_param=splits.tp_param,
        layers=splits.layers, live=mem.live, unmodeled=costs.unmodeled,
        op_class=mem.op_class, repeat=np.array([float(op.repeat) for op in prog.ops]),
        resident_bytes=mem.resident_bytes, host_transfer=host_transfer,
        grad_repeat=repeats, reduce_bytes=reduce_bytes, reduce_count=reduce_count,
        conv=np.array([conv_kind(op.eqn) for op in prog.ops], dtype=np.int8),
        conv_width=np.array([conv_width(op.eqn) for op in prog.ops], dtype=np.int64),
        conv_out_width=np.array([conv_out_width(op.eqn) for op in prog.ops], dtype=np.int64),
        transcendentals=costs.transcendentals, reduced=costs.reduced,
        window_taps=costs.window_taps, window_grad_elems=costs.window_grad_elems,
        window_grad_bytes=costs.window_grad_bytes, attention=costs.attention,
        conv_grad_bytes=conv_grad_relayouts(prog, flow.batched),
        dot_relayout_bytes=dot_relayouts(prog, flow.batched),
        transposed=np.array([transposed_matmul(op.eqn) for op in prog.ops], dtype=bool),
        stacked_dim=stacked, tp_live_param=mem.tp_live_param, tp_live_kind=mem.tp_live_kind,
        tp_op_param=tp_op_param, tp_op_kind=tp_op_kind, relayout_bytes=relayout_bytes,
        relayout_reads=relayout_reads,
        fsdp_gathers=fsdp_gathers(prog, kinds, split[0], in_roles, out_roles,
                                  len(params)).per_pass,
        conv_relayout_bytes=conv_bytes, conv_relayout_moves=conv_moves,
        buffers=len(in_roles) + len(out_roles),
        fixed_bytes=unbatched_bytes(prog, kinds, costs.bytes, flow.batched),
        tp_granule={pair: g for pair, g in zip(model_split.pairs, model_split.granule,
                                               strict=True) if g > 0},
        tp_leaks=column_leaks(prog, kinds, flow.owner, flow.perm, splits.layers, params,
                              stacked) | {model_split.pairs[e][0] for e in model_split.cut
                                          if model_split.pairs[e][1] == "col"})
