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
token rows of one expert, and a persistent grid walks the tiles strip by strip, or (stream-K
variants) splits the (tile, 128-wide k chunk) units of the whole GEMM into one equal range per
SM, the tiles cut by a range summed in a fixed order through a small workspace
(`workspace_bytes`). The source file says how the registers of in-flight wgmmas are kept and
how the stream-K partial sums meet.

It is in the library of nvfp4_decode.py (one build, one cache entry, `loads(device)`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..checks import STATUS_WORDS, check_status, max_polls
from . import nvfp4_decode

__all__ = ["variants", "variant_shape", "describe", "default_variant", "nvfp4_wgmma_mm",
           "A16_ORDER", "is_variant", "cuda_variant", "cuda_describe", "run", "a16_order",
           "workspace_bytes", "workspace_status", "new_workspace"]

_UNIT = "nvfp4_wgmma_mm"
A16_ORDER = "fragment"   # what dequantize_rows writes for this GEMM


def variants() -> tuple:
    """The library's variant codes: 10,000,000 * (blocks per SM - 1) + 1,000,000 * (1 + 4 if
    the weights are staged in shared memory + 2 if stream-K) + 100,000 * (weight register ring
    chunks - 2) + token rows per tile * 100 + 64-row weight tiles per warpgroup * 10 + token
    stages (variant_shape decodes one)."""
    return nvfp4_decode._lib()[_UNIT][1]


def variant_shape(code: int) -> dict:
    flags = code // 1000000 % 10 - 1
    return dict(token_rows=code // 100 % 1000, weight_rows=2 * 64 * (code // 10 % 10),
                stages=code % 10, ring=code // 100000 % 10 + 2,
                blocks_per_sm=code // 10000000 + 1, staged_weights=bool(flags & 4),
                stream_k=bool(flags & 2))


def describe(code: int) -> str:
    v = variant_shape(code)
    where = ("staged in shared memory with the tokens" if v["staged_weights"] else
             f"loaded into a {v['ring']}-chunk register ring")
    split = ", stream-K (equal k-chunk ranges per block)" if v["stream_k"] else ""
    per_sm = f", {v['blocks_per_sm']} blocks per SM" if v["blocks_per_sm"] > 1 else ""
    return (f"wgmma variant {code}: {v['weight_rows']} weight rows x {v['token_rows']} token "
            f"rows per tile, {v['stages']} stages, weights {where}{split}{per_sm}")


def workspace_bytes(code: int, sms: int) -> int:
    """Bytes of the workspace variant `code` needs on a GPU of `sms` SMs (0: none), from the
    library (dm_nvfp4_wgmma_mm_workspace): a status word (checks.STATUS_WORDS int64), two int32
    ticket counters (padded to 32 bytes), one int32 flag per block of the largest grid
    (the library's kMaxBlocksPerSm per SM; padded to 16 bytes), then one fp32 partial tile per block of
    this variant's grid. Every variant finds the status word, the counters, the flags and the
    tiles at the same offsets, so one workspace serves them all (new_workspace). All but the
    tiles must be zero before the first launch; every launch that does not time out leaves
    them zero."""
    n = nvfp4_decode._dll().dm_nvfp4_wgmma_mm_workspace(int(code), int(sms))
    if n < 0:
        raise ValueError(f"variant={code}: not one of the wgmma GEMM's variants {variants()}")
    return n


def workspace_status(workspace: torch.Tensor) -> torch.Tensor:
    """The status word of a stream-K workspace (checks.STATUS_WORDS int64): where a block that
    waited too long for a partial sum records (CHECK_WAIT_TIMEOUT, WAIT_STREAMK_PARTIAL x 2^32
    + tile, the block waited for, polls); checks.check_status(...) traps with its message."""
    return workspace[:8 * STATUS_WORDS].view(torch.int64)


def new_workspace(codes, device) -> Optional[torch.Tensor]:
    """A zeroed workspace serving every variant in `codes` on `device` (one launch at a time:
    launches on one stream), or None where none needs one. Allocate it outside CUDA graph
    capture and keep it for the graphs that use it. Variants of different grids share it: the
    flags' region is sized for the largest grid (the library's kMaxBlocksPerSm)."""
    device = torch.device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    n = max([workspace_bytes(c, sms) for c in codes if is_variant(c)] + [0])
    return torch.zeros(n, dtype=torch.uint8, device=device) if n else None


def default_variant(max_rows: int, E: int, K: int) -> int:
    """The variant by rows per expert on average (max_rows / E) and the contraction length K:
    the fastest of bench_nvfp4_gemm --cuda-sweep at the guide shapes (docs/decisions.md).
    Where whole tiles would leave SMs idle for a last round (up to 160 rows per expert at the
    guide's 6 experts: 144-288 tiles on 132 SMs), stream-K: 128 weight rows x 32 token rows
    with two blocks per SM up to 32 rows per expert, 256 x 64 up to 64, then 256 x 128 for
    W13's long K.
    Whole tiles of 256 weight rows otherwise: 64 token rows up to 160 rows per expert, 128
    above (the most MMA work per decoded word) with the weights staged in shared memory."""
    per_expert = -(-max_rows // E)
    if per_expert <= 32:
        return 13103214
    if per_expert <= 64:
        return 3006424
    if per_expert <= 160:
        return 3012824 if K >= nvfp4_decode._LONG_K else 1006424
    return 5012824


def is_variant(code: int) -> bool:
    """Whether a code of the NVFP4 library is this GEMM's (the decode GEMM's are below)."""
    return code >= 1000000


def cuda_variant(max_rows: int, E: int, K: int) -> int:
    """The CUDA engine's GEMM for a row bound: the decode GEMM's variant
    (nvfp4_decode.default_variant) up to its MAX_ROWS_PER_EXPERT rows per expert, where
    streaming the weights through many small independent warps is fastest, this GEMM's
    default_variant above. (From memory_plan.NVFP4_DENSE_MIN_ROWS_PER_EXPERT the pipeline decodes the
    weights once per call instead: nvfp4_dense.py.)"""
    if -(-max_rows // E) <= nvfp4_decode.MAX_ROWS_PER_EXPERT:
        return nvfp4_decode.default_variant(max_rows, E, K)
    return default_variant(max_rows, E, K)


def cuda_describe(code: int) -> str:
    return describe(code) if is_variant(code) else "decode " + nvfp4_decode.describe(code)


def run(code: int, workspace: Optional[torch.Tensor] = None, wait_timeout_s: float = 600.0,
        check: bool = True, **kw) -> None:
    """One of the library's GEMMs by its variant code (a16 in a16_order(code)); `workspace`,
    `wait_timeout_s` and `check` serve the stream-K variants (nvfp4_wgmma_mm)."""
    if is_variant(code):
        nvfp4_wgmma_mm(variant=code, workspace=workspace, wait_timeout_s=wait_timeout_s,
                       check=check, **kw)
    else:
        nvfp4_decode.nvfp4_decode_mm(variant=code, **kw)


def a16_order(code: int) -> str:
    return A16_ORDER if is_variant(code) else "k"


_WORKSPACES: dict = {}   # (device, variant) -> the workspace of calls that pass none


def _own_workspace(variant: int, device: torch.device) -> torch.Tensor:
    key = (device, variant)
    if key not in _WORKSPACES:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"nvfp4_wgmma_mm variant {variant} (stream-K) needs a workspace: pass "
                "workspace=new_workspace([variant], device), or call it once before capturing "
                "a CUDA graph (a workspace allocated during capture belongs to the graph)")
        _WORKSPACES[key] = new_workspace([variant], device)
    return _WORKSPACES[key]


def nvfp4_wgmma_mm(*, a, a16, weight, expert_offsets, max_rows: int, epilogue: str = "store",
                   out=None, out_row_ptrs=None, variant: Optional[int] = None,
                   workspace: Optional[torch.Tensor] = None, wait_timeout_s: float = 600.0,
                   check: bool = True) -> None:
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
    workspace       uint8, at least workspace_bytes(variant, SMs), zeroed before its first use
                    (new_workspace); stream-K variants only, one launch at a time. Default: one
                    kept per device and variant for the calls that pass none
    wait_timeout_s  stream-K: how long a block waits for a lower block's partial sum before it
                    gives up and records the verdict in the workspace's status word
    check           stream-K: launch checks.check_status on that word after the GEMM (it traps
                    with the message); False where the caller checks once after several GEMMs
                    that share the workspace (workspace_status)
    """
    E, N, K = weight.shape
    assert E <= 256, f"E={E}: the wgmma GEMM takes at most 256 experts"
    assert weight.scales.data_ptr() % 8 == 0, (
        "weight.scales must be 8-byte aligned (the staged-weight variants copy 8 at a time)")
    variant = variant if variant is not None else default_variant(max_rows, E, K)
    dev = weight.packed.device
    if variant_shape(variant)["stream_k"] and dev.type == "cuda":
        if workspace is None:
            workspace = _own_workspace(variant, dev)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        need = workspace_bytes(variant, sms)
        assert (workspace.dtype == torch.uint8 and workspace.device == dev
                and workspace.is_contiguous() and workspace.numel() >= need
                and workspace.data_ptr() % 16 == 0), (
            f"workspace: expected a contiguous, 16-byte aligned uint8 tensor of >= {need} bytes "
            f"on {dev} (new_workspace), got {workspace.dtype} {tuple(workspace.shape)} on "
            f"{workspace.device}")
    else:
        workspace = None
    nvfp4_decode.launch(_UNIT, "nvfp4_wgmma_mm", variant, a=a, a16=a16, weight=weight,
                        expert_offsets=expert_offsets, max_rows=max_rows, epilogue=epilogue,
                        out=out, out_row_ptrs=out_row_ptrs, workspace=workspace,
                        polls_max=max_polls(wait_timeout_s))
    if workspace is not None and check:
        check_status(workspace_status(workspace))
