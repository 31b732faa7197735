"""graph.analyze on deep models: figures consistent per block, costs priced once per
distinct equation, live rows without the whole matrix, and stacked (scanned) parameters.

The models are `benchmarks/models/zoo.py`'s tiny Llama (d 64, 4/2 heads, ffn 128, vocab 256,
batch 8 x 32 tokens), unrolled or with its blocks stacked and run by `lax.scan`.
"""

from __future__ import annotations

from functools import cache

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.models import zoo
from jaxwap.analysis.flatten import flatten
from jaxwap.analysis.graph import Graph, analyze
from jaxwap.analysis.liveness import dense_live_rows, live_rows
from jaxwap.analysis.primitives import FREE, MATMUL, prim_info
from jaxwap.analysis.roofline_adapter import roofline_rules
from jaxwap.analysis.trace import layout_of

CFG = zoo.LLAMA_CONFIGS["llama_tiny"]
B, T, D, V = 8, CFG["seq_len"], CFG["d_model"], CFG["vocab"]


@cache
def _traced(layers: int, scan: bool = False):
    w = zoo.llama("llama_tiny", layers=layers, scan=scan, dtype=jnp.float32, batch_size=B)
    layout, closed = layout_of(w.step, w.args, {}, w.params, None)
    return w, layout, closed


@cache
def _graph(layers: int, scan: bool = False) -> Graph:
    _, layout, closed = _traced(layers, scan)
    return analyze(closed, layout.inputs.roles, layout.outputs.roles, layout.params,
                   layout.inputs.batch_size)


def _block_matmul_params() -> int:
    """Weights of one block's linear layers (norm scales are not matmul weights)."""
    hd = D // CFG["heads"]
    return 2 * D * D + 2 * D * CFG["kv_heads"] * hd + 3 * D * CFG["ffn"]


def _matmul_flops(layers: int) -> float:
    """A training step's matmul flops from first principles: 2 per weight per token
    forward, 4 backward (input and weight gradients), for every linear layer (the LM head
    included; the embedding is a gather); attention's two [T, T] products per block,
    2 * B * T^2 * d flops each forward and twice that backward."""
    return (6.0 * B * T * (layers * _block_matmul_params() + D * V)
            + layers * 12.0 * B * T * T * D)


@pytest.mark.parametrize("layers", [2, 8])
def test_matmul_flops_from_first_principles(layers):
    g = _graph(layers)
    assert float(g.flops[g.is_matmul].sum()) == _matmul_flops(layers)


def test_figures_scale_by_block():
    """Every per-op figure the search reads grows by the same amount per added block."""
    g2, g8 = _graph(2), _graph(8)
    assert (len(g8.flops) - len(g2.flops)) % 6 == 0
    per_block_ops = (len(g8.flops) - len(g2.flops)) // 6
    assert per_block_ops > 0
    for name in ("flops", "bytes", "kernels"):
        a, b = getattr(g2, name), getattr(g8, name)
        per_block = (b.sum() - a.sum()) / 6
        assert per_block > 0
        # a block's share is the same whichever block: the 2-layer model's second block
        # (its ops between the first block's and the head's) is one block's worth
        assert a.sum() - 2 * per_block == pytest.approx(b.sum() - 8 * per_block, rel=1e-12)
    assert len(g8.layers) - len(g2.layers) == 6 * 7  # q, k, v, o, gate, up, down
    assert len(g8.params) - len(g2.params) == 6 * 9  # and the two norm scales
    assert g8.total_flops / g2.total_flops == pytest.approx(
        _matmul_flops(8) / _matmul_flops(2), rel=0.05)


def test_cached_costs_equal_each_equation_priced():
    """Pricing each distinct equation once gives every op the figures jax's roofline
    rule gives that op's own equation."""
    _, _, closed = _traced(2)
    g, prog, rules = _graph(2), flatten(closed), roofline_rules()
    assert len(prog.ops) == len(g.flops)
    for k, op in enumerate(prog.ops):
        if prim_info(op.prim).kind == FREE:
            assert g.flops[k] == g.bytes[k] == g.kernels[k] == 0.0
            continue
        cost = rules.cost(op.eqn)
        if cost is None:
            assert op.prim in g.unmodeled
            continue
        assert g.flops[k] == cost[0] * op.repeat
        if prim_info(op.prim).kind == MATMUL:
            assert g.bytes[k] == cost[1] * op.repeat


