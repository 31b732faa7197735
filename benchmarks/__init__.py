"""The benchmarks: scripts that answer how good jaxwap's predictions and plans are, each run
as `python -m benchmarks.<folder>.<name>` from the repository root and writing its record to
`benchmarks/results/<name>/`. The folders group them by question (`models` holds the shared
workloads; `accuracy`, `cluster`, `gpu`, `planning` and `pipelines` the scripts), and
`benchmarks/README.md` indexes every script with its hardware, time and output.
"""
