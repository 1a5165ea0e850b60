"""Persistent grouped GEMMs for routed experts (Triton, Hopper first).

Rows are sorted expert-major: rows of local expert e are [psum[e], psum[e+1]) where
`expert_offsets` (int32 [E+1], device) holds the cumulative row ends (psum[0] = 0, psum[E] = R).
R and every segment length are device values that the host never reads, so every launcher is
CUDA-graph capturable: the grid is a host bound (at most the SM count, fewer when a host
`max_rows` bound says there are fewer tiles), and each persistent program walks the tile list
that the device offsets define.

Three launchers share one kernel (`_grouped_mm_kernel`) or its wgrad sibling:

  grouped_mm_fwd    out[r, :] = a[r, :] @ w[e].T       w [E, N, Kd]  (FPROP: W13, W2 forward)
  grouped_mm_dgrad  out[r, :] = a[r, :] @ w[e]         w [E, Kd, N]  (DGRAD: W2 and W13 backward)
  grouped_mm_wgrad  out[e]    = a_e.T @ b_e            a [R, M], b [R, N], out [E, M, N]

A-operand modes (the rows of A that a tile multiplies):
  dense     `a` [R, Kd]; TMA or plain loads.
  gather    `a_row_ptrs`: every program loads its A tile through the row addresses (every n-tile
            program re-reads the rows: slow over NVLink), optionally saving it to `a_copy_out`.
  claim     `a_row_ptrs` + `a_copy_out` + `claim_flags`: the first program that reaches an m-tile
            claims it (atomic flag), copies its rows into `a_copy_out` once, publishes it; every
            tile then reads A densely from `a_copy_out` (TMA or plain loads). See `ClaimFlags`.

Operands at device-chosen addresses travel as *device pointers*: int64 [1] tensors holding an
absolute address (`device_ptr`). Rows read from / written to peers travel as per-row address
tables: int64 [>= R] tensors, 0 meaning "no row" (a gathered 0 row reads zeros, a scattered 0 row
is skipped). Every address must be 16-byte aligned (the kernels tell the compiler so, to get
vectorized loads); rows of bf16 with width a multiple of 64 keep row addresses aligned.

The compute dtype is the dtype of `w` (bf16 in production; fp32/fp16 also in the kernel tests).
Accumulation is always fp32. In the CPU interpreter, whose bf16 `tl.dot` is broken, operands are
widened to fp32 before the dot (`_dot`), which forms the same exact products.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..config import env_switch
from .launch import grid_dependency_wait, pdl_args
from .rows import swiglu_grad

__all__ = [
    "GroupedGemmConfig",
    "CONFIG_TABLE",
    "INTERPRETER_CONFIG",
    "select_config",
    "device_ptr",
    "grouped_mm_fwd",
    "grouped_mm_dgrad",
    "grouped_mm_wgrad",
    "ExpertOutTable",
    "ClaimFlags",
    "EPILOGUES",
    "ACTIVATIONS",
]

EPILOGUES = ("store", "swiglu", "scatter", "swiglu_bwd")
ACTIVATIONS = ("swiglu", "swiglu_clamped")
_EPI_STORE, _EPI_SWIGLU, _EPI_SCATTER, _EPI_SWIGLU_BWD = 0, 1, 2, 3
_ACT_SWIGLU, _ACT_SWIGLU_CLAMPED = 0, 1

_HAS_TMA = hasattr(tl, "make_tensor_descriptor")


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupedGemmConfig:
    """Tile shape and launch parameters of one grouped GEMM launch.

    block_n is the output width a program computes; for the "swiglu" epilogue it is the gate
    width plus the up width (each half is block_n // 2 wide), so 128x256 costs the same registers
    in every epilogue. For wgrad, block_m/block_n tile out[e] [M, N] and block_k steps over rows.
    tma: load dense operands through TMA descriptors built on the device (needs Hopper and
    `triton.set_allocator`, which the launcher provides when none is set); gathered rows always
    use plain loads.
    copy_k, claim_ahead: claim mode only (ignored otherwise). copy_k is the column width of one
    load/store step of the m-tile copy (BLOCK_M x copy_k elements in flight per program; the
    launcher lowers it to a divisor of Kd). claim_ahead >= 1: before waiting for its own m-tile,
    a program also tries to claim (and copy) the m-tile of the tile it will process
    claim_ahead iterations later, so most copies happen about claim_ahead waves before use;
    0 claims on demand only. The launcher lowers copy_k to a divisor of Kd and to at most 128
    elements per thread (BLOCK_M x copy_k / (32 num_warps)): 256 for 128-row tiles, 8 warps.
    claim_slice_k: claim mode only. None: the module default CLAIM_SLICE_K (512, or
    $DIST_MOE_CLAIM_SLICE_K). 0: one program copies a whole m-tile (BLOCK_M x Kd). > 0:
    the m-tile is cut into column slices of this width (lowered to a divisor of Kd, at least
    copy_k) that the programs reaching the m-tile claim one at a time, so the copy is spread
    over them instead of stalling one (see `_claim_slices_phase`). claim_ahead_slices: how many
    slices of its next m-tile a program copies ahead (about num_n programs visit an m-tile and
    roughly half of them in the wave before; 2 each covers the ~14 slices of a 7168-wide row).
    flatten: let Triton fuse the persistent tile loop with the K loop (`tl.range(flatten=True)`),
    so the next tile's first loads are issued before this tile's epilogue; None: the module
    default FLATTEN ($DIST_MOE_GEMM_FLATTEN, off). Not applied to claim-mode launches.
    wgrad_persistent: WGRAD with TMA only: one persistent launch over every expert's tiles
    (`_grouped_mm_wgrad_persistent_kernel`); None: the module default WGRAD_PERSISTENT.
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
    claim_slice_k: Optional[int] = None
    claim_ahead_slices: int = 2
    flatten: Optional[bool] = None
    wgrad_persistent: Optional[bool] = None

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "copy_k"):
            v = getattr(self, name)
            assert v >= 16 and v & (v - 1) == 0, f"{name}={v}: tiles must be powers of two >= 16"
        assert self.claim_slice_k is None or self.claim_slice_k == 0 or (
            self.claim_slice_k >= 16 and self.claim_slice_k & (self.claim_slice_k - 1) == 0), (
            f"claim_slice_k={self.claim_slice_k}: 0 (whole m-tiles) or a power of two >= 16")
        assert self.group_m >= 1, f"group_m={self.group_m} must be >= 1"
        assert self.claim_ahead >= 0, f"claim_ahead={self.claim_ahead} must be >= 0"
        assert self.claim_ahead_slices >= 1, (
            f"claim_ahead_slices={self.claim_ahead_slices} must be >= 1")
        assert not self.tma or _HAS_TMA, "tma=True needs tl.make_tensor_descriptor (Triton >= 3.4)"


# Explicit table (no autotuning inside graph capture). Keys: kernel kind, then a shape class.
# Measured on H200 (benchmarks/bench_grouped_gemm.py --sweep, 6 experts x 2048 rows, D=7168,
# F=3072; BENCHMARKS.md): 128x256x64, 4 stages, 8 warps with TMA loads was best or within 2%
# for every kernel: fwd+SwiGLU 721, W2 scatter 701, DGRAD 672-735, WGRAD 603-627 TFLOP/s;
# the same tile with plain loads reached 536-589.
CONFIG_TABLE: dict[tuple[str, str], GroupedGemmConfig] = {
    ("fwd", "large"): GroupedGemmConfig(128, 256, 64, 8, 8, 4, tma=_HAS_TMA),
    ("fwd", "small"): GroupedGemmConfig(128, 128, 64, 8, 8, 5, tma=_HAS_TMA),
    ("dgrad", "large"): GroupedGemmConfig(128, 256, 64, 8, 8, 4, tma=_HAS_TMA),
    ("dgrad", "small"): GroupedGemmConfig(128, 128, 64, 8, 8, 5, tma=_HAS_TMA),
    ("wgrad", "large"): GroupedGemmConfig(128, 256, 64, 8, 8, 4, tma=_HAS_TMA),
    ("wgrad", "small"): GroupedGemmConfig(128, 128, 64, 8, 8, 5, tma=_HAS_TMA),
}
# Tiny tiles so the CPU interpreter finishes quickly and small test shapes span several tiles.
INTERPRETER_CONFIG = GroupedGemmConfig(16, 32, 32, 2, 4, 1)
_MIN_BLOCK_M = min(c.block_m for c in (*CONFIG_TABLE.values(), INTERPRETER_CONFIG))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_config(kind: str, *, n: int, kd: int, device: torch.device) -> GroupedGemmConfig:
    """Pick the table entry for `kind` in ("fwd", "dgrad", "wgrad").

    n is the output width a program tiles (for swiglu the full 2F), kd the contraction width
    (for wgrad: n = N and kd = M, the two output dims). Shapes whose output width is small or
    not a multiple of 256 use 128x128 tiles so that fewer columns are masked off.
    """
    if device.type != "cuda" or _interpreting():
        return INTERPRETER_CONFIG
    shape_class = "large" if (n % 256 == 0 and n >= 1024) else "small"
    return CONFIG_TABLE[(kind, shape_class)]


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _default_num_programs(device: torch.device) -> int:
    if device.type == "cuda" and not _interpreting():
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 3  # interpreter: few programs, so that each walks several tiles (persistence tested)


def device_ptr(t: torch.Tensor) -> torch.Tensor:
    """int64 [1] tensor on t.device holding t.data_ptr().

    Built with a fill kernel (no host-to-device copy), so it may also be called during CUDA-graph
    capture; the address is then baked into the graph.
    """
    assert t.data_ptr() % 16 == 0, f"device_ptr: address {t.data_ptr():#x} must be 16-byte aligned"
    return torch.full((1,), t.data_ptr(), dtype=torch.int64, device=t.device)


