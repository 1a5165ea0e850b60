"""Prepared expert weights: the quantized form an inference precision reads (NVFP4).

    prepared = dm.prepare_expert_weights(w13, w2, precision="nvfp4")
    y = dm.routed_experts(x, ids, scores, prepared.w13, prepared.w2, ctx)   # inference context
    torch.save(prepared, path); prepared = torch.load(path)                # plain torch.load

An inference context with precision="nvfp4" reads its experts' weights in that form only: the
weights are quantized once, outside the call, and the call reads 4-bit values (the decode
regime reads weights, so their bytes are the cost). `PreparedWeight` holds one weight matrix
per local expert: packed E2M1 values (two per byte), E4M3 block scales and one fp32 global
scale per expert matrix (quant/nvfp4.py). Its `shape` is the bf16 weight's: [E_local, 2F, D]
for W13 (gate rows, then up rows) and [E_local, D, F] for W2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import RoutedExpertsInputError

__all__ = ["PreparedWeight", "PreparedExperts", "prepare_expert_weights", "PREPARED_PRECISIONS"]

PREPARED_PRECISIONS = ("nvfp4",)


@dataclass(frozen=True)
class PreparedWeight:
    """One quantized weight tensor [E, N, K] (K the contraction axis).

    packed        uint8 [E, N, K / 2]: two E2M1 codes per byte (quant/nvfp4.py's nibble order)
    scales        torch.float8_e4m3fn block scales (quant/nvfp4.quantize_weight's layout)
    global_scale  fp32 [E]: each expert matrix's global (encode) scale
    shape         (E, N, K) of the bf16 weight it was made from
    precision     "nvfp4"
    """

    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    shape: tuple
    precision: str = "nvfp4"

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales,
                                                          self.global_scale))

    def to(self, device) -> "PreparedWeight":
        return PreparedWeight(self.packed.to(device), self.scales.to(device),
                              self.global_scale.to(device), tuple(self.shape), self.precision)

    def dequantize(self) -> torch.Tensor:
        """fp32 [E, N, K]: the values the GEMMs multiply."""
        from .quant import nvfp4
        return nvfp4.dequantize_weight(self.packed, self.scales, self.global_scale)

    def check(self, name: str, shape: tuple, precision: str, device: torch.device) -> None:
        """Raise RoutedExpertsInputError(name) unless this is a well-formed `precision` weight of
        `shape` on `device`."""
        if self.precision != precision:
            raise RoutedExpertsInputError(name, f"prepared for precision {self.precision!r}, "
                                          f"the context runs {precision!r}")
        if tuple(self.shape) != tuple(shape):
            raise RoutedExpertsInputError(name, f"prepared from a weight of shape "
                                          f"{list(self.shape)}, expected {list(shape)}")
        E, N, K = shape
        if tuple(self.packed.shape) != (E, N, K // 2) or self.packed.dtype != torch.uint8:
            raise RoutedExpertsInputError(name, f"packed data {self.packed.dtype} "
                                          f"{list(self.packed.shape)}, expected uint8 "
                                          f"{[E, N, K // 2]}")
        if self.scales.dtype != torch.float8_e4m3fn or self.scales.shape[0] != E:
            raise RoutedExpertsInputError(name, f"block scales {self.scales.dtype} "
                                          f"{list(self.scales.shape)}: expected E4M3 with "
                                          f"{E} experts")
        if tuple(self.global_scale.shape) != (E,) or self.global_scale.dtype != torch.float32:
            raise RoutedExpertsInputError(name, f"global scales {self.global_scale.dtype} "
                                          f"{list(self.global_scale.shape)}, expected fp32 [{E}]")
        for part, t in (("packed", self.packed), ("scales", self.scales),
                        ("global_scale", self.global_scale)):
            if t.device != device:
                raise RoutedExpertsInputError(name, f"{part} is on {t.device}, the context is "
                                              f"on {device}")
            if not t.is_contiguous():
                raise RoutedExpertsInputError(name, f"{part} must be contiguous")


@dataclass(frozen=True)
class PreparedExperts:
    """The prepared W13 and W2 of one MoE layer's local experts."""

    w13: PreparedWeight
    w2: PreparedWeight

    @property
    def precision(self) -> str:
        return self.w13.precision

    def to(self, device) -> "PreparedExperts":
        return PreparedExperts(self.w13.to(device), self.w2.to(device))


def _error(arg: str, message: str) -> RoutedExpertsInputError:
    return RoutedExpertsInputError(arg, message, function="prepare_expert_weights")


def _weight(name: str, w, ndim_ok: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise _error(name, f"expected a torch.Tensor, got {type(w).__name__}")
    if w.dim() not in ndim_ok:
        raise _error(name, f"expected {' or '.join(f'{d}-d' for d in ndim_ok)}, got shape "
                     f"{list(w.shape)}")
    if w.dtype not in (torch.bfloat16, torch.float32):
        raise _error(name, f"dtype {w.dtype}: expected bfloat16 or float32")
    if w.device.type == "meta":
        raise _error(name, "is a meta tensor: prepare weights that hold values")
    if w.numel() == 0:
        raise _error(name, f"is empty (shape {list(w.shape)}): expected at least one expert")
    return w


def prepare_expert_weights(w13, w2, precision: str = "nvfp4") -> PreparedExperts:
    """Quantize one layer's expert weights for an inference context of `precision`.

    w13  [E_local, 2, F, D] or [E_local, 2F, D] (gate rows, then up rows), bf16 or fp32
    w2   [E_local, D, F]
    Runs on the weights' device (plain torch; once per weight version). The contraction axes
    (D for W13, F for W2) must be multiples of 16, NVFP4's block.
    """
    if precision not in PREPARED_PRECISIONS:
        raise _error("precision", f"{precision!r}: weights are prepared for "
                     f"{PREPARED_PRECISIONS} (the other precisions read the bf16 weights "
                     "directly)")
    w13 = _weight("w13", w13, (3, 4))
    w2 = _weight("w2", w2, (3,))
    if w13.dim() == 4:
        if w13.shape[1] != 2:
            raise _error("w13", f"expected [E_local, 2, F, D], got {list(w13.shape)}")
        w13 = w13.reshape(w13.shape[0], -1, w13.shape[-1])
    E, F2, D = w13.shape
    if tuple(w2.shape) != (E, D, F2 // 2):
        raise _error("w2", f"expected [E_local={E}, D={D}, F={F2 // 2}] to match w13 "
                     f"{list(w13.shape)}, got {list(w2.shape)}")
    if w2.device != w13.device:
        raise _error("w2", f"is on {w2.device}, w13 on {w13.device}")
    for name, k in (("w13", D), ("w2", F2 // 2)):
        if k % 16:
            raise _error(name, f"contraction width {k} is not a multiple of 16 (NVFP4 block)")
    # NVFP4's amax ignores NaN and Inf sets the scale of its whole matrix: a non-finite weight
    # would be stored as some finite value, or zero its neighbours, without a trace
    for name, w in (("w13", w13), ("w2", w2)):
        bad = ~torch.isfinite(w)
        if bool(bad.any()):
            where = [int(v) for v in bad.nonzero()[0]]
            raise _error(name, f"holds {int(bad.sum())} NaN or Inf values (first at {where}, "
                         f"value {float(w[tuple(where)])})")
    from .quant import nvfp4

    def one(w):
        packed, scales, g = nvfp4.quantize_weight(w.contiguous())
        return PreparedWeight(packed.contiguous(), scales.contiguous(),
                              g.to(torch.float32).contiguous(), tuple(w.shape), precision)
    return PreparedExperts(one(w13), one(w2))


# torch.load(weights_only=True), its default, accepts these classes
torch.serialization.add_safe_globals([PreparedWeight, PreparedExperts])
