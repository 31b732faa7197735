"""The planner's decisions against the committed snapshot
(`benchmarks/results/plan_snapshot/snapshot.json`, written by
`python -m benchmarks.planning.plan_snapshot --out`): every memory-pressure row (the four
full-size zoo models under shrinking memory budgets, `verify=0`), a Latin square of the
analytic rows (each model and each of the four clusters under each of the four objectives
once), and two verified rows (XLA:CPU compiles the finalists), planned afresh
(`cache=False`) through the public `jaxwap.plan` and compared
decision by decision: the mesh, every parameter's spec, optimizer-state spec and host
offload, and the step variant. The other analytic rows and the other nine verified rows
(which compile 8-device programs for seconds each) stay with the benchmark's `--check`.

A change that moves a decision on purpose regenerates the snapshot and says in its note
why each move is right; a refactor must leave every row equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import jaxwap
from benchmarks.planning import plan_snapshot

SNAPSHOT = (Path(__file__).resolve().parent.parent / "benchmarks" / "results"
            / "plan_snapshot" / "snapshot.json")
VERIFIED = ("verified/alexnet-small/h100x8/budget=3x-params", "verified/gpt2-small/h100x2")

_CASES = {row: (w, kw) for row, w, kw in plan_snapshot.cases()}
_RECORD = json.loads(SNAPSHOT.read_text())


def _latin_square(rows: list[str]) -> list[str]:
    """Of the analytic rows (model x cluster x objective), a Latin square: each model and
    each cluster under every objective once, each (model, cluster) pair under one, a
    quarter of the rows for the suite's time. Every row still runs in the benchmark's
    `--check`."""
    parts = [row.split("/")[1:] for row in rows]
    order = [list(dict.fromkeys(p[i] for p in parts)) for i in range(3)]
    n = len(order[2])
    return [row for row, (m, c, o) in zip(rows, parts, strict=True)
            if (order[0].index(m) + order[1].index(c)) % n == order[2].index(o)]


ROWS = ([row for row in _RECORD if row.startswith("memory/") or row in VERIFIED]
        + _latin_square([row for row in _RECORD if row.startswith("analytic/")]))


def _decided(row: str) -> dict[str, Any]:
    """What the planner decides for a snapshot row now, in the snapshot's own terms."""
    w, kw = _CASES[row]
    try:
        plan = jaxwap.plan(w.step, *w.args, params=w.params, cache=False, **kw)
    except MemoryError as e:
        return {"error": f"MemoryError: {str(e)[:160]}"}
    return plan_snapshot.decision(plan)


def test_the_snapshot_covers_every_case_and_a_spread_of_outcomes() -> None:
    """The record is whole (no case without a row), and its rows are not all one answer:
    several meshes, a micro-batched step and a memory error are among them."""
    assert set(_RECORD) == set(_CASES)
    meshes = {json.dumps(r["mesh"], sort_keys=True) for r in _RECORD.values() if "mesh" in r}
    assert len(meshes) >= 4
    assert any(r.get("step", {}).get("micro_batches", 1) > 1 for r in _RECORD.values())
    assert any("error" in r for r in _RECORD.values())


@pytest.mark.parametrize("row", ROWS)
def test_decision_matches_the_snapshot(row: str) -> None:
    want = {k: v for k, v in _RECORD[row].items() if k in ("mesh", "params", "step", "error")}
    assert _decided(row) == want