@dataclass(frozen=True)
class ExpertOutTable:
    """Per-expert output matrices anywhere in memory, for `grouped_mm_wgrad`.

    addrs  int64 [E] device tensor: expert e's row-major M x N matrix of `dtype` starts there
    m, n   each matrix's shape
    tensors the matrices (`of` keeps them, so the addresses stay valid while the table lives)
    Build it with `of(tensors)`, e.g. from Megatron's per-expert fp32 `main_grad` buffers, so the
    WGRAD accumulates into them in place (accumulate=True) instead of storing a stacked copy.
    """
    addrs: torch.Tensor
    m: int
    n: int
    dtype: torch.dtype
    tensors: tuple = ()     # the matrices themselves (kept alive while the table is)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.addrs.numel(), self.m, self.n)

    @property
    def device(self) -> torch.device:
        return self.addrs.device

    @staticmethod
    def of(tensors, name: str = "out") -> "ExpertOutTable":
        """The table of E equally shaped, contiguous, 16-byte aligned tensors on one device.
        The fills below are kernels (no host-to-device copy), so this may run during capture."""
        tensors = list(tensors)
        if not tensors:
            raise ValueError(f"{name}: expected at least one tensor")
        t0 = tensors[0]
        for i, t in enumerate(tensors):
            if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device:
                raise ValueError(f"{name}[{i}]: {tuple(t.shape)} {t.dtype} on {t.device} differs "
                                 f"from {name}[0]: {tuple(t0.shape)} {t0.dtype} on {t0.device}")
            if not t.is_contiguous():
                raise ValueError(f"{name}[{i}]: must be contiguous")
            if t.data_ptr() % 16:
                raise ValueError(f"{name}[{i}]: address {t.data_ptr():#x} is not 16-byte aligned")
        if t0.dim() < 2:
            raise ValueError(f"{name}[0]: expected a matrix, got shape {tuple(t0.shape)}")
        addrs = torch.empty(len(tensors), dtype=torch.int64, device=t0.device)
        for i, t in enumerate(tensors):
            addrs[i].fill_(t.data_ptr())
        return ExpertOutTable(addrs, t0.numel() // t0.shape[-1], t0.shape[-1], t0.dtype,
                              tuple(tensors))


