"""Tile configurations of the grouped GEMMs: the table, and the choice per kernel and shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common import HAS_TMA, interpreting

__all__ = ["GroupedGemmConfig", "CONFIG_TABLE", "INTERPRETER_CONFIG", "MIN_BLOCK_M",
           "CLAIM_SLICE_K", "DECODE_ROWS", "select_config"]

# Width of the column slices a claimed m-tile copy is cut into (GroupedGemmConfig.claim_slice_k
# None takes it): every program that reaches the m-tile copies a few of them.
CLAIM_SLICE_K = 512


@dataclass(frozen=True)
class GroupedGemmConfig:
    """Tile shape and launch parameters of one grouped GEMM launch.

    block_n is the output width a program computes; for the "swiglu" epilogue it is the gate
    width plus the up width (each half is block_n // 2 wide), so 128x256 costs the same registers
    in every epilogue. For wgrad, block_m/block_n tile out[e] [M, N] and block_k steps over rows.
    tma: load dense operands through TMA descriptors built on the device (needs Hopper and
    `triton.set_allocator`, which the launcher provides when none is set).
    Claim mode only (the staged pipeline's W13 FPROP and W2 DGRAD, see claim.py):
      copy_k           column width of one load/store step of the m-tile copy (BLOCK_M x copy_k
                       elements in flight per program; lowered by the launcher to a divisor of
                       Kd and to at most 128 elements per thread)
      claim_slice_k    width of the column slices an m-tile copy is cut into (None:
                       CLAIM_SLICE_K; lowered to a divisor of Kd, at least copy_k)
      claim_ahead      >= 1: before its own m-tile, a program copies claim_ahead_slices slices of
                       the m-tile of the tile it processes claim_ahead iterations later; 0: on
                       demand only
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False
    copy_k: int = 256
    claim_ahead: int = 1
    claim_slice_k: int | None = None
    claim_ahead_slices: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "copy_k"):
            v = getattr(self, name)
            assert v >= 16 and v & (v - 1) == 0, f"{name}={v}: tiles must be powers of two >= 16"
        assert self.claim_slice_k is None or (
            self.claim_slice_k >= 16 and self.claim_slice_k & (self.claim_slice_k - 1) == 0), (
            f"claim_slice_k={self.claim_slice_k}: a power of two >= 16")
        assert self.group_m >= 1, f"group_m={self.group_m} must be >= 1"
        assert self.claim_ahead >= 0, f"claim_ahead={self.claim_ahead} must be >= 0"
        assert self.claim_ahead_slices >= 1, (
            f"claim_ahead_slices={self.claim_ahead_slices} must be >= 1")
        assert not self.tma or HAS_TMA, "tma=True needs tl.make_tensor_descriptor (Triton >= 3.4)"

    @property
    def slice_k(self) -> int:
        return CLAIM_SLICE_K if self.claim_slice_k is None else self.claim_slice_k


# Explicit table (no autotuning inside graph capture). Keys: kernel kind, then a shape class.
# From benchmarks/bench_grouped_gemm.py --sweep on H200 (6 experts x 2048 rows, D=7168, F=3072):
# 128x256x64, 4 stages, 8 warps with TMA loads was best or within 2% for every kernel; the same
# tile with plain loads ran 10-25% slower.
CONFIG_TABLE: dict[tuple[str, str], GroupedGemmConfig] = {
    ("fwd", "large"): GroupedGemmConfig(128, 256, 64, 8, 8, 4, tma=HAS_TMA),
    ("fwd", "small"): GroupedGemmConfig(128, 128, 64, 8, 8, 5, tma=HAS_TMA),
    # FPROP with at most DECODE_ROWS rows per expert (inference at small T): the weights are
    # the whole read, and 128 x 256 tiles leave a second wave of 12 tiles for W13 (144 tiles on
    # 132 SMs); 64 x 128 x 128 tiles make 288, with 192 KB of loads in flight per SM
    ("fwd", "decode"): GroupedGemmConfig(64, 128, 128, 8, 4, 4, tma=HAS_TMA),
    ("dgrad", "large"): GroupedGemmConfig(128, 256, 64, 8, 8, 4, tma=HAS_TMA),
    ("dgrad", "small"): GroupedGemmConfig(128, 128, 64, 8, 8, 5, tma=HAS_TMA),
    ("wgrad", "large"): GroupedGemmConfig(128, 256, 64, 8, 8, 4, tma=HAS_TMA),
    ("wgrad", "small"): GroupedGemmConfig(128, 128, 64, 8, 8, 5, tma=HAS_TMA),
}
DECODE_ROWS = 64

# Tiny tiles so the CPU interpreter finishes quickly and small test shapes span several tiles
# (and several claim slices).
INTERPRETER_CONFIG = GroupedGemmConfig(16, 32, 32, 2, 4, 1, claim_slice_k=32)
MIN_BLOCK_M = min(c.block_m for c in (*CONFIG_TABLE.values(), INTERPRETER_CONFIG))


def select_config(kind: str, *, n: int, kd: int, device: torch.device,
                  rows_per_expert: int | None = None) -> GroupedGemmConfig:
    """Pick the table entry for `kind` in ("fwd", "dgrad", "wgrad").

    n is the output width a program tiles (for swiglu the full 2F), kd the contraction width
    (for wgrad: n = N and kd = M, the two output dims). Shapes whose output width is small or
    not a multiple of 256 use 128x128 tiles so that fewer columns are masked off.
    rows_per_expert: the host bound max_rows / E of an FPROP; at most DECODE_ROWS picks the
    decode tiles (where kd is a multiple of their block_k).
    """
    if device.type != "cuda" or interpreting():
        return INTERPRETER_CONFIG
    decode = CONFIG_TABLE[("fwd", "decode")]
    if (kind == "fwd" and rows_per_expert is not None and rows_per_expert <= DECODE_ROWS
            and kd % decode.block_k == 0):   # the K loop is unmasked
        return decode
    shape_class = "large" if (n % 256 == 0 and n >= 1024) else "small"
    return CONFIG_TABLE[(kind, shape_class)]
