"""NVFP4 grouped GEMM on Hopper's wgmma (csrc/nvfp4_wgmma_mm.cu): tens to thousands of token
rows per expert, inference.

The contract of `nvfp4_decode.nvfp4_decode_mm` (row r of expert e gets S_dec(r) S_dec(e)
a16[r] @ dequant(W[e])^T in bf16, stored at out[r] or at out_row_ptrs[r]), with a16 in the
fragment order (`quant_nvfp4.dequantize_rows(..., order="fragment")`, whose torch twin is
`quant.nvfp4.a16_fragment_index`).

The weights are wgmma's A operand, taken from registers: each thread decodes its fragment's
E2M1 values straight from 16-byte loads (the decode GEMM's decode), so no decoded weight passes
through shared memory; the token rows are B, copied into 128-byte-swizzled shared memory a
few 128-wide chunks ahead. A block of two warpgroups owns 128 or 256 weight rows x 32-256
token rows of one expert, and a persistent grid walks the tiles strip by strip. The source
file says how the registers of in-flight wgmmas are kept.

It is in the library of nvfp4_decode.py (one build, one cache entry, `loads(device)`).
"""

from __future__ import annotations

from typing import Optional

from . import nvfp4_decode

__all__ = ["variants", "variant_shape", "describe", "default_variant", "nvfp4_wgmma_mm",
           "A16_ORDER", "is_variant", "cuda_variant", "cuda_describe", "run", "a16_order"]

_UNIT = "nvfp4_wgmma_mm"
A16_ORDER = "fragment"   # what dequantize_rows writes for this GEMM


def variants() -> tuple:
    """The library's variant codes: 1,000,000 * (1, or 5 with the weights staged in shared
    memory) + token rows per tile * 100 + 64-row weight tiles per warpgroup * 10 + token
    stages (variant_shape decodes one)."""
    return nvfp4_decode._lib()[_UNIT][1]


def variant_shape(code: int) -> dict:
    return dict(token_rows=code // 100 % 1000, weight_rows=2 * 64 * (code // 10 % 10),
                stages=code % 10, staged_weights=code // 1000000 == 5)


def describe(code: int) -> str:
    v = variant_shape(code)
    where = ("staged in shared memory with the tokens" if v["staged_weights"] else
             "loaded into a 2-chunk register ring")
    return (f"wgmma variant {code}: {v['weight_rows']} weight rows x {v['token_rows']} token "
            f"rows per tile, {v['stages']} stages, weights {where}")


def default_variant(max_rows: int, E: int, K: int) -> int:
    """The variant by rows per expert on average (max_rows / E): the fastest of
    bench_nvfp4_gemm --cuda-sweep on one H200 at the guide shapes (docs/decisions.md). Tiles
    of 256 weight rows throughout; 32 token rows per tile up to 48 rows per expert, 64 up to
    160, 128 above (the most MMA work per decoded word), with the weights staged in shared
    memory."""
    per_expert = -(-max_rows // E)
    if per_expert <= 48:
        return 1003224
    if per_expert <= 160:
        return 1006424
    return 5012824


def is_variant(code: int) -> bool:
    """Whether a code of the NVFP4 library is this GEMM's (the decode GEMM's are below)."""
    return code >= 1000000


def cuda_variant(max_rows: int, E: int, K: int) -> int:
    """The CUDA engine's GEMM for a row bound: the decode GEMM's variant in the decode regime
    (nvfp4_decode.default_variant), this GEMM's above it."""
    v = nvfp4_decode.default_variant(max_rows, E, K)
    return v if v is not None else default_variant(max_rows, E, K)


def cuda_describe(code: int) -> str:
    return describe(code) if is_variant(code) else "decode " + nvfp4_decode.describe(code)


def run(code: int, **kw) -> None:
    """One of the library's GEMMs by its variant code (a16 in a16_order(code))."""
    (nvfp4_wgmma_mm if is_variant(code) else nvfp4_decode.nvfp4_decode_mm)(variant=code, **kw)


def a16_order(code: int) -> str:
    return A16_ORDER if is_variant(code) else "k"


def nvfp4_wgmma_mm(*, a, a16, weight, expert_offsets, max_rows: int, epilogue: str = "store",
                   out=None, out_row_ptrs=None, variant: Optional[int] = None) -> None:
    """Row r of expert e gets S_dec(r) S_dec(e) a16[r] @ dequant(W[e])^T (bf16).

    a               NVFP4 byte rows [>= R, nvfp4_row_bytes(K)] (tensor or device pointer): each
                    row's fp32 S_dec is read from it
    a16             fp16 [>= R, K] (tensor or device pointer, rows 16-byte aligned) in the
                    fragment order: dequantize_rows(..., order="fragment")
    weight          a prepared.PreparedWeight [E, N, K] (16 x 16 tile scales), E <= 256
    expert_offsets  int32 [E+1] device, R = expert_offsets[E] (never read on the host)
    max_rows        host bound on R (picks the variant)
    epilogue        "store": out [R, N] bf16 (tensor or device pointer, 16-byte aligned rows);
                    "scatter": out_row_ptrs int64 [>= max_rows] (16-byte aligned row addresses)
    variant         one of variants(); default: default_variant(max_rows, E, K)
    """
    E, N, K = weight.shape
    assert E <= 256, f"E={E}: the wgmma GEMM takes at most 256 experts"
    assert weight.scales.data_ptr() % 8 == 0, (
        "weight.scales must be 8-byte aligned (the staged-weight variants copy 8 at a time)")
    variant = variant if variant is not None else default_variant(max_rows, E, K)
    nvfp4_decode.launch(_UNIT, "nvfp4_wgmma_mm", variant, a=a, a16=a16, weight=weight,
                        expert_offsets=expert_offsets, max_rows=max_rows, epilogue=epilogue,
                        out=out, out_row_ptrs=out_row_ptrs)