def _ensure_tma_allocator() -> None:
    """Device-side TMA descriptors live in a per-launch global scratch from triton's allocator."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
        if not isinstance(_allocator.get(), NullAllocator):
            return
    except ImportError:  # layout of triton internals changed: set ours unconditionally
        pass

    def _alloc(size: int, alignment: int, stream: Optional[int]):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(_alloc)


# --------------------------------------------------------------------------------------------
# Claim flags
# --------------------------------------------------------------------------------------------
class ClaimFlags:
    """Per-m-tile claim/ready flags of the claim mode; reused by every launch, never reset.

    ready     int64 [capacity], one flag per global m-tile: m-tile i of expert e has index
              sum_{e' < e} cdiv(len_e', BM) + i < cdiv(R, BM) + E <= capacity, where
              capacity = cdiv(max_rows, block_m) + num_experts (block_m: the smallest block_m of
              the configs it will serve; default the smallest one this module uses, 16).
    epoch     int64 [1], advanced on the device by `next_epoch()` (a tensor op: no host sync,
              and a captured CUDA graph advances it on every replay). The launchers call it once
              per launch, just before the kernel.
    In the launch that reads epoch value p: flag == 2p+1 means "claimed" (a program is copying
    that m-tile's rows), 2p+2 "ready" (rows are in a_copy_out); any other value is stale (an
    earlier launch's, or the initial 0), i.e. "not yet copied in this launch". int64, so the
    encoding cannot wrap (2^62 launches) and a stale value can never equal a current one.

    Sliced claims (a slice width > 0, from the config or the module default) use two more int64 [capacity] arrays instead of
    `ready`: `claimed` counts the slices handed out, `copied` the slices whose rows are stored.
    Both hold (p << SLICE_SHIFT) + count in the launch that reads epoch p; a value below
    p << SLICE_SHIFT is stale and counts as 0 (`atomic_max` with the base lifts it first).

    Launches that may run concurrently (different streams) need separate ClaimFlags; launches
    ordered on one stream may share one (e.g. the W13 forward and the W2 DGRAD of every layer).
    """

    SLICE_SHIFT = 20  # counts stay far below 2^20: slices + 2 claims per visiting program

    def __init__(self, max_rows: int, block_m: Optional[int] = None, num_experts: int = 1,
                 device=None):
        block_m = block_m or _MIN_BLOCK_M
        assert max_rows >= 0 and num_experts >= 1 and block_m >= 1
        self.max_rows, self.block_m, self.num_experts = max_rows, block_m, num_experts
        self.capacity = triton.cdiv(max_rows, block_m) + num_experts
        self.ready = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self.claimed = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self.copied = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)

    def next_epoch(self) -> None:
        """Advance the epoch on the device (stream-ordered before the next launch)."""
        self.epoch.add_(1)

    def check(self, *, max_rows: int, block_m: int, num_experts: int, device) -> None:
        need = triton.cdiv(max_rows, block_m) + num_experts
        assert self.capacity >= need, (
            f"ClaimFlags holds {self.capacity} flags, this launch may touch {need} m-tiles "
            f"(max_rows={max_rows}, block_m={block_m}, E={num_experts}): build it with these")
        assert self.ready.device == device and self.epoch.device == device \
            and self.claimed.device == device and self.copied.device == device, (
            "ClaimFlags must live on the weights' device")


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _MMArgs:
    """Validated arguments of one `_grouped_mm_kernel` launch (tensors plus constexprs)."""

    a_addr: torch.Tensor  # int64 [1] (dense A) or a dummy
    a_rows: torch.Tensor  # int64 [>= R] (gathered A) or a dummy
    a_copy_addr: torch.Tensor
    w: torch.Tensor
    offsets: torch.Tensor
    out_addr: torch.Tensor
    out2_addr: torch.Tensor
    out_rows: torch.Tensor
    n: int  # output width per half (F for swiglu)
    kd: int
    num_experts: int
    max_rows: int
    a_gather: bool
    a_copy: bool
    claim: Optional["ClaimFlags"]  # claim mode: A is read densely from a_copy_out (a_addr)
    w_kn: bool  # DGRAD orientation w [E, Kd, N]
    epilogue: int
    store_aux: bool  # swiglu: also store h1 (pre-activation); swiglu_bwd: also store h2
    activation: int
    alpha: float
    limit: float
    score_grads: bool = False  # swiglu_bwd: expert-side score gradients (out_rows = score ptrs)
    score_grad_delta: int = 0


def _as_device_ptr(x: torch.Tensor, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Accept an int64 [1] device pointer, or a dense tensor (converted with `device_ptr`)."""
    if x.dtype == torch.int64 and x.numel() == 1:
        return x
    assert x.is_contiguous(), f"{name}: a dense tensor operand must be contiguous"
    assert dtype is None or x.dtype == dtype, f"{name}: dtype {x.dtype} != compute dtype {dtype}"
    return device_ptr(x)


def _check_offsets(expert_offsets: torch.Tensor, num_experts: int, device: torch.device) -> None:
    assert expert_offsets.dtype == torch.int32, "expert_offsets must be int32 cumulative row ends"
    assert expert_offsets.is_contiguous() and expert_offsets.numel() == num_experts + 1, (
        f"expert_offsets must be contiguous [E+1] = [{num_experts + 1}], got {tuple(expert_offsets.shape)}")
    assert expert_offsets.device == device, "expert_offsets must live on the weights' device"


def _check_rows(t: torch.Tensor, name: str, max_rows: int, device: torch.device) -> None:
    assert t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous(), (
        f"{name}: must be a contiguous int64 [max_rows] table of row addresses")
    assert t.numel() >= max_rows, f"{name}: {t.numel()} entries < max_rows={max_rows}"
    assert t.device == device, f"{name}: must live on the weights' device"


def _prepare(*, w_kn, w, expert_offsets, max_rows, a, a_row_ptrs, a_copy_out, epilogue, out,
             out_row_ptrs, h1, h2, activation, swiglu_alpha, swiglu_limit,
             claim_flags=None, score_ptrs=None, score_grad_delta=0) -> _MMArgs:
    assert w.dim() == 3 and w.is_contiguous(), "w must be a contiguous [E, *, *] tensor"
    dev, dt = w.device, w.dtype
    num_experts = w.shape[0]
    _check_offsets(expert_offsets, num_experts, dev)
    assert epilogue in EPILOGUES, f"epilogue must be one of {EPILOGUES}, got {epilogue!r}"
    assert activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {activation!r}"
    assert max_rows >= 0, "max_rows is a host upper bound on R"
    assert (a is None) != (a_row_ptrs is None), "give exactly one of a (dense) and a_row_ptrs (gather)"
    if w_kn:
        kd, n = w.shape[1], w.shape[2]
        assert epilogue != "swiglu", "the swiglu epilogue is an FPROP (W13) epilogue"
    elif epilogue == "swiglu":
        assert w.shape[1] % 2 == 0, "swiglu: w must be W13 [E, 2F, D]"
        kd, n = w.shape[2], w.shape[1] // 2
    else:
        kd, n = w.shape[2], w.shape[1]
    assert kd % 16 == 0 and n % 8 == 0, f"Kd={kd} must be a multiple of 16 and N={n} of 8"

    dummy = expert_offsets  # never dereferenced when its constexpr path is off
    a_addr = _as_device_ptr(a, "a", dt) if a is not None else dummy
    if a_row_ptrs is not None:
        _check_rows(a_row_ptrs, "a_row_ptrs", max_rows, dev)
    a_copy_addr = _as_device_ptr(a_copy_out, "a_copy_out", dt) if a_copy_out is not None else dummy
    if claim_flags is not None:
        assert isinstance(claim_flags, ClaimFlags), "claim_flags must be a ClaimFlags"
        assert a_row_ptrs is not None and a_copy_out is not None, (
            "claim mode needs a_row_ptrs (rows to gather) and a_copy_out (where they land; the "
            "GEMM then reads A from there)")
        a_addr = a_copy_addr  # the K loop reads the claimed copy as a dense A

    out_addr = out2_addr = out_rows = dummy
    store_aux = False
    if epilogue == "store":
        assert out is not None, "epilogue='store' needs out (device pointer to [R, N])"
        out_addr = _as_device_ptr(out, "out", dt)
    elif epilogue == "swiglu":
        assert h2 is not None, "epilogue='swiglu' needs h2 (device pointer to [R, F])"
        out2_addr = _as_device_ptr(h2, "h2", dt)
        if h1 is not None:
            out_addr, store_aux = _as_device_ptr(h1, "h1", dt), True
    elif epilogue == "swiglu_bwd":
        assert w_kn, "the swiglu_bwd epilogue is a W2 DGRAD epilogue"
        assert h1 is not None, "epilogue='swiglu_bwd' needs h1 (device pointer to [R, 2F])"
        out_addr = _as_device_ptr(h1, "h1", dt)
        if h2 is not None:  # also rebuild h2 = act(h1) for the W2 WGRAD
            out2_addr, store_aux = _as_device_ptr(h2, "h2", dt), True
        if score_ptrs is not None:
            _check_rows(score_ptrs, "score_ptrs", max_rows, dev)
            out_rows = score_ptrs
    else:
        assert out_row_ptrs is not None, "epilogue='scatter' needs out_row_ptrs"
    assert score_ptrs is None or epilogue == "swiglu_bwd", (
        "score_ptrs (expert-side score gradients) go with epilogue='swiglu_bwd' only")
    if epilogue == "scatter":
        _check_rows(out_row_ptrs, "out_row_ptrs", max_rows, dev)
        out_rows = out_row_ptrs
    return _MMArgs(
        a_addr=a_addr, a_rows=a_row_ptrs if a_row_ptrs is not None else dummy,
        a_copy_addr=a_copy_addr, w=w, offsets=expert_offsets, out_addr=out_addr,
        out2_addr=out2_addr, out_rows=out_rows, n=n, kd=kd, num_experts=num_experts,
        max_rows=max_rows, a_gather=a_row_ptrs is not None and claim_flags is None,
        a_copy=a_copy_out is not None and claim_flags is None, claim=claim_flags, w_kn=w_kn,
        epilogue=EPILOGUES.index(epilogue), store_aux=store_aux,
        activation=ACTIVATIONS.index(activation), alpha=float(swiglu_alpha),
        limit=float(swiglu_limit), score_grads=score_ptrs is not None,
        score_grad_delta=int(score_grad_delta))


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _load_ptr(addr_ptr, DT: tl.constexpr):
    """Typed pointer from a device pointer (int64 [1] holding a 16-byte aligned address)."""
    # NOTE: the hint must sit on the int->ptr cast: axis analysis drops hints placed on a load's
    # result. Without it, operand loads are 2-byte scalars that the pipeliner will not turn into
    # cp.async, and stores are not vectorized (checked in the sm_90 PTX).
    return tl.multiple_of(tl.load(addr_ptr).to(tl.pointer_type(DT)), 16)


@triton.jit
def _swizzle(local, num_m, num_n, GROUP_M: tl.constexpr):
    """Group-M order inside one expert: GROUP_M m-tiles share each weight n-tile in L2."""
    width = GROUP_M * num_n
    group = local // width
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (local % width) % group_size
    pid_n = (local % width) // group_size
    return pid_m, pid_n


@triton.jit
def _tile_coords(t, e_idx, cum, tiles, starts, ends, m_tiles, num_n, GROUP_M: tl.constexpr):
    """(expert, its first row, its row end, first m-tile index of the expert, pid_m, pid_n) of
    tile t of the device tile list (expert e owns tiles [cum[e] - tiles[e], cum[e]))."""
    e = tl.sum((cum <= t).to(tl.int32), 0)
    sel = e_idx == e
    local = t - tl.sum(tl.where(sel, cum - tiles, 0), 0)
    row_start = tl.sum(tl.where(sel, starts, 0), 0)
    row_end = tl.sum(tl.where(sel, ends, 0), 0)
    num_m = tl.sum(tl.where(sel, m_tiles, 0), 0)
    m_first = tl.sum(tl.where(sel, tl.cumsum(m_tiles, 0) - m_tiles, 0), 0)
    pid_m, pid_n = _swizzle(local, num_m, num_n, GROUP_M)
    return e, row_start, row_end, m_first, pid_m, pid_n


@triton.jit
def _fence_proxy_async():
    """fence.proxy.async.global in every thread: orders this thread's generic-proxy global
    accesses with its async-proxy (TMA) ones (see the NOTE in `_claim_phase`)."""
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _try_claim(flag_ptr, claimed_v, ready_v):
    """Claim the m-tile of `flag_ptr` if it is stale. Returns (won, state): won -> this program
    must copy the rows and then `_publish`; else state is claimed_v or ready_v.

    In one launch a flag only moves stale -> claimed_v (a CAS from the exact stale value it
    read) -> ready_v (the claimer's release), so one CAS decides: exactly one program sees its
    CAS succeed, and a failed CAS returns claimed_v or ready_v. Scalar atomics run in one thread
    and broadcast their result to the CTA, so every thread takes the same branch."""
    state = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    stale = (state != claimed_v) & (state != ready_v)
    prev = state
    if stale:
        prev = tl.atomic_cas(flag_ptr, state, claimed_v, sem="acq_rel", scope="gpu")
    won = stale & (prev == state)
    state = tl.where(won, claimed_v, prev)
    return won, state


@triton.jit
def _copy_mtile(a_rows_ptr, dst_base, row0, row_end, Kd, DT: tl.constexpr,
                BLOCK_M: tl.constexpr, COPY_K: tl.constexpr):
    """dst[r, :] = row at address a_rows[r] (zeros for address 0) for r in [row0, min(row0 +
    BLOCK_M, row_end)); the whole Kd width (a multiple of COPY_K), 16-byte vectors."""
    _copy_mtile_cols(a_rows_ptr, dst_base, row0, row_end, Kd, 0, Kd, DT, BLOCK_M, COPY_K)


@triton.jit
def _copy_mtile_cols(a_rows_ptr, dst_base, row0, row_end, Kd, col0, width, DT: tl.constexpr,
                     BLOCK_M: tl.constexpr, COPY_K: tl.constexpr):
    """`_copy_mtile` restricted to columns [col0, col0 + width) (both multiples of COPY_K)."""
    rows = row0 + tl.arange(0, BLOCK_M)
    ok = rows < row_end
    src = tl.load(a_rows_ptr + rows, mask=ok, other=0)
    load_ok = (ok & (src != 0))[:, None]
    cols = col0 + tl.arange(0, COPY_K)
    src_ptrs = tl.multiple_of(src.to(tl.pointer_type(DT)), [16])[:, None] + cols[None, :]
    dst_ptrs = dst_base + rows.to(tl.int64)[:, None] * Kd + cols[None, :]
    # num_stages=1: a plain register copy; pipelining it would stage it through shared memory,
    # which the GEMM's own stages already fill.
    for _k in tl.range(0, width, COPY_K, num_stages=1):
        v = tl.load(src_ptrs, mask=load_ok, other=0.0)
        tl.store(dst_ptrs, v, mask=ok[:, None])
        src_ptrs += COPY_K
        dst_ptrs += COPY_K


@triton.jit
def _publish(flag_ptr, ready_v, PROXY_FENCE: tl.constexpr):
    """Release the copied rows: every thread's stores, then one release store of ready_v."""
    if PROXY_FENCE:
        _fence_proxy_async()  # generic-proxy row stores -> visible to later TMA (async) reads
    tl.debug_barrier()  # all threads' stores precede (CTA barrier) the release below
    tl.atomic_xchg(flag_ptr, ready_v, sem="release", scope="gpu")


@triton.jit
def _claim_phase(t, nprog, total, e_idx, cum, tiles, starts, ends, m_tiles, num_n,
                 row0, row_end, flag_ptr, ready_ptr, claimed_v, ready_v, a_rows_ptr, a_copy_base,
                 Kd, DT: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
                 COPY_K: tl.constexpr, CLAIM_AHEAD: tl.constexpr, PROXY_FENCE: tl.constexpr):
    """Make rows [row0, row0 + BLOCK_M) of a_copy_out valid before tile t reads them.

    1. try to claim this tile's m-tile; the winner copies it and publishes it;
    2. (CLAIM_AHEAD > 0) try to claim the m-tile of tile t + CLAIM_AHEAD * nprog (this
       program's tile CLAIM_AHEAD iterations later) and copy it, so copies run ahead of use
       and a program whose m-tile is being copied by another does useful work meanwhile;
    3. spin (acquire) until this tile's m-tile is ready.

    NOTE deadlock freedom: a program waits only in step 3, after publishing every claim it
    made (a claim never spans a wait), and it waits for a flag in state claimed_v, i.e. for a
    program that won that CAS, so is already running, and is inside `_copy_mtile` + `_publish`,
    which wait for nothing (loads, stores, a barrier of its own CTA). So every wait ends, for
    any grid size, without assuming that all programs are co-resident. In the CPU interpreter,
    programs run one after another: each finishes (publishing all its claims) before the next
    starts, so step 3 always finds ready_v and never spins.

    NOTE memory ordering. Writer: row stores (all threads) -> [fence.proxy.async.global, all
    threads] -> bar.sync -> atom.release.gpu (one thread). Reader: atom.acquire.gpu (one thread;
    Triton broadcasts scalar atomics through shared memory + bar.sync) -> [fence.proxy.async.
    global, all threads] -> A loads. The bar.sync's synchronize-with within the CTA and the
    release/acquire pair across CTAs chain into causality order (PTX memory model), so the
    reader's generic loads (cp.async / ld) see the rows. TMA loads are async-proxy accesses,
    which causality order does not cover: the writer's proxy fence makes its generic stores
    visible to the async proxy before the release, the reader's orders its acquire before its
    TMA loads (a proxy fence on each side of the generic -> async hand-off; with only one side
    fenced the PTX model does not order the two). The fences cost one instruction per copy /
    per tile; PROXY_FENCE = USE_TMA (off in the interpreter, which has no inline asm). Plain
    loads cannot hit a stale L1 line: the pipelined 16-byte A loads are cp.async.cg (L2 only),
    and the gpu-scope acquire orders them after the rows in any case. Checked in the sm_90 PTX:
    ld.acquire.gpu / atom.acq_rel.gpu.cas / copy / fence.proxy.async.global / bar.sync /
    atom.release.gpu.exch, then the wait loop and the reader's fence before the TMA prologue.
    TMA tiles may overhang row_end into the next expert's rows, which may be mid-copy: those
    rows only feed accumulator rows that the epilogue masks off.
    """
    won, state = _try_claim(flag_ptr, claimed_v, ready_v)
    if won:
        _copy_mtile(a_rows_ptr, a_copy_base, row0, row_end, Kd, DT, BLOCK_M, COPY_K)
        _publish(flag_ptr, ready_v, PROXY_FENCE)
        state = ready_v
    if CLAIM_AHEAD > 0:
        t2 = t + CLAIM_AHEAD * nprog
        if t2 < total:
            _e2, row_start2, row_end2, m_first2, pid_m2, _n2 = _tile_coords(
                t2, e_idx, cum, tiles, starts, ends, m_tiles, num_n, GROUP_M)
            flag2 = ready_ptr + m_first2 + pid_m2
            won2, _s2 = _try_claim(flag2, claimed_v, ready_v)
            if won2:
                _copy_mtile(a_rows_ptr, a_copy_base, row_start2 + pid_m2 * BLOCK_M, row_end2,
                            Kd, DT, BLOCK_M, COPY_K)
                _publish(flag2, ready_v, PROXY_FENCE)
    while state != ready_v:
        state = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    if PROXY_FENCE:
        _fence_proxy_async()  # the acquire above, before this tile's TMA reads of the rows


@triton.jit
def _claim_slice(claimed_ptr, base, num_slices):
    """Hand out the next slice of an m-tile: its index, or >= num_slices when none is left.
    atomic_max lifts a stale counter to this launch's base (count 0) and leaves a current one
    alone; the add then hands out distinct counts. Counts past num_slices are harmless."""
    tl.atomic_max(claimed_ptr, base, sem="relaxed", scope="gpu")
    return tl.atomic_add(claimed_ptr, 1, sem="relaxed", scope="gpu") - base


@triton.jit
def _count_copied(copied_ptr, base, PROXY_FENCE: tl.constexpr):
    """Release one copied slice: every thread's row stores, then one release increment."""
    if PROXY_FENCE:
        _fence_proxy_async()
    tl.debug_barrier()
    tl.atomic_max(copied_ptr, base, sem="relaxed", scope="gpu")
    tl.atomic_add(copied_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _copy_claimed_slices(claimed_ptr, copied_ptr, base, num_slices, max_slices, a_rows_ptr,
                         a_copy_base, row0, row_end, Kd, SLICE_K: tl.constexpr, DT: tl.constexpr,
                         BLOCK_M: tl.constexpr, COPY_K: tl.constexpr,
                         PROXY_FENCE: tl.constexpr):
    """Claim and copy up to max_slices slices of one m-tile; stops early when none is left."""
    n = 0
    c = _claim_slice(claimed_ptr, base, num_slices)
    while c < num_slices:
        _copy_mtile_cols(a_rows_ptr, a_copy_base, row0, row_end, Kd, c * SLICE_K, SLICE_K, DT,
                         BLOCK_M, COPY_K)
        _count_copied(copied_ptr, base, PROXY_FENCE)
        n += 1
        if n < max_slices:
            c = _claim_slice(claimed_ptr, base, num_slices)
        else:
            c = c - c + num_slices  # stop (same dtype as the claimed index)


@triton.jit
def _claim_slices_phase(t, nprog, total, e_idx, cum, tiles, starts, ends, m_tiles, num_n,
                        row0, row_end, m_index, claimed_ptr, copied_ptr, base, a_rows_ptr,
                        a_copy_base, Kd, DT: tl.constexpr, BLOCK_M: tl.constexpr,
                        GROUP_M: tl.constexpr, COPY_K: tl.constexpr, SLICE_K: tl.constexpr,
                        CLAIM_AHEAD: tl.constexpr, AHEAD_SLICES: tl.constexpr,
                        PROXY_FENCE: tl.constexpr):
    """Sliced claims: make rows [row0, row0 + BLOCK_M) of a_copy_out valid before tile t.

    The m-tile is cut into S = Kd / SLICE_K column slices. Every program that reaches it
    1. (CLAIM_AHEAD > 0) claims and copies up to AHEAD_SLICES slices of the m-tile of its tile
       CLAIM_AHEAD iterations later: the programs that will read that m-tile share its copy,
       a few slices each, a wave before they need it;
    2. claims and copies slices of its own m-tile until none is left (helping any straggler);
    3. spins (acquire) until all S slices are counted as copied.

    NOTE deadlock freedom as in `_claim_phase`: a program waits only in step 3, after every
    slice it claimed is copied and counted, and only once every slice of that m-tile has been
    claimed, i.e. is being copied by a running program that waits for nothing. In the CPU
    interpreter a program copies every slice that nobody copied before it and never spins.
    Memory ordering as in `_claim_phase`, with the release increment of `copied` in place of
    the release store of the ready flag.
    """
    num_slices = Kd // SLICE_K
    if CLAIM_AHEAD > 0:
        t2 = t + CLAIM_AHEAD * nprog
        if t2 < total:
            _e2, row_start2, row_end2, m_first2, pid_m2, _n2 = _tile_coords(
                t2, e_idx, cum, tiles, starts, ends, m_tiles, num_n, GROUP_M)
            m2 = m_first2 + pid_m2
            _copy_claimed_slices(claimed_ptr + m2, copied_ptr + m2, base, num_slices,
                                 AHEAD_SLICES, a_rows_ptr, a_copy_base,
                                 row_start2 + pid_m2 * BLOCK_M, row_end2, Kd, SLICE_K, DT,
                                 BLOCK_M, COPY_K, PROXY_FENCE)
    _copy_claimed_slices(claimed_ptr + m_index, copied_ptr + m_index, base, num_slices,
                         num_slices, a_rows_ptr, a_copy_base, row0, row_end, Kd, SLICE_K, DT,
                         BLOCK_M, COPY_K, PROXY_FENCE)
    done = tl.atomic_add(copied_ptr + m_index, 0, sem="acquire", scope="gpu")
    while done < base + num_slices:
        done = tl.atomic_add(copied_ptr + m_index, 0, sem="acquire", scope="gpu")
    if PROXY_FENCE:
        _fence_proxy_async()  # the acquire above, before this tile's TMA reads of the rows


@triton.jit
def _swiglu_bwd_tile(dh, rows64, row_ok, cols, h1_base, h2_addr_ptr, N, alpha, limit,
                     DT: tl.constexpr, CLAMPED: tl.constexpr, STORE_H2: tl.constexpr):
    """grad_h1 = [dg | du] over h1 = [g | u] in place for one column block of a grad_h2 tile
    (dh, already rounded to DT); optionally h2 = act(g, u) too (`rows.swiglu_grad` math)."""
    mask = row_ok[:, None] & (cols < N)[None, :]
    g_ptrs = h1_base + rows64[:, None] * (2 * N) + cols[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + N, mask=mask, other=0.0).to(tl.float32)
    dg, du, h2v = swiglu_grad(g, u, dh.to(tl.float32), CLAMPED, alpha, limit)
    tl.store(g_ptrs, dg.to(DT), mask=mask)
    tl.store(g_ptrs + N, du.to(DT), mask=mask)
    if STORE_H2:  # the same bits as rows.swiglu_fwd
        h2_base = _load_ptr(h2_addr_ptr, DT)
        tl.store(h2_base + rows64[:, None] * N + cols[None, :], h2v.to(DT), mask=mask)


@triton.jit
def _swiglu_bwd_tile_scored(gu, s, rows64, row_ok, cols, h1_base, h2_addr_ptr, N, alpha, limit,
                            DT: tl.constexpr, CLAMPED: tl.constexpr, STORE_H2: tl.constexpr):
    """Expert-side score gradients (Config.save_route_outputs=False) for one column block of
    u = W2^T grad_y (fp32, unscaled): grad_h2 = s u (rounded to DT) goes through the SwiGLU
    backward in place over h1 as in `_swiglu_bwd_tile`; h2 is stored scaled (s h2, the W2
    WGRAD operand against the unscaled grad_y rows). Returns this block's <u, h2> per row."""
    mask = row_ok[:, None] & (cols < N)[None, :]
    g_ptrs = h1_base + rows64[:, None] * (2 * N) + cols[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + N, mask=mask, other=0.0).to(tl.float32)
    dh = (s[:, None] * gu).to(DT).to(tl.float32)
    dg, du, h2v = swiglu_grad(g, u, dh, CLAMPED, alpha, limit)
    tl.store(g_ptrs, dg.to(DT), mask=mask)
    tl.store(g_ptrs + N, du.to(DT), mask=mask)
    if STORE_H2:
        h2_base = _load_ptr(h2_addr_ptr, DT)
        tl.store(h2_base + rows64[:, None] * N + cols[None, :], (s[:, None] * h2v).to(DT),
                 mask=mask)
    return tl.sum(tl.where(mask, gu * h2v.to(DT).to(tl.float32), 0.0), axis=1)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # fp32 operands, or the CPU interpreter: exact fp32 products, no tf32 rounding
        # NOTE: the interpreter's bf16 dot returns garbage; bf16 (and fp16) operands are widened
        # to fp32 first there, which is exactly the products the tensor cores form.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _grouped_mm_kernel(
    a_addr_ptr, a_rows_ptr, a_copy_addr_ptr, w_ptr, offsets_ptr,
    out_addr_ptr, out2_addr_ptr, out_rows_ptr, ready_ptr, epoch_ptr, claimed_ptr, copied_ptr,
    N, Kd, alpha, limit, score_grad_delta,
    E: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_GATHER: tl.constexpr, A_COPY: tl.constexpr, W_KN: tl.constexpr, EPILOGUE: tl.constexpr,
    STORE_AUX: tl.constexpr, ACT: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr,
    COPY_RELOAD: tl.constexpr = False,
    A_CLAIM: tl.constexpr = False, CLAIM_AHEAD: tl.constexpr = 0, COPY_K: tl.constexpr = 64,
    PROXY_FENCE: tl.constexpr = False, SLICE_K: tl.constexpr = 0,
    AHEAD_SLICES: tl.constexpr = 1, SCORE_GRADS: tl.constexpr = False,
    FLATTEN: tl.constexpr = False, PDL: tl.constexpr = False):
    grid_dependency_wait(PDL)   # first: no memory access before it (launch.py)
    # A_CLAIM: a_addr_ptr is a_copy_out, read as a dense A once `_claim_phase` made the tile's
    # rows valid; a_rows_ptr gives the rows to copy there; ready_ptr/epoch_ptr: `ClaimFlags`.
    DT: tl.constexpr = w_ptr.dtype.element_ty
    SWIGLU: tl.constexpr = EPILOGUE == 1
    BN: tl.constexpr = BLOCK_N // 2 if SWIGLU else BLOCK_N  # width of each accumulator
    W_ROWS = 2 * N if SWIGLU else N  # FPROP: rows of w[e]
    pid = tl.program_id(0)

    # Tile list from the device offsets: expert e owns tiles [cum[e] - tiles[e], cum[e]).
    e_idx = tl.arange(0, E_PAD)
    starts = tl.load(offsets_ptr + e_idx, mask=e_idx < E, other=0)
    ends = tl.load(offsets_ptr + e_idx + 1, mask=e_idx < E, other=0)
    num_n = tl.cdiv(N, BN)
    m_tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tiles = m_tiles * num_n
    cum = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, 0)
    offs_k = tl.arange(0, BLOCK_K)
    nprog = tl.num_programs(0)
    if A_CLAIM:
        epoch = tl.load(epoch_ptr)
        claimed_v = 2 * epoch + 1
        ready_v = 2 * epoch + 2
        slice_base = epoch << 20  # ClaimFlags.SLICE_SHIFT

    if not A_GATHER:
        a_base = _load_ptr(a_addr_ptr, DT)
        if USE_TMA:
            num_rows = tl.maximum(tl.load(offsets_ptr + E), 1)
            a_desc = tl.make_tensor_descriptor(a_base, shape=[num_rows, Kd], strides=[Kd, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
    if A_COPY:
        a_copy_base = _load_ptr(a_copy_addr_ptr, DT)
    if USE_TMA:
        if W_KN:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * Kd, N], strides=[N, 1],
                                               block_shape=[BLOCK_K, BN])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * W_ROWS, Kd], strides=[Kd, 1],
                                               block_shape=[BN, BLOCK_K])

    for t in tl.range(pid, total, nprog, flatten=FLATTEN):
        e, row_start, row_end, m_first, pid_m, pid_n = _tile_coords(
            t, e_idx, cum, tiles, starts, ends, m_tiles, num_n, GROUP_M)

        row0 = row_start + pid_m * BLOCK_M
        if A_CLAIM:
            if SLICE_K > 0:
                _claim_slices_phase(t, nprog, total, e_idx, cum, tiles, starts, ends, m_tiles,
                                    num_n, row0, row_end, m_first + pid_m, claimed_ptr,
                                    copied_ptr, slice_base, a_rows_ptr, a_base, Kd, DT, BLOCK_M,
                                    GROUP_M, COPY_K, SLICE_K, CLAIM_AHEAD, AHEAD_SLICES,
                                    PROXY_FENCE)
            else:
                _claim_phase(t, nprog, total, e_idx, cum, tiles, starts, ends, m_tiles, num_n,
                             row0, row_end, ready_ptr + m_first + pid_m, ready_ptr, claimed_v,
                             ready_v, a_rows_ptr, a_base, Kd, DT, BLOCK_M, GROUP_M, COPY_K,
                             CLAIM_AHEAD, PROXY_FENCE)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        cols = pid_n * BN + tl.arange(0, BN)
        col_ok = cols < N
        # NOTE: clamped indices keep dense-A and FPROP weight loads in bounds without masks (the
        # extra rows/cols compute values that the epilogue never stores). Clamping breaks
        # contiguity, so it is only used along non-contiguous dims; DGRAD weights use a mask.
        cols_ld = tl.minimum(cols, N - 1)

        if A_GATHER:
            a_addr = tl.load(a_rows_ptr + rows, mask=row_ok, other=0)
            a_ok = a_addr != 0
            a_row_base = tl.multiple_of(a_addr.to(tl.pointer_type(DT)), [16])
            a_ptrs = a_row_base[:, None] + offs_k[None, :]
        elif not USE_TMA:
            rows_ld = tl.minimum(rows, row_end - 1).to(tl.int64)
            a_ptrs = a_base + rows_ld[:, None] * Kd + offs_k[None, :]
        if A_COPY:
            copy_ptrs = a_copy_base + rows.to(tl.int64)[:, None] * Kd + offs_k[None, :]
            copy_mask = row_ok[:, None] & (pid_n == 0)

        w_e = w_ptr + e.to(tl.int64) * W_ROWS * Kd
        if W_KN:  # w[e] is [Kd, N], contiguous along N
            b_ptrs = w_e + offs_k[:, None] * N + cols[None, :]
        else:  # w[e] is [W_ROWS, Kd], contiguous along Kd; tile loaded as [BLOCK_K, BN]
            b_ptrs = w_e + cols_ld[None, :].to(tl.int64) * Kd + offs_k[:, None]
            if SWIGLU:
                b2_ptrs = b_ptrs + N * Kd  # the up half: rows F + n

        acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
        if SWIGLU:
            acc2 = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
        for k in tl.range(0, Kd, BLOCK_K):
            if A_GATHER:
                a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
                a_ptrs += BLOCK_K
            elif USE_TMA:
                a = a_desc.load([row0, k])
            else:
                a = tl.load(a_ptrs)
                a_ptrs += BLOCK_K
            if A_COPY:
                if COPY_RELOAD and A_GATHER:
                    # NOTE: a separate load (an L2 hit) feeds the copy, so the tile feeding the
                    # dot is not also consumed from registers inside the pipelined loop.
                    a_c = tl.load(a_ptrs - BLOCK_K, mask=copy_mask & a_ok[:, None], other=0.0)
                    tl.store(copy_ptrs, a_c, mask=copy_mask)
                else:
                    tl.store(copy_ptrs, a, mask=copy_mask)
                copy_ptrs += BLOCK_K
            if USE_TMA:
                if W_KN:
                    b = w_desc.load([e * Kd + k, pid_n * BN])
                else:
                    b = w_desc.load([e * W_ROWS + pid_n * BN, k]).T
                    if SWIGLU:
                        b2 = w_desc.load([e * W_ROWS + N + pid_n * BN, k]).T
            elif W_KN:
                b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
                b_ptrs += BLOCK_K * N
            else:
                b = tl.load(b_ptrs)
                b_ptrs += BLOCK_K
                if SWIGLU:
                    b2 = tl.load(b2_ptrs)
                    b2_ptrs += BLOCK_K
            acc = _dot(a, b, acc, IEEE)
            if SWIGLU:
                acc2 = _dot(a, b2, acc2, IEEE)

        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        if EPILOGUE == 0:  # dense store, row stride N
            out_base = _load_ptr(out_addr_ptr, DT)
            tl.store(out_base + rows64[:, None] * N + cols[None, :], acc.to(DT), mask=mask)
        elif EPILOGUE == 1:  # h1 [R, 2F] (gate | up), h2 [R, F]
            g = acc.to(DT)
            u = acc2.to(DT)
            if STORE_AUX:
                h1_ptrs = (_load_ptr(out_addr_ptr, DT)
                           + rows64[:, None] * (2 * N) + cols[None, :])
                tl.store(h1_ptrs, g, mask=mask)
                tl.store(h1_ptrs + N, u, mask=mask)
            # NOTE: the activation reads the rounded h1, exactly what backward will reload.
            gf = g.to(tl.float32)
            uf = u.to(tl.float32)
            if ACT == 0:
                h = gf * tl.sigmoid(gf) * uf
            else:
                gf = tl.minimum(gf, limit)
                uf = tl.minimum(tl.maximum(uf, -limit), limit)
                h = gf * tl.sigmoid(alpha * gf) * (uf + 1.0)
            h2_base = _load_ptr(out2_addr_ptr, DT)
            tl.store(h2_base + rows64[:, None] * N + cols[None, :], h.to(DT), mask=mask)
        elif EPILOGUE == 3 and SCORE_GRADS:
            # W2 DGRAD with expert-side score gradients: acc is u = W2^T grad_y (unscaled);
            # out_rows_ptr holds each row's address of its owner's score, the score gradient
            # slot is score_grad_delta bytes further (one fp32 atomic per row per N tile)
            Q: tl.constexpr = BN // 4
            s_addr = tl.load(out_rows_ptr + rows, mask=row_ok, other=0)
            s_ok = row_ok & (s_addr != 0)
            s = tl.load(s_addr.to(tl.pointer_type(tl.float32)), mask=s_ok, other=0.0)
            gu = tl.reshape(acc, (BLOCK_M, 2, 2, Q))
            gu_lo, gu_hi = tl.split(tl.permute(gu, (0, 2, 3, 1)))
            gu_0, gu_1 = tl.split(tl.permute(gu_lo, (0, 2, 1)))
            gu_2, gu_3 = tl.split(tl.permute(gu_hi, (0, 2, 1)))
            h1_base = _load_ptr(out_addr_ptr, DT)
            c0 = pid_n * BN + tl.arange(0, Q)
            part = _swiglu_bwd_tile_scored(gu_0, s, rows64, row_ok, c0, h1_base, out2_addr_ptr,
                                           N, alpha, limit, DT, ACT == 1, STORE_AUX)
            part += _swiglu_bwd_tile_scored(gu_1, s, rows64, row_ok, c0 + Q, h1_base,
                                            out2_addr_ptr, N, alpha, limit, DT, ACT == 1,
                                            STORE_AUX)
            part += _swiglu_bwd_tile_scored(gu_2, s, rows64, row_ok, c0 + 2 * Q, h1_base,
                                            out2_addr_ptr, N, alpha, limit, DT, ACT == 1,
                                            STORE_AUX)
            part += _swiglu_bwd_tile_scored(gu_3, s, rows64, row_ok, c0 + 3 * Q, h1_base,
                                            out2_addr_ptr, N, alpha, limit, DT, ACT == 1,
                                            STORE_AUX)
            tl.atomic_add((s_addr + score_grad_delta).to(tl.pointer_type(tl.float32)), part,
                          mask=s_ok, sem="relaxed")
        elif EPILOGUE == 3:  # W2 DGRAD + SwiGLU backward: h1 [R, 2F] -> grad_h1, in place
            # NOTE: acc is grad_h2; it is rounded to the dtype first, exactly what the unfused
            # path stores and `rows.swiglu_bwd` reloads, so both paths give the same bits. Each
            # h1 element is read and overwritten by the one program that owns its tile. The
            # tile is processed in two column halves: a whole 128x256 tile's g, u, dg, du (fp32)
            # do not fit in registers next to each other (ptxas: ~6.5 KB of spills).
            Q: tl.constexpr = BN // 4
            dh = tl.reshape(acc.to(DT), (BLOCK_M, 2, 2, Q))
            dh_lo, dh_hi = tl.split(tl.permute(dh, (0, 2, 3, 1)))     # column halves
            dh_0, dh_1 = tl.split(tl.permute(dh_lo, (0, 2, 1)))      # quarters of each
            dh_2, dh_3 = tl.split(tl.permute(dh_hi, (0, 2, 1)))
            h1_base = _load_ptr(out_addr_ptr, DT)
            c0 = pid_n * BN + tl.arange(0, Q)
            _swiglu_bwd_tile(dh_0, rows64, row_ok, c0, h1_base, out2_addr_ptr, N, alpha, limit,
                             DT, ACT == 1, STORE_AUX)
            _swiglu_bwd_tile(dh_1, rows64, row_ok, c0 + Q, h1_base, out2_addr_ptr, N, alpha,
                             limit, DT, ACT == 1, STORE_AUX)
            _swiglu_bwd_tile(dh_2, rows64, row_ok, c0 + 2 * Q, h1_base, out2_addr_ptr, N, alpha,
                             limit, DT, ACT == 1, STORE_AUX)
            _swiglu_bwd_tile(dh_3, rows64, row_ok, c0 + 3 * Q, h1_base, out2_addr_ptr, N, alpha,
                             limit, DT, ACT == 1, STORE_AUX)
        else:  # scatter: row i to address out_rows[i], skipped when 0
            o_addr = tl.load(out_rows_ptr + rows, mask=row_ok, other=0)
            o_row_base = tl.multiple_of(o_addr.to(tl.pointer_type(DT)), [16])
            o_ptrs = o_row_base[:, None] + cols[None, :]
            tl.store(o_ptrs, acc.to(DT), mask=(o_addr != 0)[:, None] & col_ok[None, :])


