"""The advice a plan carries about attention: what materialized scores cost in its step and
what cuDNN's fused kernel would give instead. The record and its lines in `explain()` live
here, with the plan; `decide.score_detection` finds the scores, `decide.fused_counterfactual`
builds the step without them and `decide.attention_advice` prices the alternative."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxwap.core.units import si


@dataclass(frozen=True)
class AttentionAdvice:
    """What materialized attention scores take in a plan's step and what cuDNN's fused
    kernel would give instead, on the plan's mesh and layouts (all predicted, per
    device).

    `seconds`: the ops that make or read the scores, of `step_time_s`; `bytes`: what the
    scores add to `peak_memory_bytes` (the peak less the fused step's); the `fused_*`
    figures: the step with the fused kernels on the same layouts (`fused_seconds` their
    time); the `replanned_*`: the fused step's best plan, which may lay it out otherwise
    (empty mesh: none found)."""

    mesh: str
    instances: int
    shape: tuple[int, ...]
    dtype: str
    masked: bool
    seconds: float
    step_time_s: float
    bytes: float
    peak_memory_bytes: float
    fused_seconds: float
    fused_step_time_s: float
    fused_peak_memory_bytes: float
    replanned_mesh: str = ""
    replanned_step_time_s: float = 0.0
    replanned_peak_memory_bytes: float = 0.0
    variant: str = "as written"   # the step variant both were priced for

    def lines(self) -> list[str]:
        """The advice as `Plan.explain()` prints it."""
        t, f = self.step_time_s, self.fused_step_time_s
        shape = scores_shape(self.shape)
        variant = self.variant if self.variant == "as written" else f"in {self.variant}"
        return [
            f"  attention scores: {self.instances} attention score products a step "
            f"materialize {shape} scores ({self.dtype} queries and keys"
            + (", a position mask" if self.masked else "") + "); making and reading "
            f"them takes "
            f"{self.seconds * 1e3:.3f} ms of the {t * 1e3:.3f} ms step "
            f"({self.seconds / t:.0%}) and they add {si(self.bytes, 'B')} to its "
            f"{si(self.peak_memory_bytes, 'B')} peak per device "
            f"({self.bytes / max(self.peak_memory_bytes, 1.0):.0%}) (predicted, mesh "
            f"{self.mesh})",
            "  jax.nn.dot_product_attention(..., implementation=\"cudnn\""
            + (", is_causal=True" if self.masked else "") + ") keeps them on chip "
            f"(cuDNN's fused kernel, {self.fused_seconds * 1e3:.3f} ms at its published "
            f"rate): on this layout, step {f * 1e3:.3f} ms ({t / f:.2f}x as fast), peak "
            f"{si(self.fused_peak_memory_bytes, 'B')} per device (predicted)"
            + (f"; planned with it (the step {variant}, as this plan), mesh "
               f"{self.replanned_mesh}: step "
               f"{self.replanned_step_time_s * 1e3:.3f} ms "
               f"({t / self.replanned_step_time_s:.2f}x as fast), peak "
               f"{si(self.replanned_peak_memory_bytes, 'B')} per device (predicted)"
               if self.replanned_mesh else ""),
        ]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttentionAdvice:
        return cls(**{**d, "shape": tuple(d["shape"])})


def scores_shape(shape: Sequence[int]) -> str:
    """A score product's scores as a person reads them: matrices (batch x heads) of
    queries x keys."""
    *lead, t, s = shape
    return f"{math.prod(lead)} x {t} x {s} (batch x heads, queries, keys)"


__all__ = ["AttentionAdvice", "scores_shape"]
