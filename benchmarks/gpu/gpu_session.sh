#!/usr/bin/env bash
# A lent GPU's session, in one call: what the GPU figures in benchmarks/results come from.
#
#   OUT=/tmp/gpu bash benchmarks/gpu/gpu_session.sh   # on the GPU machine, repo root
#
# 1. env.txt: the card as found (nvidia-smi; power, clocks: read, never set) and the
#    packages of the python that runs jaxwap there (PY, default python3, run from the
#    source tree through PYTHONPATH: nothing is installed).
# 2. A smoke test that fails fast (a minute, not the lease): `auto_shard` plans, compiles
#    and runs an MLP's Adam step on the GPU and matches `jax.jit` of the same step.
# 3. benchmarks/gpu/gpu_sweep.py: calibration without touching the power limit, then
#    AlexNet, VGG-16 and GPT-2 small on one device, measured against predicted.
# 4. benchmarks/gpu/conv_probe.py: convolutions by shape against the calibrated matmul curve.
# 5. benchmarks/gpu/memory_rules.py: a decoder layer's memory, predicted against compiled.
# Everything lands under $OUT: env.txt (with the smoke test's output), gpu_sweep.log, the
# sweep's records in gpu_sweep/, conv_probe's in conv_probe/ (as under benchmarks/results/),
# memory_rules' in memory_rules/, and the sweep's work folder as gpu_sweep_work.tgz.
# Kept in benchmarks/results/gpu_sweep/ as <device>.{json,md,png}, <device>_env.txt,
# <device>_sweep.log, <device>_work.tgz.
set -u
OUT=${OUT:-/tmp/gpu_session}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi
  nvidia-smi -q -d POWER,CLOCK,PERFORMANCE,TEMPERATURE
  $PY -c "import sys, jax, jaxlib, flax, optax, numpy, pynvml, matplotlib; \
print(sys.version); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, \
'flax', flax.__version__, 'optax', optax.__version__, 'numpy', numpy.__version__); \
print(jax.devices())"
} >"$OUT/env.txt" 2>&1
tail -3 "$OUT/env.txt"

timeout "${SMOKE_TIMEOUT:-120}" $PY - >>"$OUT/env.txt" 2>&1 <<'EOF'
import time
import jax
import jax.numpy as jnp
import numpy as np
import optax
import jaxwap

t0 = time.perf_counter()
rng = np.random.default_rng(0)
params = {f"w{i}": jnp.asarray(rng.standard_normal((512, 512), np.float32) / 23)
          for i in range(4)}
tx = optax.adam(1e-3)
batch = {"x": jnp.asarray(rng.standard_normal((256, 512), np.float32))}

def step(params, opt_state, batch):
    def loss(p):
        h = batch["x"]
        for i in range(4):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean(h ** 2)
    l, g = jax.value_and_grad(loss)(params)
    u, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, u), opt_state, l

opt = tx.init(params)
want = jax.jit(step)(params, opt, batch)
sharded = jaxwap.auto_shard(step, params, donate=False, cache=False)
got = sharded(params, opt, batch)
err = max(float(jnp.max(jnp.abs(a - b))) for a, b in
          zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True))
print(sharded.plan.explain())
print(f"smoke: auto_shard on {jax.devices()[0].device_kind} matches jax.jit within {err:.2e}"
      f" ({time.perf_counter() - t0:.1f} s)")
assert err < 1e-3, err
EOF
rc=$?
tail -2 "$OUT/env.txt"
if [ $rc -ne 0 ]; then echo "smoke test failed ($rc): see env.txt"; tail -40 "$OUT/env.txt"; exit $rc; fi

$PY -m benchmarks.gpu.gpu_sweep --no-power-limits --out "$OUT/gpu_sweep" "$@" 2>&1 \
  | tee "$OUT/gpu_sweep.log"

# 4. benchmarks/gpu/conv_probe.py: convolutions by shape family (3x3 wide and bottleneck, 1x1,
#    first layers) at two batches, against the matmul curve the sweep calibrated.
timeout "${CONV_TIMEOUT:-120}" $PY -m benchmarks.gpu.conv_probe --out "$OUT/conv_probe" \
  --calibration "$OUT/gpu_sweep/gpu_sweep_work/calibration.json" >>"$OUT/gpu_sweep.log" 2>&1
echo "conv_probe: exit $?"; tail -8 "$OUT/gpu_sweep.log"

# 5. benchmarks/gpu/memory_rules.py: a decoder layer's memory, predicted against XLA:GPU's
#    compiled figure, scanned and unrolled, with each per-layer remat policy (compiles only)
timeout "${MEMORY_TIMEOUT:-180}" $PY -m benchmarks.gpu.memory_rules --out "$OUT/memory_rules" \
  >>"$OUT/gpu_sweep.log" 2>&1
echo "memory_rules: exit $?"; tail -16 "$OUT/gpu_sweep.log"
# the sweep's work folder (calibration, rows, traces and their programs) as one file: what
# comes back from a lent machine is counted in files
tar -C "$OUT/gpu_sweep" -czf "$OUT/gpu_sweep_work.tgz" gpu_sweep_work \
  && rm -rf "$OUT/gpu_sweep/gpu_sweep_work"
ls -laR "$OUT"
