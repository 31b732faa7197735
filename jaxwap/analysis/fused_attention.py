"""cuDNN's fused attention: the one adapter to jax's private surface for it.

`jax.nn.dot_product_attention(..., implementation="cudnn")` binds jax's fused-attention
primitives (`jax._src.cudnn.fused_attention_stablehlo`): in a traced training step the
forward kernel `dot_product_attention_fwd_wrapper` (results: the output and, training,
the log-sum-exp of each query row, (B, N, T) float32) and the backward kernel
`dot_product_attention_bwd_wrapper` (dq, dk, dv), the custom_vjp's two rules. No T x S
score tensor exists in such a jaxpr: the kernels keep the scores on chip.

Three things here read that private surface, and nothing else in jaxwap does:

- *tracing for the target* (`target_checks`): jax checks, at trace time, that cuDNN is
  installed (`check_cudnn_version`) and what the GPU's compute capability is
  (`check_compute_capability`, `is_cuda_compute_capability_equal`): properties of the
  planning host, where planning asks about the target. On a host that cannot answer
  (no cuDNN, no CUDA GPU) the checks answer for the target's profile
  (`DeviceSpec.compute_capability`) while planning traces; a target that cannot run
  the kernel gets a clear error instead of "cuDNN is not detected". A host that has
  cuDNN and a CUDA GPU is left alone: its own checks answer.
- *the kernels' figures* (`fused_cost`, `fused_kind`, `fused_batch`): flops, memory
  traffic and where the batch dim goes, read from the equations' shapes and params
  (`layout`, `mask_type`, `sliding_window_length`).
- *where it runs* (`uses_fused_attention`, `runs_fused_attention`): XLA compiles the
  kernels for NVIDIA GPUs only (a CUDA lowering rule), so a step that uses them cannot be
  compiled on other devices.

Every use checks the pieces it needs and raises a RuntimeError naming what jax changed,
rather than letting planning fail on a confusing error or price the kernels by a
generic rule.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import jax
import numpy as np

from jaxwap.hardware.builtin_profiles import device_spec
from jaxwap.hardware.cluster import Cluster
from jaxwap.hardware.device import DeviceSpec

_MODULE = "jax._src.cudnn.fused_attention_stablehlo"
# the trace-time checks `target_checks` answers for the target
_CHECKS = ("check_cudnn_version", "check_compute_capability",
           "is_cuda_compute_capability_equal")
# the primitives of the fused kernels in a traced step (the wrappers), and the inner ones
# their implementations bind (in a jaxpr only where someone binds them directly)
FORWARD = ("dot_product_attention_fwd_wrapper", "dot_product_attention_fwd")
BACKWARD = ("dot_product_attention_bwd_wrapper", "dot_product_attention_bwd")
PRIMITIVES = FORWARD + BACKWARD
_PARAMS = ("layout", "mask_type", "sliding_window_length", "variadic_args")
# fused_kind's answers
NONE, FUSED_FORWARD, FUSED_BACKWARD = 0, 1, 2

#: The newest cuDNN version jax's attention checks compare against (9.11: compute
#: capability 10.3 needs it; 9.10: queries and values of different head dims). A host
#: without cuDNN assumes the target's cuDNN passes them; the run on the target checks
#: the real one.
ASSUMED_CUDNN_VERSION = 91100
#: cuDNN's fused attention (its SDPA operation) "requires SM80 (Ampere) or newer" (cuDNN
#: frontend documentation, Attention, support matrix), with fp16 or bf16 inputs.
MIN_CAPABILITY = (8, 0)

_LOCK = threading.RLock()   # the patched checks are module state of jax's: one at a time


def _outdated(what: str) -> RuntimeError:
    return RuntimeError(
        f"jax {jax.__version__} changed the private API of its cuDNN fused attention "
        f"({_MODULE}) that jaxwap plans jax.nn.dot_product_attention(..., "
        f"implementation='cudnn') with: {what}. jaxwap needs updating for this jax version "
        f"(or install a jax it supports).")


def _surface() -> ModuleType:
    """jax's fused-attention module, checked to have every piece `target_checks` uses."""
    try:
        module = importlib.import_module(_MODULE)
    except ImportError as e:
        raise _outdated(f"module {_MODULE} cannot be imported ({e})") from e
    missing = [n for n in _CHECKS if not callable(getattr(module, n, None))]
    if not hasattr(module, "cuda_versions"):
        missing.append("cuda_versions")
    if missing:
        raise _outdated(f"{_MODULE} lacks {', '.join(missing)}")
    return module


