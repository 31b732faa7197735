"""The [points, buckets] matrix of live bytes (`Graph.live`), held as its changes from
each kept point to the next.

A deep model's matrix is hundreds of MB (a point per op kept, a column per parameter
class), and building it (a dense array and its running sum) was a third of analysing the
step. But a search reads only a few of its rows (each peak point a memory repair
visits) and otherwise asks products of it (`Graph.live_at`: the running sum of the
sparse changes times the weights). So `LiveRows` keeps the changes and sums a row when
asked for it, from the nearest row summed before it; the whole matrix is built only for
a reader that asks for more than rows (a test's column slice, `np.asarray`).

The changes are integer byte counts, so every row summed here equals the dense running
sum's bit for bit (exact in float64 below 2**53 bytes, as `liveness.live_rows` says).
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
import scipy.sparse

#: rows kept once summed (a repair returns to its peak points); past this many, the
#: lower half of them by row is dropped (each row is as wide as the matrix)
KEPT_ROWS = 256


class LiveRows:
    """`Graph.live`, lazily: `changes` ([points, buckets], sparse) are its differences
    from row to row (row 0: itself). Indexed by a row (`live[k]`, `live[k, a:b]`) it sums
    that row alone; any other use builds the dense matrix once (`dense`)."""

    ndim = 2

    def __init__(self, changes: scipy.sparse.csc_array) -> None:
        self.changes = changes
        self.shape: tuple[int, int] = (int(changes.shape[0]), int(changes.shape[1]))
        self._dense: np.ndarray | None = None
        self._csr: scipy.sparse.csr_array | None = None
        self._rows: dict[int, np.ndarray] = {}
        self._order: list[int] = []          # the rows kept, ascending

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float64)

    @property
    def nbytes(self) -> int:
        """What it holds: the changes, the rows summed, the dense matrix once built."""
        c = self.changes
        held = int(c.data.nbytes + c.indices.nbytes + c.indptr.nbytes)
        held += sum(int(r.nbytes) for r in self._rows.values())
        return held + (0 if self._dense is None else int(self._dense.nbytes))

    def dense(self) -> np.ndarray:
        """The whole matrix, built once: the running sum of the changes."""
        if self._dense is None:
            d = self.changes.toarray() if self.shape[0] else np.zeros(self.shape)
            self._dense = np.cumsum(d, axis=0, out=d)
            self._rows.clear()
            self._order.clear()
        return self._dense

    def row(self, k: int) -> np.ndarray:
        """Row k (read-only): the nearest row summed before it plus the changes between."""
        k = int(k)
        if k < 0:
            k += self.shape[0]
        if not 0 <= k < self.shape[0]:
            raise IndexError(f"row {k} of a live matrix of {self.shape[0]} rows")
        if self._dense is not None:
            return self._dense[k]
        got = self._rows.get(k)
        if got is not None:
            return got
        if self._csr is None:
            self._csr = self.changes.tocsr()
        at = bisect.bisect_left(self._order, k)
        if at:
            below = self._order[at - 1]
            got = self._rows[below] + self._csr[below + 1:k + 1].sum(axis=0)
        else:
            got = np.asarray(self._csr[:k + 1].sum(axis=0), dtype=np.float64)
        got = np.asarray(got, dtype=np.float64).reshape(-1)
        got.flags.writeable = False
        if len(self._order) >= KEPT_ROWS:
            for j in self._order[:KEPT_ROWS // 2]:
                del self._rows[j]
            del self._order[:KEPT_ROWS // 2]
        self._rows[k] = got
        bisect.insort(self._order, k)
        return got

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int | np.integer):
            return self.row(key)
        if isinstance(key, tuple) and key and isinstance(key[0], int | np.integer):
            return self.row(key[0])[key[1:]]
        return self.dense()[key]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        d = self.dense()
        return d if dtype is None else d.astype(dtype)

    def __getattr__(self, name: str) -> Any:
        # any other ndarray method (`sum`, `max`, `copy`): the dense matrix's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.dense(), name)


__all__ = ["KEPT_ROWS", "LiveRows"]
