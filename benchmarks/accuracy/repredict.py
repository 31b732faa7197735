"""The measured rows of `measured.py`, predicted again by the model as it is now.

    .venv/bin/python -m benchmarks.accuracy.repredict          # results/measured/cpu.json
    .venv/bin/python -m benchmarks.accuracy.repredict --check  # the record's own model: same?

Measuring takes the machine for ten minutes and moves with its drift; a change to the
cost model can be judged first against the steps already measured. Each row is planned
again with the profile its set-up calibrated just before it (kept in the record), on the
devices the set-up had (one process of one device, or processes of one device each: the
cluster `cluster.detect_cluster` makes for them, from stand-in devices), and its
candidate is remade as `measured.py` made it (`layouts.mesh_candidate`). The analytic
prediction is remade; with ``--compiled`` the XLA-fed one too for the one-device rows of
the single set-up (compiled here, on this machine's one CPU device, as `measured.py`
compiled them: `verify.compile_candidate`, then `mesh_prediction.with_compiled`); the cluster's
need its processes.

`--check` asserts that the predictions are the record's to the last digit, which holds
when the model has not changed since the record was measured: it shows this script
remakes the candidates `measured.py` timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness


@dataclass(frozen=True)
class StandIn:
    """What `detect_cluster` reads of a device, for a set-up's devices that are not here."""

    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


def main(args: argparse.Namespace) -> int:
    record = json.loads(Path(args.json).read_text())
    most = max(s["devices"] for s in record["setups"].values())
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={most}"
    import jaxwap
    from benchmarks.models import zoo
    from benchmarks.models.layouts import mesh_candidate
    from jaxwap.cost.mesh_prediction import with_compiled
    from jaxwap.decide.verify import compile_candidate
    from jaxwap.hardware.calibration import CALIBRATION_FORMAT, Calibration
    from jaxwap.hardware.cluster import detect_cluster
    from jaxwap.planner import make_plan

    errors, moved = [], 0
    print(f"{'set-up':8s}{'model':16s}{'mesh':6s}{'layouts':24s}{'measured':>10s}"
          f"{'recorded':>10s}{'now':>10s}{'error':>8s}")
    for name, setup in record["setups"].items():
        per_process = setup["devices"] // setup["processes"]
        devices = [StandIn(i, i // per_process) for i in range(setup["devices"])]
        for model, cal in setup["calibrations"].items():
            if cal.get("format") in (4, 5) and CALIBRATION_FORMAT == 6:
                # formats 4 and 5 measured all that 6 does but the host's call of a step
                # (4) and the Python calls of its pytrees, which their profiles then lack
                # (no term): their rows are predicted as they were
                cal = dict(cal, format=CALIBRATION_FORMAT)
            try:
                calibration = Calibration.from_dict(cal)
            except ValueError as e:
                raise SystemExit(f"{args.json}: {name}/{model}: {e}; measure it again "
                                 f"(benchmarks/accuracy/measured.py)") from None
            cluster, _ = detect_cluster(devices, calibration)
            w = zoo.small(model)
            planned = make_plan(w.step, w.args, {}, params=w.params, options=jaxwap.PlanOptions(
                hardware=cluster, verify=0, cache=False))
            for row in record["rows"]:
                if row["setup"] != name or row["model"] != w.name:
                    continue
                d, m = map(int, row["mesh"].split("x"))
                cand = mesh_candidate(planned, d, m, row["variants"][0], cluster)
                now = cand.predicted.step_time_s
                errors.append(abs(now / row["measured_s"] - 1))
                moved += now != row["predicted_s"]
                fed = ""
                if args.compiled and name == "single" and (d, m) == (1, 1):
                    import jax

                    dev = jax.devices()[:1]
                    figs, _ = compile_candidate(w.step, planned.layout, cand, dev, cluster)
                    t = with_compiled(cand.predicted, figs, cluster, w.batch_size, 1, 1).step_time_s
                    fed = (f"   XLA-fed {row['compiled_predicted_s'] * 1e3:.2f} -> {t * 1e3:.2f}"
                           f" ({100 * (t / row['measured_s'] - 1):+.0f}%)")
                print(f"{name:8s}{model:16s}{row['mesh']:6s}{'/'.join(row['variants']):24s}"
                      f"{row['measured_s'] * 1e3:10.2f}{row['predicted_s'] * 1e3:10.2f}"
                      f"{now * 1e3:10.2f}{100 * (now / row['measured_s'] - 1):+7.0f}%{fed}")
    was = record["summary"]
    print(f"\n|predicted / measured - 1| now: median {100 * statistics.median(errors):.1f}%, "
          f"worst {100 * max(errors):.1f}%, {len(errors)} rows; recorded: "
          f"{100 * was['median_abs_error']:.1f}% / {100 * was['worst_abs_error']:.1f}%; "
          f"{moved} predictions moved")
    return 1 if args.check and moved else 0


if __name__ == "__main__":
    p = harness.parser(__doc__)
    p.add_argument("--json", default=str(harness.results_dir("measured") / "cpu.json"))
    p.add_argument("--check", action="store_true",
                   help="fail unless every prediction is the record's")
    p.add_argument("--compiled", action="store_true",
                   help="also remake the single set-up's XLA-fed predictions (compiles)")
    sys.exit(main(p.parse_args()))
