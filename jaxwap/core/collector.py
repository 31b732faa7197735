"""Python's cyclic garbage collector, paused while a plan is made.

Planning a deep model builds jaxprs of tens of thousands of equations, and their
analyses, several times over (the step as written, each variant tried): millions of
long-lived objects, and each full collection the allocations trigger walks all of them
again, to find almost nothing (the traces hold few reference cycles that outlive them):
on a deep unrolled model that is a fifth of the planning time, and pausing it leaves the
process's peak memory the same (docs/guide/scale.md). The collector's own state is
restored on the way out, whether the plan was made or failed, and the plan's garbage is
collected then by the collector's usual thresholds; reference counting frees everything
else throughout.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off within the block, as it was after it (a block inside
    another leaves it to the outer one; another thread's block may turn it back on
    early, which costs time, never correctness)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


__all__ = ["collector_paused"]