@triton.jit
def _grouped_mm_wgrad_kernel(
    a_addr_ptr, b_addr_ptr, offsets_ptr, out_ptr, M, N,
    E: tl.constexpr, IN_DT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr,
    OUT_TABLE: tl.constexpr, OUT_DT: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_wait(PDL)   # first: no memory access before it (launch.py)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_expert = num_m * num_n
    e = pid // per_expert
    pid_m, pid_n = _swizzle(pid % per_expert, num_m, num_n, GROUP_M)
    row_start = tl.load(offsets_ptr + e)
    row_end = tl.load(offsets_ptr + e + 1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_base = _load_ptr(a_addr_ptr, IN_DT)
    b_base = _load_ptr(b_addr_ptr, IN_DT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        # Descriptors over this expert's rows only: TMA zero-fills the ragged tail.
        num_rows = tl.maximum(row_end - row_start, 1)
        a_desc = tl.make_tensor_descriptor(a_base + row_start.to(tl.int64) * M, shape=[num_rows, M],
                                           strides=[M, 1], block_shape=[BLOCK_K, BLOCK_M])
        b_desc = tl.make_tensor_descriptor(b_base + row_start.to(tl.int64) * N, shape=[num_rows, N],
                                           strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
        for r in tl.range(0, row_end - row_start, BLOCK_K):
            a = a_desc.load([r, pid_m * BLOCK_M])
            b = b_desc.load([r, pid_n * BLOCK_N])
            acc = _dot(a.T, b, acc, IEEE)
    else:
        # NOTE: masks, not clamped indices, along M and N: those are the contiguous dims.
        m_ok = offs_m < M
        n_ok = offs_n < N
        rk = row_start + tl.arange(0, BLOCK_K)
        a_ptrs = a_base + rk.to(tl.int64)[:, None] * M + offs_m[None, :]
        b_ptrs = b_base + rk.to(tl.int64)[:, None] * N + offs_n[None, :]
        for r in tl.range(row_start, row_end, BLOCK_K):
            r_ok = (r + tl.arange(0, BLOCK_K)) < row_end
            a = tl.load(a_ptrs, mask=r_ok[:, None] & m_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            acc = _dot(a.T, b, acc, IEEE)
            a_ptrs += BLOCK_K * M
            b_ptrs += BLOCK_K * N

    _store_wgrad_tile(acc, out_ptr, e, offs_m, pid_n * BLOCK_N, M, N, row_start, row_end,
                      ACCUMULATE, OUT_TABLE, OUT_DT, BLOCK_N)


@triton.jit
def _store_wgrad_tile(acc, out_ptr, e, offs_m, col0, M, N, row_start, row_end,
                      ACCUMULATE: tl.constexpr, OUT_TABLE: tl.constexpr, OUT_DT: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """out[e][:, col0:col0+BLOCK_N] tile (+)= acc; with ACCUMULATE an empty expert leaves out[e]
    untouched. OUT_TABLE: out_ptr is an int64 [E] table of each expert's M x N matrix address."""
    if OUT_TABLE:
        base = tl.multiple_of(tl.load(out_ptr + e).to(tl.pointer_type(OUT_DT)), 16)
    else:
        base = out_ptr + e.to(tl.int64) * M * N
    row_ptrs = base + offs_m.to(tl.int64)[:, None] * N
    m_ok = offs_m < M
    if ACCUMULATE:
        # In column quarters: a 128x256 fp32 tile and the values it adds to do not fit in
        # registers side by side (ptxas: 420 B of spills). Same sums, same bits.
        Q: tl.constexpr = BLOCK_N // 4
        live = row_end > row_start
        parts = tl.reshape(acc, (acc.shape[0], 2, 2, Q))
        p_lo, p_hi = tl.split(tl.permute(parts, (0, 2, 3, 1)))
        p0, p1 = tl.split(tl.permute(p_lo, (0, 2, 1)))
        p2, p3 = tl.split(tl.permute(p_hi, (0, 2, 1)))
        c = col0 + tl.arange(0, Q)
        _add_wgrad_part(p0, row_ptrs, m_ok, c, N, live, OUT_DT)
        _add_wgrad_part(p1, row_ptrs, m_ok, c + Q, N, live, OUT_DT)
        _add_wgrad_part(p2, row_ptrs, m_ok, c + 2 * Q, N, live, OUT_DT)
        _add_wgrad_part(p3, row_ptrs, m_ok, c + 3 * Q, N, live, OUT_DT)
    else:
        offs_n = col0 + tl.arange(0, BLOCK_N)
        mask = m_ok[:, None] & (offs_n < N)[None, :]
        tl.store(row_ptrs + offs_n[None, :], acc.to(OUT_DT), mask=mask)


@triton.jit
def _add_wgrad_part(part, row_ptrs, m_ok, cols, N, live, OUT_DT: tl.constexpr):
    """Columns `cols` of a WGRAD tile: out += part (fp32), skipped for an expert without rows."""
    ptrs = row_ptrs + cols[None, :]
    mask = m_ok[:, None] & (cols < N)[None, :] & live
    old = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (old + part).to(OUT_DT), mask=mask)


@triton.jit
def _grouped_mm_wgrad_persistent_kernel(
    a_addr_ptr, b_addr_ptr, offsets_ptr, out_ptr, M, N,
    E: tl.constexpr, IN_DT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACCUMULATE: tl.constexpr, IEEE: tl.constexpr, FLATTEN: tl.constexpr,
    OUT_TABLE: tl.constexpr, OUT_DT: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_wait(PDL)   # first: no memory access before it (launch.py)
    # Persistent WGRAD (DIST_MOE_WGRAD_PERSISTENT): programs stride over the output tiles of all
    # experts. One TMA descriptor per operand spans every row; each expert's full BLOCK_K row
    # blocks go through TMA, its ragged last block through masked loads (a descriptor per
    # expert, as `_grouped_mm_wgrad_kernel` makes, cannot be rebuilt per tile cheaply). With
    # FLATTEN, Triton fuses the tile loop with the row loop so the next tile's loads overlap
    # this tile's epilogue; the products and their order are those of the per-tile kernel.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_expert = num_m * num_n
    total = E * per_expert
    a_base = _load_ptr(a_addr_ptr, IN_DT)
    b_base = _load_ptr(b_addr_ptr, IN_DT)
    all_rows = tl.maximum(tl.load(offsets_ptr + E), 1)
    a_desc = tl.make_tensor_descriptor(a_base, shape=[all_rows, M], strides=[M, 1],
                                       block_shape=[BLOCK_K, BLOCK_M])
    b_desc = tl.make_tensor_descriptor(b_base, shape=[all_rows, N], strides=[N, 1],
                                       block_shape=[BLOCK_K, BLOCK_N])
    for t in tl.range(pid, total, nprog, flatten=FLATTEN):
        e = t // per_expert
        pid_m, pid_n = _swizzle(t % per_expert, num_m, num_n, GROUP_M)
        row_start = tl.load(offsets_ptr + e)
        row_end = tl.load(offsets_ptr + e + 1)
        n_full = (row_end - row_start) // BLOCK_K
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in tl.range(0, n_full):
            r = row_start + i * BLOCK_K
            a = a_desc.load([r, pid_m * BLOCK_M])
            b = b_desc.load([r, pid_n * BLOCK_N])
            acc = _dot(a.T, b, acc, IEEE)
        r_tail = row_start + n_full * BLOCK_K
        if r_tail < row_end:
            rk = r_tail + tl.arange(0, BLOCK_K)
            r_ok = rk < row_end
            a = tl.load(a_base + rk.to(tl.int64)[:, None] * M + offs_m[None, :],
                        mask=r_ok[:, None] & (offs_m < M)[None, :], other=0.0)
            b = tl.load(b_base + rk.to(tl.int64)[:, None] * N + offs_n[None, :],
                        mask=r_ok[:, None] & (offs_n < N)[None, :], other=0.0)
            acc = _dot(a.T, b, acc, IEEE)
        _store_wgrad_tile(acc, out_ptr, e, offs_m, pid_n * BLOCK_N, M, N, row_start, row_end,
                      ACCUMULATE, OUT_TABLE, OUT_DT, BLOCK_N)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
# How the gathered A tile reaches a_copy_out: from the registers that feed the dot (False) or
# through a second load (True). Set from the GPU checks; see tests/gpu/test_grouped_gemm_gpu.py.
COPY_RELOAD = env_switch("DIST_MOE_COPY_RELOAD", True)
# Flattened persistent loops (GroupedGemmConfig.flatten=None takes this). Off: measured on 2xH200
# (2026-11-30, interleaved A/B) guide fwd +0.65 ms, fwd+bwd +0.66 ms slower (PTX 1.4-1.8x
# larger, spills 72 -> 108 B in the SwiGLU-backward epilogue).
FLATTEN = env_switch("DIST_MOE_GEMM_FLATTEN", False)
# Persistent WGRAD over all experts' tiles (`_grouped_mm_wgrad_persistent_kernel`; TMA configs
# only). On since the 2026-11-30 (fourth) run on 2xH200: W13 WGRAD 1.829 -> 1.693 ms alone,
# guide fwd+bwd -0.12 ms in the interleaved A/B (docs/perf_notes.md).
WGRAD_PERSISTENT = env_switch("DIST_MOE_WGRAD_PERSISTENT", True)
# Claim-mode slice width used when a config leaves claim_slice_k at None (0: whole m-tiles). 512
# since the 2026-11-30 guide-load run on 2xH200: staged fwd 3.49 -> 3.30 ms, fwd+bwd 9.99 ->
# 9.61 ms (docs/perf_notes.md).
CLAIM_SLICE_K_DEFAULT = 512
_slice_env = os.environ.get("DIST_MOE_CLAIM_SLICE_K", "") or str(CLAIM_SLICE_K_DEFAULT)
CLAIM_SLICE_K = int(_slice_env) if _slice_env.isdigit() else -1
if CLAIM_SLICE_K and (CLAIM_SLICE_K < 16 or CLAIM_SLICE_K & (CLAIM_SLICE_K - 1)):
    raise ValueError(f"DIST_MOE_CLAIM_SLICE_K={_slice_env!r}: 0 or a power of two >= 16")


def _launch_mm(args: _MMArgs, config: GroupedGemmConfig, num_programs: Optional[int]) -> None:
    w = args.w
    bn = config.block_n // 2 if args.epilogue == _EPI_SWIGLU else config.block_n
    assert args.kd % config.block_k == 0, (
        f"Kd={args.kd} must be a multiple of block_k={config.block_k} (the K loop is unmasked)")
    if args.epilogue == _EPI_SWIGLU:
        assert config.block_n % 32 == 0, "swiglu needs block_n >= 32 (two halves of >= 16)"
    num_n = triton.cdiv(args.n, bn)
    # Host bound on tiles: sum_e cdiv(len_e, BM) <= cdiv(R, BM) + E - 1.
    tile_bound = (triton.cdiv(args.max_rows, config.block_m) + args.num_experts) * num_n
    progs = num_programs or _default_num_programs(w.device)
    grid = (max(1, min(progs, tile_bound)),)
    if config.tma and w.device.type == "cuda":
        _ensure_tma_allocator()
    ready = epoch = claimed = copied = args.offsets  # dummies unless claiming
    copy_k = config.copy_k
    slice_k = 0
    if args.claim is not None:
        args.claim.check(max_rows=args.max_rows, block_m=config.block_m,
                         num_experts=args.num_experts, device=w.device)
        ready, epoch = args.claim.ready, args.claim.epoch
        # NOTE: at most 128 elements per thread per step: 128x512 with 8 warps spills (sm_90
        # PTX, 255 registers) while 128x256 does not. Kd is a multiple of block_k (a power of
        # two >= 16), so halving reaches a divisor of Kd.
        copy_k = min(copy_k, max(16, 128 * 32 * config.num_warps // config.block_m))
        while args.kd % copy_k:
            copy_k //= 2
        slice_k = CLAIM_SLICE_K if config.claim_slice_k is None else config.claim_slice_k
        if slice_k:
            claimed, copied = args.claim.claimed, args.claim.copied
            slice_k = min(slice_k, args.kd)
            while args.kd % slice_k:
                slice_k //= 2
            copy_k = min(copy_k, slice_k)
            assert args.kd // slice_k < 2 ** (ClaimFlags.SLICE_SHIFT - 2)
        args.claim.next_epoch()  # stream-ordered before the kernel; captured by CUDA graphs
    _grouped_mm_kernel[grid](
        a_addr_ptr=args.a_addr, a_rows_ptr=args.a_rows, a_copy_addr_ptr=args.a_copy_addr,
        w_ptr=w, offsets_ptr=args.offsets, out_addr_ptr=args.out_addr,
        out2_addr_ptr=args.out2_addr, out_rows_ptr=args.out_rows, ready_ptr=ready,
        epoch_ptr=epoch, claimed_ptr=claimed, copied_ptr=copied,
        N=args.n, Kd=args.kd, alpha=args.alpha, limit=args.limit,
        score_grad_delta=args.score_grad_delta,
        E=args.num_experts, E_PAD=max(2, triton.next_power_of_2(args.num_experts)),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, A_GATHER=args.a_gather, A_COPY=args.a_copy, W_KN=args.w_kn,
        EPILOGUE=args.epilogue, STORE_AUX=args.store_aux, ACT=args.activation,
        USE_TMA=config.tma, IEEE=w.dtype == torch.float32 or _interpreting(),
        COPY_RELOAD=COPY_RELOAD,
        A_CLAIM=args.claim is not None, CLAIM_AHEAD=config.claim_ahead, COPY_K=copy_k,
        PROXY_FENCE=args.claim is not None and config.tma and not _interpreting(),
        SLICE_K=slice_k, AHEAD_SLICES=config.claim_ahead_slices, SCORE_GRADS=args.score_grads,
        FLATTEN=(FLATTEN if config.flatten is None else config.flatten) and args.claim is None,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_args(w.device))


def grouped_mm_fwd(
    *,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    max_rows: int,
    a: Optional[torch.Tensor] = None,
    a_row_ptrs: Optional[torch.Tensor] = None,
    a_copy_out: Optional[torch.Tensor] = None,
    epilogue: str = "store",
    out: Optional[torch.Tensor] = None,
    out_row_ptrs: Optional[torch.Tensor] = None,
    h1: Optional[torch.Tensor] = None,
    h2: Optional[torch.Tensor] = None,
    activation: str = "swiglu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    config: Optional[GroupedGemmConfig] = None,
    num_programs: Optional[int] = None,
    claim_flags: Optional[ClaimFlags] = None,
) -> None:
    """FPROP grouped GEMM: row r of expert e gets a[r] @ w[e].T (fp32 accumulation).

    w               [E, N, Kd] contiguous, compute dtype (bf16; fp32/fp16 for the interpreter).
                    For epilogue="swiglu" this is W13 [E, 2F, D] (gate rows [0, F), up [F, 2F)).
    expert_offsets  int32 [E+1] device, cumulative row ends (psum[E] = R, never read on host).
    max_rows        host upper bound on R; only sizes the grid (tiles past R do nothing).
    a               A [R, Kd] (row stride Kd): device pointer (int64 [1]) or dense tensor.
    a_row_ptrs      instead of a: int64 [>= max_rows] absolute row addresses (0 -> zero row).
    a_copy_out      optional device pointer to [R, Kd]: the program of n-tile 0 stores each A
                    tile it loaded there (saves gathered rows for backward). Required in claim
                    mode, where it is also the A the GEMM reads.
    claim_flags     claim mode (with a_row_ptrs and a_copy_out): a `ClaimFlags` built for
                    max_rows, this config's block_m (or smaller) and E. Each m-tile's rows are
                    copied from a_row_ptrs into a_copy_out once, by the first program that
                    reaches it; all its n-tiles then read them densely (TMA when config.tma).
                    Advances claim_flags' epoch (device op) before the kernel.
    epilogue        "store":   out (device pointer to [R, N], row stride N) = result.
                    "swiglu":  h1 (optional device pointer to [R, 2F]) = [gate | up] rounded to
                               the compute dtype; h2 (device pointer to [R, F]) = act(h1).
                    "scatter": result row r written to address out_row_ptrs[r] (int64
                               [>= max_rows]); rows whose address is 0 are skipped.
    activation      "swiglu": silu(g) * u; "swiglu_clamped": g = min(g, limit),
                    u = clamp(u, -limit, limit), h2 = g * sigmoid(alpha * g) * (u + 1).
    config          tile config; default from `select_config("fwd", ...)`.
    num_programs    persistent grid size; default the SM count.
    """
    args = _prepare(w_kn=False, w=w, expert_offsets=expert_offsets, max_rows=max_rows, a=a,
                    a_row_ptrs=a_row_ptrs, a_copy_out=a_copy_out, epilogue=epilogue, out=out,
                    out_row_ptrs=out_row_ptrs, h1=h1, h2=h2, activation=activation,
                    swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                    claim_flags=claim_flags)
    width = 2 * args.n if epilogue == "swiglu" else args.n
    config = config or select_config("fwd", n=width, kd=args.kd, device=w.device)
    _launch_mm(args, config, num_programs)


def grouped_mm_dgrad(
    *,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    max_rows: int,
    a: Optional[torch.Tensor] = None,
    a_row_ptrs: Optional[torch.Tensor] = None,
    a_copy_out: Optional[torch.Tensor] = None,
    epilogue: str = "store",
    out: Optional[torch.Tensor] = None,
    out_row_ptrs: Optional[torch.Tensor] = None,
    h1: Optional[torch.Tensor] = None,
    h2: Optional[torch.Tensor] = None,
    activation: str = "swiglu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    config: Optional[GroupedGemmConfig] = None,
    num_programs: Optional[int] = None,
    claim_flags: Optional[ClaimFlags] = None,
    score_ptrs: Optional[torch.Tensor] = None,
    score_grad_delta: int = 0,
) -> None:
    """DGRAD grouped GEMM: row r of expert e gets a[r] @ w[e] (fp32 accumulation).

    w  [E, Kd, N] contiguous: W2 [E, D, F] for grad_h2 [R, F] = grad_h3 [R, D] @ W2[e], or
       W13 [E, 2F, D] for grad_x [R, D] = grad_h1 [R, 2F] @ W13[e].
    Other arguments as in `grouped_mm_fwd` (epilogues "store", "scatter" and "swiglu_bwd"),
    claim mode included: W2 DGRAD with a_row_ptrs = the grad_h3 rows, a_copy_out = the saved
    grad_h3 (WGRAD's operand), claim_flags = a `ClaimFlags`.
    epilogue="swiglu_bwd" (W2 DGRAD only): the grad_h2 tile never leaves the kernel; with the
    saved h1 = [g | u] rows at `h1` ([R, 2F]) it becomes grad_h1 = [dg | du] (the activation's
    backward, `rows.swiglu_grad`), written over h1 in place; with `h2` ([R, F]) the epilogue
    also stores h2 = act(g, u) there (the W2 WGRAD operand), so no separate SwiGLU pass runs.
    score_ptrs (with "swiglu_bwd"; Config.save_route_outputs=False): int64 [>= max_rows], each
    row's address of its route's fp32 score in the token owner's memory (0: skip). The GEMM
    then computes u = grad_y @ W2 from unscaled grad_y rows and, per row with score s,
    atomically adds <u, h2> (fp32) at score_ptrs[r] + score_grad_delta, runs the SwiGLU backward
    on grad_h2 = s u and stores h2 scaled (s h2) for the W2 WGRAD.
    """
    args = _prepare(w_kn=True, w=w, expert_offsets=expert_offsets, max_rows=max_rows, a=a,
                    a_row_ptrs=a_row_ptrs, a_copy_out=a_copy_out, epilogue=epilogue, out=out,
                    out_row_ptrs=out_row_ptrs, h1=h1, h2=h2, activation=activation,
                    swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                    claim_flags=claim_flags, score_ptrs=score_ptrs,
                    score_grad_delta=score_grad_delta)
    config = config or select_config("dgrad", n=args.n, kd=args.kd, device=w.device)
    _launch_mm(args, config, num_programs)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def grouped_mm_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    expert_offsets: torch.Tensor,
    out: "torch.Tensor | ExpertOutTable",
    *,
    accumulate: bool = False,
    dtype: Optional[torch.dtype] = None,
    config: Optional[GroupedGemmConfig] = None,
    persistent: Optional[bool] = None,
    num_programs: Optional[int] = None,
) -> None:
    """WGRAD grouped GEMM: out[e] (+)= a_e.T @ b_e over the rows of expert e (fp32 accumulation).

    a               [R, M] dense (row stride M): device pointer (int64 [1]) or dense tensor.
    b               [R, N] dense (row stride N): device pointer or dense tensor.
    expert_offsets  int32 [E+1] device cumulative row ends.
    out             [E, M, N] contiguous tensor, bf16 or fp32 (fp16/fp32 also for the
                    interpreter), or an ExpertOutTable (E separate M x N matrices). Experts
                    with no rows get zeros, or stay untouched when accumulate=True (which
                    needs an fp32 out: out[e] += a_e.T @ b_e).
    dtype           dtype of a and b; default: theirs when tensors, else bfloat16.
    persistent      TMA configs: one persistent launch over every expert's tiles (None: the
                    module default WGRAD_PERSISTENT, $DIST_MOE_WGRAD_PERSISTENT, on), with
                    num_programs programs (default: one per SM).
    """
    table = isinstance(out, ExpertOutTable)
    if table:
        out_ptr, out_dtype = out.addrs, out.dtype
    else:
        assert out.dim() == 3 and out.is_contiguous(), "out must be a contiguous [E, M, N] tensor"
        out_ptr, out_dtype = out, out.dtype
    assert out_dtype in _TL_DTYPES, f"out dtype {out_dtype} not supported"
    assert not accumulate or out_dtype == torch.float32, "accumulate=True needs an fp32 out"
    num_experts, m, n = out.shape
    _check_offsets(expert_offsets, num_experts, out.device)
    if dtype is None:
        dtype = a.dtype if a.dtype != torch.int64 else torch.bfloat16
    assert dtype in _TL_DTYPES, f"input dtype {dtype} not supported"
    a_addr = _as_device_ptr(a, "a", dtype)
    b_addr = _as_device_ptr(b, "b", dtype)
    config = config or select_config("wgrad", n=n, kd=m, device=out.device)
    if config.tma:
        size = torch.empty((), dtype=dtype).element_size()
        assert (m * size) % 16 == 0 and (n * size) % 16 == 0, "TMA needs 16-byte row strides"
        if out.device.type == "cuda":
            _ensure_tma_allocator()
    grid = (num_experts * triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    if grid[0] == 0:
        return
    if persistent is None:
        persistent = (WGRAD_PERSISTENT if config.wgrad_persistent is None
                      else config.wgrad_persistent)
    if config.tma and persistent:
        flatten = FLATTEN if config.flatten is None else config.flatten
        _grouped_mm_wgrad_persistent_kernel[(min(grid[0], num_programs or
                                                 _default_num_programs(out.device)),)](
            a_addr_ptr=a_addr, b_addr_ptr=b_addr, offsets_ptr=expert_offsets, out_ptr=out_ptr,
            M=m, N=n, E=num_experts, IN_DT=_TL_DTYPES[dtype], BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
            ACCUMULATE=accumulate, IEEE=dtype == torch.float32 or _interpreting(),
            FLATTEN=flatten, OUT_TABLE=table, OUT_DT=_TL_DTYPES[out_dtype],
            num_warps=config.num_warps, num_stages=config.num_stages,
            **pdl_args(out.device))
        return
    _grouped_mm_wgrad_kernel[grid](
        a_addr_ptr=a_addr, b_addr_ptr=b_addr, offsets_ptr=expert_offsets, out_ptr=out_ptr, M=m,
        N=n, E=num_experts, IN_DT=_TL_DTYPES[dtype], BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        ACCUMULATE=accumulate, USE_TMA=config.tma,
        IEEE=dtype == torch.float32 or _interpreting(),
        OUT_TABLE=table, OUT_DT=_TL_DTYPES[out_dtype],
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_args(out.device))