# --------------------------------------------------------------------------- the host
def _host_has_cudnn(module: ModuleType) -> bool:
    return module.cuda_versions is not None


def _host_cuda_gpu() -> bool:
    """Whether the default backend's devices are CUDA GPUs (they have a compute
    capability), as jax's capability checks ask of the default backend."""
    try:
        return any(d.platform == "gpu" and getattr(d, "compute_capability", None)
                   for d in jax.devices())
    except RuntimeError:   # no backend at all
        return False


def capability(device: DeviceSpec | None) -> tuple[int, int] | None:
    """A profile's CUDA compute capability as (major, minor), None for another device."""
    cc = None if device is None else device.compute_capability
    return _parse(cc) if cc else None


def planned_device(hardware: Cluster | DeviceSpec | str | None) -> DeviceSpec | None:
    """The device profile a plan is made for, as `PlanOptions.hardware` (or a given plan's
    `hardware`) says it: a Cluster's device, a profile or its name; None: the devices
    present."""
    if hardware is None:
        return None
    if isinstance(hardware, Cluster):
        return hardware.device
    return device_spec(hardware)


def runs_fused_attention(device: DeviceSpec | None) -> bool:
    """Whether a device of this profile runs cuDNN's fused attention (a CUDA GPU of
    compute capability 8.0 or newer)."""
    cc = capability(device)
    return cc is not None and cc >= MIN_CAPABILITY


def compiles_here(devices: Sequence[Any]) -> bool:
    """Whether XLA can compile the fused kernels for these (present) devices: CUDA GPUs,
    with cuDNN installed."""
    return (bool(devices) and devices[0].platform == "gpu"
            and bool(getattr(devices[0], "compute_capability", None))
            and _host_has_cudnn(_surface()))


# --------------------------------------------------------------------------- tracing
def _cannot_run(subject: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"the step calls jax.nn.dot_product_attention(..., implementation='cudnn'), cuDNN's "
        f"fused attention, which runs on NVIDIA GPUs of compute capability "
        f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer with cuDNN; {subject} {why}. "
        f"To plan for such GPUs from this host: hardware=jaxwap.Cluster('h100-sxm', n); to "
        f"run on these devices: implementation='xla' (or None).")


def _unable(device: DeviceSpec | None) -> str | None:
    """Why devices of this profile cannot run the fused kernel, None if they can."""
    cc = capability(device)
    if cc is None:
        return "are not NVIDIA GPUs"
    if cc < MIN_CAPABILITY:
        return f"are of compute capability {cc[0]}.{cc[1]}"
    return None


def require_target(jaxpr: Any, device: DeviceSpec, devices: Sequence[Any]) -> None:
    """Raise a clear error where a step that uses the fused kernels (its traced `jaxpr`)
    is planned for devices of a profile that cannot run them, unless the `devices`
    present run them (a GPU host planning for itself). jax checks this while tracing,
    but a step jax traced before, for another target, is not traced again."""
    why = _unable(device)
    if why is not None and uses_fused_attention(jaxpr) and not compiles_here(devices):
        raise _cannot_run(f"the devices planned for ({device.name!r})", why)


def require_compilable(jaxpr: Any, devices: Sequence[Any]) -> None:
    """Raise a clear error where a step that uses the fused kernels (its traced `jaxpr`) is
    to be compiled for `devices` XLA cannot compile them for (a plan for GPUs run on a
    CPU), rather than XLA's missing lowering rule."""
    if uses_fused_attention(jaxpr) and not compiles_here(devices):
        platform = devices[0].platform if devices else "no"
        raise _cannot_run(f"the devices it is compiled for here ({platform}) cannot run "
                          f"it", "(the plan is for the GPUs; run it there)")


