"""One process of a cluster calibration (started by test_calibrate_cluster.py through
`jaxwap.runtime.launch.launch_local`, not collected).

It runs the real command line, `jaxwap calibrate --quick --coordinator ...`, with a cache
directory of its own (as on a machine of its own: the process that does not write first
must then write its own copy), prints the record it cached as one JSON line, and
calibrates again to show that all processes reuse the cached record together.
usage: calibrate_worker.py CACHE_BASE
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from jaxwap.runtime.launch import cluster_from_env

coordinator, num_processes, process_id = cluster_from_env()
cache = Path(sys.argv[1]) / f"process{process_id}"
os.environ["JAXWAP_CACHE_DIR"] = str(cache)  # before jaxwap reads it

from jaxwap.calibration.calibrate import calibrate_full  # noqa: E402
from jaxwap.calibration.store import load_calibration  # noqa: E402
from jaxwap.cli.calibrate import main  # noqa: E402

status = main(["calibrate", "--quick", "--coordinator", coordinator, "--num-processes",
               str(num_processes), "--process-id", str(process_id), "--timeout", "30"])
assert status == 0, status

import jax  # noqa: E402

assert jax.process_count() == num_processes, "the cluster did not start"
record = load_calibration(jax.local_devices()[0], cache)
assert record is not None, f"process {process_id} cached nothing in {cache}"
print("RECORD " + json.dumps(record.to_dict()), flush=True)
again = calibrate_full(quick=True, progress=False, directory=cache)
print(f"REUSED {again.measurements == record.measurements}", flush=True)
