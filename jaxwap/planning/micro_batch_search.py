"""The fewest micro-batches that fit, for the step variants' search (`step_variants`): the
counts in runs that keep the same meshes, each run bisected, the counts under their
floor and past a run whose need turned up not traced."""

from __future__ import annotations

from jaxwap.analysis.graph import Graph
from jaxwap.core.records import StepVariant
from jaxwap.core.units import si
from jaxwap.planning.variant_trials import FoundVariant, Trials


def fewest_micro_batches(trials: Trials, micro: list[StepVariant],
                         base: Graph | None = None, floor: bool = True
                         ) -> FoundVariant | None:
    """The fewest micro-batches that fit: a few traces instead of one per count.

    More micro-batches hold fewer activations at once on a given mesh, but each
    micro-batch's rows must split evenly over the data axis, so a count whose micro-batch
    has fewer rows than a wide data axis loses that mesh, and with it the sharding of the
    weights and optimizer state over those devices: past that count a step can need more
    per device, not less (a 1T model with full remat on 3,072 GPUs: 86.8 GB at 4
    micro-batches, 88.8 at 8, 92.7 at 16). So the counts are taken in runs that keep the
    same meshes (`_same_meshes`), where whether a count fits is monotone, and each run is
    bisected; the next run is tried only when none of the last fits, and none once a run
    needs more than the run before it (from there each count has fewer devices to shard
    the weights over, and a device holds the same activations, a row of each
    micro-batch). Counts under their floor are not traced (`_above_floor`, estimated
    from `base`: the step as written (None), or for remat rungs, whose activations the
    step as written does not bound, the step with that remat and no micro-batches;
    `floor=False` where that step was not traced)."""
    before = None      # the least need of the last run traced
    for lo, hi in _same_meshes(trials, micro, base):
        if floor:
            lo = _above_floor(trials, micro, base, lo, hi)
        found = _bisected(trials, micro, lo, hi)
        if found is not None:
            return found
        need = min((trials.needs[r] for r in micro[lo:hi + 1] if r in trials.needs),
                   default=None)
        if need is not None and before is not None and need >= before[1]:
            # past the counts that keep the widest data axis, each count halves the
            # devices sharding the weights while a device's activations stay the same:
            # a run needing more than the one before is the need turning up for good
            for r in micro[hi + 1:]:
                trials.tried.append(
                    f"{r.describe()}: not traced, {micro[hi].micro_batches} micro-batches "
                    f"already needed more than {before[0]} (fewer devices to shard the "
                    f"weights over, the same activations on each)")
            return None
        before = before if need is None else (micro[hi].micro_batches, need)
    return None


def _bisected(trials: Trials, micro: list[StepVariant], lo: int, hi: int
              ) -> FoundVariant | None:
    """The fewest micro-batches among `micro[lo:hi + 1]` that fit, where whether a count
    fits is monotone: the smallest count first (the likeliest plan where the floor
    let it through), then bisection."""
    found = None
    mid = lo
    while found is None and lo <= hi:
        got = trials.attempt(micro[mid])
        if got is None:
            lo = mid + 1
        else:
            found, hi = got, mid - 1
            while lo <= hi:   # a smaller count may fit too
                mid = (lo + hi) // 2
                smaller = trials.attempt(micro[mid])
                if smaller is None:
                    lo = mid + 1
                else:
                    found, hi = smaller, mid - 1
        mid = (lo + hi) // 2
    return found


def _same_meshes(trials: Trials, micro: list[StepVariant], base: Graph | None = None
                 ) -> list[tuple[int, int]]:
    """`micro`'s counts as runs (first and last index) over which the meshes a plan may
    use stay the same (`Trials.meshes`: each micro-batch split evenly over the data
    axis); one run where no graph is at hand to say."""
    graph = base if base is not None else trials.plain_graph
    if not micro:
        return []
    if graph is None:
        return [(0, len(micro) - 1)]
    sets = [frozenset(trials.meshes(graph, r.micro_batches)) for r in micro]
    runs, first = [], 0
    for i in range(1, len(micro) + 1):
        if i == len(micro) or sets[i] != sets[first]:
            runs.append((first, i - 1))
            first = i
    return runs


def _above_floor(trials: Trials, micro: list[StepVariant], base: Graph | None, lo: int,
                 hi: int) -> int:
    """The index of the first count in `micro[lo:hi + 1]` worth tracing (`hi + 1`: none
    is): counts whose activations alone, estimated from `base` (None: the step as
    written) at 1/k of its rows, leave no layout within the budget are skipped, each said
    in `trials.tried` (5% margin for the estimate, a lower bound: `micro_batch_floor`).
    The last count is skipped too where its floor is over: tracing a large model again
    costs seconds and could only confirm the miss."""
    base = base if base is not None else trials.plain_graph
    if not micro or base is None:
        return lo
    while lo <= hi and (need := trials.floor(base, micro[lo].micro_batches)) \
            > 1.05 * trials.ctx.budget:
        trials.tried.append(f"{micro[lo].describe()}: needs at least {si(need, 'B')} per "
                            f"device (estimated)")
        lo += 1
    return lo


__all__ = ["fewest_micro_batches"]
