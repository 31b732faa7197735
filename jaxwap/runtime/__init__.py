"""What runs: a layout compiled into a `jax.jit` step (`compile`), the gradient pins it
carries, the pipeline schedule and the layer scan it runs, `make_train_step`, the call of a
compiled step on the user's pytrees, starting `jax.distributed` safely (`distributed`) and
launching a local cluster of processes (`launch`). Knows nothing of cost
or search, so calibration probes and benchmarks compile exactly what `auto_shard` runs.
Imports `core`, `hardware` and `analysis`.
"""
