"""The expert activation, described once: SwiGLU or the clamped GPT-OSS form, on h1 = [g | u].

    swiglu          h2 = silu(g) * u
    swiglu_clamped  g' = min(g, limit), u' = clamp(u, -limit, limit),
                    h2 = g' * sigmoid(alpha * g') * (u' + 1)

`Activation` is the description (built from a Config) and the plain-torch implementation every
torch twin, oracle and the reference backend use; the Triton kernels implement the same math in
`kernels/rows.py` (`swiglu_grad`, `_act_fwd`) and are tested against it. The backward follows
torch.clamp's autograd: the gradient passes strictly inside the interval and is 0 at a bound
(which block-quantized h1 values hit exactly far more often than bf16 ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Activation", "ACTIVATIONS"]

ACTIVATIONS = ("swiglu", "swiglu_clamped")


@dataclass(frozen=True)
class Activation:
    kind: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"activation {self.kind!r}: expected one of {ACTIVATIONS}")

    @classmethod
    def of(cls, config) -> "Activation":
        """The activation a Config describes (its activation, swiglu_alpha, swiglu_limit)."""
        return cls(config.activation, float(config.swiglu_alpha), float(config.swiglu_limit))

    @property
    def clamped(self) -> bool:
        return self.kind == "swiglu_clamped"

    def forward(self, h1_R2F: torch.Tensor) -> torch.Tensor:
        """h2 [.., F] from h1 [.., 2F] = [gate | up], in h1's dtype (pass an upcast h1)."""
        F = h1_R2F.shape[-1] // 2
        g, u = h1_R2F[..., :F], h1_R2F[..., F:]
        if not self.clamped:
            return torch.nn.functional.silu(g) * u
        g = g.clamp(max=self.limit)
        u = u.clamp(-self.limit, self.limit)
        return g * torch.sigmoid(self.alpha * g) * (u + 1)

    def backward(self, h1_R2F: torch.Tensor, grad_h2_RF: torch.Tensor) -> torch.Tensor:
        """grad_h1 [.., 2F] = d forward / d h1 * grad_h2, in h1's dtype (closed form; equal to
        autograd of `forward`)."""
        F = h1_R2F.shape[-1] // 2
        g, u = h1_R2F[..., :F], h1_R2F[..., F:]
        if not self.clamped:
            s = torch.sigmoid(g)
            grad_g = grad_h2_RF * u * (s * (1 + g * (1 - s)))
            grad_u = grad_h2_RF * (g * s)
        else:
            gc = g.clamp(max=self.limit)
            uc = u.clamp(-self.limit, self.limit)
            s = torch.sigmoid(self.alpha * gc)
            grad_g = grad_h2_RF * (uc + 1) * (s + self.alpha * gc * s * (1 - s)) * (g < self.limit)
            grad_u = grad_h2_RF * (gc * s) * ((u > -self.limit) & (u < self.limit))
        return torch.cat([grad_g, grad_u], dim=-1)