@contextlib.contextmanager
def target_checks(device: DeviceSpec | None) -> Iterator[None]:
    """While planning traces a step for devices of profile `device` (None: the devices
    present), jax's cuDNN checks answer for that target where the host cannot.

    On a host without cuDNN, cuDNN's version check returns `ASSUMED_CUDNN_VERSION` for a
    target that runs the kernel and raises a clear error for one that does not (a CPU, a
    GPU older than compute capability 8.0); on a host without a CUDA GPU the capability
    checks answer with the target's. A host with both is left alone. Everything is put
    back on exit; one planning patches at a time (a lock), nested uses are fine.

    Where jax no longer has the pieces patched, a step without cuDNN's attention plans as
    before, and one whose tracing fails on cuDNN gets the RuntimeError naming what jax
    changed, its own error chained.
    """
    try:
        module = _surface()
    except RuntimeError as outdated:
        try:
            yield
        except Exception as e:
            if "cudnn" in f"{type(e).__name__} {e}".lower():
                raise outdated from e
            raise
        return
    patch: dict[str, Any] = {}
    subject = ("the devices present" if device is None
               else f"the devices planned for ({device.name!r})")
    cc = capability(device)
    if not _host_has_cudnn(module):
        why = "are not NVIDIA GPUs" if device is None else _unable(device)
        if why is not None:
            def refuse(why: str = why) -> int:
                raise _cannot_run(subject, why)
            patch["check_cudnn_version"] = refuse
        else:
            patch["check_cudnn_version"] = lambda: ASSUMED_CUDNN_VERSION
    if cc is not None and not _host_cuda_gpu():
        def at_least(c: str, cc: tuple[int, int] = cc) -> bool:
            return cc >= _parse(c)

        def equal(c: str, cc: tuple[int, int] = cc) -> bool:
            return cc == _parse(c)
        patch["check_compute_capability"] = at_least
        patch["is_cuda_compute_capability_equal"] = equal
    if not patch:
        yield
        return
    with _LOCK:
        saved = {k: getattr(module, k) for k in patch}
        try:
            for k, f in patch.items():
                setattr(module, k, f)
            yield
        finally:
            for k, f in saved.items():
                setattr(module, k, f)


def _parse(c: str) -> tuple[int, int]:
    major, _, minor = str(c).partition(".")
    return int(major), int(minor or 0)


def uses_fused_attention(jaxpr: Any) -> bool:
    """Whether a (closed) jaxpr binds the fused kernels anywhere, sub-jaxprs included."""
    seen: set[int] = set()

    def walk(j: Any) -> bool:
        j = getattr(j, "jaxpr", j)
        if id(j) in seen:
            return False
        seen.add(id(j))
        for eqn in getattr(j, "eqns", ()):
            if eqn.primitive.name in PRIMITIVES:
                return True
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    if (hasattr(sub, "eqns") or hasattr(sub, "jaxpr")) and walk(sub):
                        return True
        return False
    return walk(jaxpr)


# --------------------------------------------------------------------------- the kernels
def kept_pairs(q_len: int, kv_len: int, causal: bool, window: int | None = None) -> int:
    """The (query, key) pairs per head the kernel computes: all of them, or under a
    causal mask (query i sees keys 0..i, cuDNN's top-left alignment) those kept, within
    the last `window` keys of a sliding window. FlashAttention's and cuDNN's published
    rates count a causal kernel's flops this way (half the square)."""
    if not causal:
        return q_len * kv_len
    cap = min(kv_len, window) if window else kv_len
    m = min(q_len, cap)
    return m * (m + 1) // 2 + max(0, q_len - cap) * cap


def fused_flops(pairs: int, kept: int, qk_dim: int, v_dim: int, backward: bool) -> float:
    """Matmul flops of the fused kernel over `pairs` (batch x query heads) score matrices
    of `kept` entries each. Forward: S = QK^T and O = PV, 2 x kept x (dk + dv) per pair.
    Backward (FlashAttention's): S recomputed, dP = dO V^T, dV = P^T dO, dQ = dS K,
    dK = dS^T Q: 2 x kept x (3 dk + 2 dv), 2.5x the forward at dk = dv."""
    per = 3 * qk_dim + 2 * v_dim if backward else qk_dim + v_dim
    return 2.0 * pairs * kept * per


@dataclass(frozen=True)
class FusedShape:
    """One fused-attention equation's problem: `pairs` score matrices (batch x query
    heads) of `q_len` x `kv_len`, `kept` entries of each computed (`kept_pairs`), head
    dims `qk_dim` (queries and keys) and `v_dim` (values)."""

    pairs: int
    q_len: int
    kv_len: int
    qk_dim: int
    v_dim: int
    kept: int
    backward: bool


def fused_kind(eqn: Any) -> int:
    """FUSED_FORWARD, FUSED_BACKWARD, or NONE for an equation of another primitive."""
    name = eqn.primitive.name
    return FUSED_FORWARD if name in FORWARD else FUSED_BACKWARD if name in BACKWARD else NONE