def _live_cases(seed, count, min_points, min_values):
    """`count` random `live_rows` arguments (points, begin, end, cols, nbytes, width):
    up to 60 points, 40 values and 6 buckets, byte counts from 0 to 2**40."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        points, n, width = int(rng.integers(min_points, 60)), int(
            rng.integers(min_values, 40)), int(rng.integers(1, 7))
        begin = rng.integers(0, points, n)
        end = np.minimum(begin + rng.integers(1, points + 1, n), points)
        cols = rng.integers(0, width, n)
        nbytes = rng.choice([0.0, 1.0, 4.0, 12.0, 4096.0, 2.0**40], n)
        yield points, begin, end, cols, nbytes, width


def test_live_rows_equal_the_whole_matrix():
    """The live rows summed only where the first pruning pass keeps them are bit for bit
    those of pruning the whole matrix, and so are their changes from row to row."""
    for case in _live_cases(0, 2000, min_points=1, min_values=0):
        fast, changes = live_rows(*case)
        whole = dense_live_rows(*case)
        width = case[-1]
        assert fast.shape == whole.shape and fast.tobytes() == whole.tobytes()
        if changes is not None:    # the rows' changes, made sparse, are theirs exactly
            diff = np.diff(whole, axis=0, prepend=np.zeros((1, width)))
            assert changes.shape == diff.shape
            assert changes.toarray().tobytes() == diff.tobytes()
            assert changes.nnz == np.count_nonzero(diff)


def test_live_rows_read_one_at_a_time_equal_the_whole_matrix(monkeypatch):
    """A row read alone (`LiveRows`: summed from the nearest row summed before it), in
    any order, past the rows it keeps, and sliced as a repair slices it, is bit for bit
    that row of the whole matrix; reading rows never builds the whole matrix."""
    from jaxwap.analysis import live_matrix

    monkeypatch.setattr(live_matrix, "KEPT_ROWS", 4)   # rows dropped as they are read
    rng = np.random.default_rng(2)   # the order rows are read in
    checked = 0
    for case in _live_cases(1, 300, min_points=3, min_values=1):
        _, changes = live_rows(*case)
        if changes is None:
            continue
        whole = dense_live_rows(*case)
        fresh = live_matrix.LiveRows(changes)
        for k in rng.permutation(len(whole)):
            assert fresh[k].tobytes() == whole[k].tobytes()
            assert fresh[int(k), 1:].tobytes() == whole[k, 1:].tobytes()
        assert fresh[-1].tobytes() == whole[-1].tobytes()
        assert fresh._dense is None and len(fresh._rows) <= 4
        assert len(fresh) == len(whole) and fresh.shape == whole.shape
        checked += 1
    assert checked > 100


def test_live_columns_per_block():
    """Each parameter's live bytes (every class's column, at its peak) are the same in
    every block, and the same in the 2- and 8-layer models."""
    peaks = {}
    for layers in (2, 8):
        g = _graph(layers)
        P = len(g.params)
        cols = g.live[:, 2:2 + 4 * P].max(axis=0).reshape(4, P)  # [class, param]
        for j, p in enumerate(g.params):
            role = tuple(x for x in p.path if not x.isdigit())
            peaks.setdefault(role, set()).add(tuple(cols[:, j]))
    assert len(peaks) == 9 + 3  # a block's 9 parameters, the embedding, norm and head
    assert all(len(v) == 1 for v in peaks.values()), peaks


def test_stacked_dim_of_scanned_layers():
    g = _graph(2, scan=True)
    assert g.stacked_dim.shape == (len(g.params),)
    for p, dim in zip(g.params, g.stacked_dim, strict=True):
        stacked = p.path[0] == "blocks"
        assert dim == (0 if stacked else -1), p.path
        if stacked:
            assert p.shape[0] == 2
    unrolled = _graph(2)
    assert (unrolled.stacked_dim == -1).all()


def test_stacked_dim_defaults_to_none_stacked():
    g = _graph(2)
    import dataclasses
    fields = {f.name: getattr(g, f.name) for f in dataclasses.fields(g)}
    fields.pop("stacked_dim")
    assert (Graph(**fields).stacked_dim == -1).all()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_stack_run_again_for_its_backward_pass_is_priced_with_that_forward_pass(
        checkpointed):
    """A scanned stack under a checkpoint that keeps only its input (a pipeline stage's
    `remat="stage"`) runs its layers forward once more for the backward pass: its matmuls
    are one forward pass (L layers x 2 B D^2) more than the stack's without it. With each
    layer checkpointed too, the run again keeps only what each layer carries, so the
    layers computing the next carry were dropped as dead code (the inlined loop's last
    carry is unused), and the extra forward pass was not priced at all."""
    import jax

    L, B, D = 4, 8, 16

    def body(h, w):
        return jnp.tanh(h @ w), None

    def loss(w, x, stage):
        layer = jax.checkpoint(body) if checkpointed else body

        def stack(w, x):
            return jax.lax.scan(layer, x, w)[0]
        if stage:
            stack = jax.checkpoint(stack, policy=jax.checkpoint_policies.nothing_saveable)
        return stack(w, x).sum()

    def matmul_flops(stage):
        closed = jax.make_jaxpr(jax.grad(lambda w, x: loss(w, x, stage)))(
            jnp.ones((L, D, D)), jnp.ones((B, D)))
        prog = flatten(closed)
        return sum(2 * B * D * D * op.repeat for op in prog.ops
                   if op.eqn.primitive.name == "dot_general")
    forward = L * 2 * B * D * D
    assert matmul_flops(True) - matmul_flops(False) == forward