def fused_shape(eqn: Any) -> FusedShape:
    """The problem a fused-attention equation solves, from its operands and params
    (`layout` 0: BTNH, 1: BNTH; `mask_type` CAUSAL or PADDING_CAUSAL; a sliding window).
    Padded sequences are priced whole: their lengths are data."""
    params = eqn.params
    missing = [p for p in _PARAMS if p not in params]
    if missing or len(eqn.invars) < 3:
        raise _outdated(f"the equation {eqn.primitive.name} lacks the params {missing} or "
                        f"its query, key and value operands")
    layout = params["layout"]
    if layout not in (0, 1):
        raise _outdated(f"{eqn.primitive.name} has layout={layout!r}, not 0 (BTNH) or "
                        f"1 (BNTH)")
    q, k, v = (tuple(x.aval.shape) for x in eqn.invars[:3])
    if not len(q) == len(k) == len(v) == 4:
        raise _outdated(f"{eqn.primitive.name} operands are not 4-D (query {q}, key {k}, "
                        f"value {v})")
    if layout == 0:
        (b, t, n, dk), s = q, k[1]
    else:
        (b, n, t, dk), s = q, k[2]
    mask = params["mask_type"]
    causal = "CAUSAL" in str(getattr(mask, "name", mask)).upper()
    window = params["sliding_window_length"]
    return FusedShape(b * n, t, s, dk, v[3], kept_pairs(t, s, causal, window),
                      fused_kind(eqn) == FUSED_BACKWARD)


def _nbytes(aval: Any) -> float:
    return float(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)


def fused_cost(eqn: Any) -> tuple[float, float]:
    """(flops, memory traffic) of a fused-attention equation: its matmul flops
    (`fused_flops`) and its operands read and results written once each (queries, keys,
    values, and in the backward pass the output, its gradient and the log-sum-exp; no
    score matrix: the kernel keeps it on chip)."""
    sh = fused_shape(eqn)
    traffic = sum(_nbytes(x.aval) for x in eqn.invars) + sum(_nbytes(x.aval)
                                                             for x in eqn.outvars)
    return fused_flops(sh.pairs, sh.kept, sh.qk_dim, sh.v_dim, sh.backward), traffic


# each operand's and result's dims by role: B batch, N heads, T queries, S keys, D the
# query/key feature, E the value feature
_Q = {0: "BTND", 1: "BNTD"}
_K = {0: "BSND", 1: "BNSD"}
_V = {0: "BSNE", 1: "BNSE"}
_O = {0: "BTNE", 1: "BNTE"}
_SEQLEN, _BIAS, _LSE = "B", "BNTS", "BNT"


def _roles(eqn: Any) -> tuple[list[str], list[str]]:
    layout = eqn.params.get("layout")
    if layout not in (0, 1):
        raise _outdated(f"{eqn.primitive.name} has layout={layout!r}")
    ins = [_Q[layout], _K[layout], _V[layout], _BIAS, _SEQLEN, _SEQLEN, "", "", "", ""]
    if fused_kind(eqn) == FUSED_BACKWARD:
        return ins + [_LSE, _O[layout], _O[layout]], [_Q[layout], _K[layout], _V[layout],
                                                      _BIAS]
    return ins, [_O[layout], _LSE]


def fused_batch(eqn: Any, axes: Sequence[int | None]) -> tuple[list[int | None], bool]:
    """Where a fused-attention equation puts a split dim of its operands (the batch dim
    for data parallelism, the heads for tensor parallelism): the batch and the heads go
    to every result's batch and head dims, the queries to the output's (and its
    gradient's) query dim; a key or feature dim is contracted or mixed by the softmax,
    whole on every device. Nothing is summed over the batch."""
    ins, outs = _roles(eqn)
    role = None
    for v, a, r in zip(eqn.invars, axes, ins, strict=False):
        if a is not None and len(r) == len(v.aval.shape) and a < len(r):
            role = r[a]
            break
    moved: list[int | None] = []
    for v, r in zip(eqn.outvars, outs, strict=False):
        ok = role is not None and role in "BNT" and len(r) == len(v.aval.shape)
        moved.append(r.index(role) if ok and role in r else None)
    return moved + [None] * (len(eqn.outvars) - len(moved)), False


__all__ = ["ASSUMED_CUDNN_VERSION", "BACKWARD", "FORWARD", "FUSED_BACKWARD", "FUSED_FORWARD",
           "MIN_CAPABILITY", "NONE", "PRIMITIVES", "FusedShape", "capability",
           "compiles_here", "fused_batch", "fused_cost", "fused_flops", "fused_kind",
           "fused_shape", "kept_pairs", "planned_device", "require_compilable",
           "require_target", "runs_fused_attention", "target_checks",
           "uses_fused_attention"]
