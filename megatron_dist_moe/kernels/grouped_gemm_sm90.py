"""Grouped GEMMs on CUTLASS's Hopper warp-specialized kernels (csrc/grouped_gemm_sm90*.cu).

    FPROP  out[r] = a[r] @ w[e]^T    for the rows r of expert e, [offsets[e], offsets[e+1])
    WGRAD  out[e] = a_e^T @ b_e      over the same rows (K = the expert's row count)
    FP8 FPROP  out[r] = A[r] @ W[e]^T from an FP8 row bundle (1 x 128 scales) and FP8 weights
           (128 x 128 tile scales), bf16 out (`GroupedFp8FpropSm90`: the contract of
           grouped_gemm.fp8.fp8_grouped_mm with epilogue "store", the W13 FPROP)
    FP8 WGRAD  out[e] (+)= A_e B_e^T over expert e's padded token blocks, from the FP8 column
           bundles (`GroupedFp8WgradSm90`: the contract of grouped_gemm.fp8.fp8_grouped_wgrad)
    Both FP8 GEMMs run CUTLASS's blockwise-scaled FP8 kernels.

The same contracts as `grouped_gemm.grouped_mm_fwd(epilogue="store")` and
`grouped_gemm.grouped_mm_wgrad` (torch twins: `grouped_gemm_ref.grouped_mm_fwd_ref` and
`grouped_mm_wgrad_ref`), on a kernel Triton cannot express on sm_90: a producer
warp issues the TMA loads while two consumer warpgroups run the MMAs, with 2x1 clusters
multicasting the weight tile. Everything per call stays on the device: a one-block kernel turns
the device offsets and addresses into CUTLASS's per-group arguments, so a call is two launches,
never synchronises, and can be captured in a CUDA graph.

Building. The sources are compiled on first use with nvcc (sm_90a) into one shared library,
cached under $DIST_MOE_CSRC_CACHE (default ~/.cache/megatron_dist_moe/csrc) in a folder named by
the hash of the sources, the flags and the CUTLASS version; ranks that start together take a
file lock, so one builds and the others load. No torch headers are involved (the library is
called through ctypes), so the build takes about a minute and does not depend on the torch ABI.
Needs: nvcc ($CUDACXX, $CUDA_HOME/bin or PATH) and the CUTLASS headers, from the
`nvidia-cutlass` wheel (`pip install nvidia-cutlass`; on offline machines carry the wheel) or
$DIST_MOE_CUTLASS_DIR (a CUTLASS checkout: include/ and tools/util/include/).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path

import torch

from . import csrc_build

__all__ = ["CONFIGS", "WGRAD_CONFIGS", "FP8_FPROP_CONFIGS", "FP8_WGRAD_CONFIGS", "fp8_gemm_loads",
           "GroupedFpropSm90", "GroupedWgradSm90", "GroupedFp8FpropSm90", "GroupedFp8WgradSm90",
           "available", "load_library", "build_library"]

# Tile configurations, one translation unit each: FPROP csrc/grouped_gemm_sm90_<name>.cu, WGRAD
# csrc/grouped_gemm_sm90_wgrad_<name>_<bf16|f32>.cu (one per stored weight-gradient dtype).
CONFIGS = ("coop", "pingpong")
WGRAD_CONFIGS = ("coop",)   # pingpong ran even with it on 2xH200 and was dropped
_WGRAD_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}
# FP8 block-scaled units (csrc/grouped_gemm_sm90_fp8_wgrad_<name>_<bf16|f32>.cu and
# csrc/grouped_gemm_sm90_fp8_fprop_<name>.cu; the f32 WGRAD units can also accumulate, C = D):
# "overlap", 128x128x128 tiles, 1x2 clusters, two warpgroups on each tile, on
# csrc/fp8_promotion_overlap.cuh's mainloop (each 128-wide K block promoted while the next
# block's wgmmas run). Measured on one H100 and removed (docs/decisions.md): CUTLASS's own
# mainloop ("coop": promotion after each block's wait; slower at every GEMM of the guide
# layer, W13 / W2 WGRAD 1.360 / 0.689 vs 1.302 / 0.639 ms), ping-pong units on the overlapped
# mainloop (64x128x128: 12-40 % slower), 2x1 clusters (even)
FP8_WGRAD_CONFIGS = ("overlap",)
FP8_FPROP_CONFIGS = ("overlap",)
_UNITS = ([f"grouped_gemm_sm90_{c}" for c in CONFIGS]
          + [f"grouped_gemm_sm90_wgrad_{c}_{d}" for c in WGRAD_CONFIGS
             for d in _WGRAD_DTYPES.values()]
          + [f"grouped_gemm_sm90_fp8_wgrad_{c}_{d}" for c in FP8_WGRAD_CONFIGS
             for d in _WGRAD_DTYPES.values()]
          + [f"grouped_gemm_sm90_fp8_fprop_{c}" for c in FP8_FPROP_CONFIGS])
_HEADER = "grouped_gemm_sm90.cuh"
_HEADERS = (_HEADER, "grouped_gemm_sm90_fp8.cuh", "fp8_promotion_overlap.cuh")
_NVCC_FLAGS = csrc_build.NVCC_FLAGS
_ZERO_ROWS = 8   # kZeroRows in csrc/grouped_gemm_sm90.cuh: the rows an empty expert reads
_STATUS = {
    1: "bad shape: E < 1, or N or K (WGRAD: M or N) not a multiple of 8",
    2: "the workspace is smaller than CUTLASS asks for",
    3: "CUTLASS cannot implement this problem (can_implement failed)",
    4: "CUTLASS initialize failed",
    5: "a kernel launch failed",
}
_FP8_STATUS = {**_STATUS,
               1: "bad shape: E < 1, M or N not a multiple of 16, Rp not a multiple of 128, or "
                  "accumulate on a unit without a source operand"}
_FP8_FPROP_STATUS = {**_STATUS, 1: "bad shape: E < 1, N or K not a multiple of 128, or a row "
                                    "bound below -1"}


def csrc_dir() -> Path:
    return csrc_build.csrc_dir(_HEADER)


def cutlass_dir() -> Path:
    """The CUTLASS tree with include/ and tools/util/include/."""
    env = os.environ.get("DIST_MOE_CUTLASS_DIR")
    if env:
        d = Path(env)
    else:
        # found, not imported: the package's __init__ pulls in its Python generator
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(
                "the CUTLASS headers are missing: pip install nvidia-cutlass (carry the wheel to "
                "offline machines) or set DIST_MOE_CUTLASS_DIR to a CUTLASS checkout")
        d = Path(list(spec.submodule_search_locations)[0]) / "source"
    if not (d / "include" / "cutlass" / "cutlass.h").is_file():
        raise RuntimeError(f"{d}: no include/cutlass/cutlass.h (DIST_MOE_CUTLASS_DIR or the "
                           "nvidia-cutlass wheel)")
    return d


nvcc_path = csrc_build.nvcc_path


def available() -> bool:
    """True when the library can be built here (nvcc, CUTLASS headers and the sources found)."""
    try:
        csrc_dir(), cutlass_dir(), nvcc_path()
    except (RuntimeError, FileNotFoundError):
        return False
    return True


def _key_extra(cutlass: Path) -> bytes:
    version = cutlass / "include" / "cutlass" / "version.h"
    return version.read_bytes() if version.is_file() else str(cutlass).encode()


def _sources() -> list[Path]:
    d = csrc_dir()
    return [d / h for h in _HEADERS] + [d / f"{u}.cu" for u in _UNITS]


def _cache_key(nvcc: str, cutlass: Path) -> str:
    return csrc_build.cache_key(_sources(), _NVCC_FLAGS, nvcc, _key_extra(cutlass))


def build_library(verbose: bool = False) -> Path:
    """Compile the sources (one nvcc per configuration, in parallel) and link the shared
    library; returns its path, reusing the cached build when the key matches."""
    cutlass = cutlass_dir()
    return csrc_build.build(
        "dm_grouped_gemm_sm90", csrc_dir(), _UNITS, _HEADERS,
        includes=[f"-I{cutlass / 'include'}", f"-I{cutlass / 'tools' / 'util' / 'include'}"],
        flags=_NVCC_FLAGS, key_extra=_key_extra(cutlass), what="CUTLASS kernels", takes="minutes",
        verbose=verbose)


class _Lib:
    def __init__(self, path: Path):
        self.path = path
        self.dll = ctypes.CDLL(str(path))
        i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        self.fns = {cfg: self._entry_points(f"dm_sm90_fprop_{cfg}",
                                            [i32, i32, i32, vp, vp, vp, vp, vp, vp, i64, i32,
                                             i32, vp])
                    for cfg in CONFIGS}
        self.wgrad_fns = {(cfg, dt): self._entry_points(f"dm_sm90_wgrad_{cfg}_{dt}",
                                                        [i32, i32, i32, vp, vp, vp, vp, vp, vp,
                                                         vp, i64, i32, i32, vp])
                          for cfg in WGRAD_CONFIGS for dt in _WGRAD_DTYPES.values()}
        # run: E, M, N, rp_cap, offsets, qa, sa, qb, sb (device pointers), out, out_table,
        # accumulate, zeros, args, workspace, workspace_size, device, sm_count, stream
        self.fp8_wgrad_fns = {(cfg, dt): self._entry_points(
            f"dm_sm90_fp8_wgrad_{cfg}_{dt}",
            [i32, i32, i32, i64, vp, vp, vp, vp, vp, vp, vp, i32, vp, vp, vp, i64, i32, i32, vp],
            zero_bytes=True)
            for cfg in FP8_WGRAD_CONFIGS for dt in _WGRAD_DTYPES.values()}
        # run: E, N, K, r_cap, offsets, qa, sa (device pointers), w, sw, out (device pointer),
        # args, workspace, workspace_size, device, sm_count, stream
        self.fp8_fprop_fns = {cfg: self._entry_points(
            f"dm_sm90_fp8_fprop_{cfg}",
            [i32, i32, i32, i64, vp, vp, vp, vp, vp, vp, vp, vp, i64, i32, i32, vp])
            for cfg in FP8_FPROP_CONFIGS}

    def _entry_points(self, name: str, run_argtypes: list, zero_bytes: bool = False) -> tuple:
        """(args_bytes, workspace_bytes[, zero_bytes], run) of one unit's extern "C" API."""
        i64, i32 = ctypes.c_int64, ctypes.c_int

        def fn(suffix, argtypes, restype):
            f = getattr(self.dll, f"{name}_{suffix}")
            f.argtypes, f.restype = argtypes, restype
            return f
        sizes = [fn("args_bytes", [i32], i64), fn("workspace_bytes", [i32, i32], i64)]
        if zero_bytes:
            sizes.append(fn("zero_bytes", [i32, i32], i64))
        return (*sizes, fn("run", run_argtypes, i32))


@functools.lru_cache(maxsize=1)
def load_library() -> _Lib:
    return _Lib(build_library())


# whether fp8_block's CUTLASS GEMMs run here (fp8_gemm_loads(device)): a Hopper GPU where the
# library can be built (minutes, once, at context creation rather than at the first call) or
# loaded from its cache
fp8_gemm_loads = csrc_build.LoadProbe(
    lambda: load_library(), "fp8_block's GEMMs run on our Triton kernels: the CUTLASS library "
    "(csrc/) could not be built or loaded here", precondition=lambda: available())


def _addr_tensor(x: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """An int64 [1] device pointer as is; a bf16 tensor becomes its address."""
    if x.dtype == torch.int64 and x.numel() == 1:
        ptr = x
    elif x.dtype == torch.bfloat16 and x.is_contiguous():
        from .rows import device_ptr
        ptr = device_ptr(x)
    else:
        raise ValueError(f"{name}: expected a device pointer (int64 [1]) or a contiguous bf16 "
                         f"tensor, got {x.dtype} {tuple(x.shape)}")
    if ptr.device != device:
        raise ValueError(f"{name} is on {ptr.device}, expected {device}")
    return ptr


def _hopper_device(device) -> torch.device:
    """The CUDA device named by `device`, with its index; refuses anything but sm_90."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device={device}: the CUTLASS GEMM runs on CUDA devices only")
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        raise RuntimeError(f"the sm_90a CUTLASS GEMM needs a Hopper GPU; {device} is "
                           f"sm_{cap[0]}{cap[1]}")
    if device.index is None:   # "cuda": the current device, named by index for the checks
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_offsets(expert_offsets: torch.Tensor, E: int, device: torch.device) -> None:
    if (expert_offsets.dtype != torch.int32 or expert_offsets.shape != (E + 1,)
            or expert_offsets.device != device):
        raise ValueError(f"expert_offsets: expected int32 [{E + 1}] on {device}, got "
                         f"{expert_offsets.dtype} {tuple(expert_offsets.shape)} on "
                         f"{expert_offsets.device}")


def _check_built_for(gemm, name: str, E: int, device: torch.device) -> None:
    """An operand of E experts on `device` matches the GEMM instance's E and device (every
    instance holds a device argument block sized for its E, on its device)."""
    if E != gemm.E:
        raise ValueError(f"{name} has {E} experts; this GEMM was built for {gemm.E}")
    if device != gemm.device:
        raise ValueError(f"{name} is on {device}, expected {gemm.device}")


class _GroupedCallSm90:
    """What every grouped GEMM instance holds: its device (sm_90), E, SM count, run entry point,
    and the device argument block and workspace that the library's entry points size.
    entry_points(lib) -> (args_bytes, workspace_bytes, run) of the loaded library."""

    def __init__(self, num_experts: int, device, entry_points):
        device = _hopper_device(device)
        self.E, self.device, self.dev_index = int(num_experts), device, device.index
        self.sm_count = torch.cuda.get_device_properties(self.dev_index).multi_processor_count
        args_bytes, ws_bytes, self._run = entry_points(load_library())
        self.args = torch.zeros(int(args_bytes(self.E)), dtype=torch.uint8, device=device)
        self.workspace_bytes = int(ws_bytes(self.E, self.sm_count))
        self.workspace = torch.zeros(max(self.workspace_bytes, 16), dtype=torch.uint8,
                                     device=device)


class GroupedFpropSm90(_GroupedCallSm90):
    """out[r] = a[r] @ w[e]^T per expert on one CUTLASS configuration ("coop" or "pingpong").

    One instance per (device, number of experts). It owns the device argument block and the
    workspace, so its calls must be ordered on one stream (each call rewrites the block).
    """

    def __init__(self, num_experts: int, device: torch.device, config: str = "coop"):
        if config not in CONFIGS:
            raise ValueError(f"config={config!r}: expected one of {CONFIGS}")
        self.config = config
        super().__init__(num_experts, device, lambda lib: lib.fns[config])

    def __call__(self, w: torch.Tensor, expert_offsets: torch.Tensor, a: torch.Tensor,
                 out: torch.Tensor) -> None:
        """w bf16 [E, N, K] contiguous; expert_offsets int32 [E+1] on the device; a and out:
        device pointers (int64 [1]) to bf16 [R, K] / [R, N] row-major, or such tensors."""
        if w.dim() != 3 or w.dtype != torch.bfloat16 or not w.is_contiguous():
            raise ValueError(f"w: expected a contiguous bf16 [E, N, K] tensor, got {w.dtype} "
                             f"{tuple(w.shape)}")
        E, N, K = w.shape
        _check_built_for(self, "w", E, w.device)
        if N % 8 or K % 8:
            raise ValueError(f"w: N={N} and K={K} must be multiples of 8 (16-byte TMA rows)")
        _check_offsets(expert_offsets, E, self.device)
        a_ptr = _addr_tensor(a, "a", self.device)
        out_ptr = _addr_tensor(out, "out", self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        status = self._run(E, N, K, expert_offsets.data_ptr(), a_ptr.data_ptr(), w.data_ptr(),
                           out_ptr.data_ptr(), self.args.data_ptr(), self.workspace.data_ptr(),
                           self.workspace.numel(), self.dev_index, self.sm_count, stream)
        if status != 0:
            raise RuntimeError(f"grouped_gemm_sm90[{self.config}] E={E} N={N} K={K}: "
                               f"{_STATUS.get(status, f'status {status}')}")


class GroupedWgradSm90(_GroupedCallSm90):
    """out[e] = a_e^T @ b_e over the rows of each expert, on a CUTLASS configuration ("coop":
    128x256x64 tiles, 2x1 clusters), storing bf16 or fp32 (`out_dtype`).

    The reduction dimension is each expert's ragged row count; experts with no rows get zeros.
    One instance per (device, number of experts, out dtype); its calls must be ordered on one
    stream (each call rewrites the device argument block).
    """

    def __init__(self, num_experts: int, device: torch.device, config: str = "coop",
                 out_dtype: torch.dtype = torch.bfloat16):
        if config not in WGRAD_CONFIGS:
            raise ValueError(f"config={config!r}: expected one of {WGRAD_CONFIGS}")
        if out_dtype not in _WGRAD_DTYPES:
            raise ValueError(f"out_dtype={out_dtype}: expected torch.bfloat16 or torch.float32")
        self.config, self.out_dtype = config, out_dtype
        super().__init__(num_experts, device,
                         lambda lib: lib.wgrad_fns[(config, _WGRAD_DTYPES[out_dtype])])
        self.zeros = torch.zeros(0, dtype=torch.bfloat16, device=self.device)  # grown on first use

    def __call__(self, a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor,
                 out: torch.Tensor) -> None:
        """a, b: device pointers (int64 [1]) to bf16 [R, M] / [R, N] row-major, or such
        tensors; expert_offsets int32 [E+1] on the device; out [E, M, N] contiguous, of this
        instance's out_dtype."""
        if out.dim() != 3 or not out.is_contiguous() or out.dtype != self.out_dtype:
            raise ValueError(f"out: expected a contiguous {self.out_dtype} [E, M, N] tensor, got "
                             f"{out.dtype} {tuple(out.shape)}")
        E, M, N = out.shape
        _check_built_for(self, "out", E, out.device)
        if M % 8 or N % 8:
            raise ValueError(f"out: M={M} and N={N} must be multiples of 8 (16-byte TMA rows)")
        _check_offsets(expert_offsets, E, self.device)
        a_ptr = _addr_tensor(a, "a", self.device)
        b_ptr = _addr_tensor(b, "b", self.device)
        need = _ZERO_ROWS * max(M, N)
        if self.zeros.numel() < need:
            # allocated outside any capture on the first call of a shape (graph warm-up)
            self.zeros = torch.zeros(need, dtype=torch.bfloat16, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        status = self._run(E, M, N, expert_offsets.data_ptr(), a_ptr.data_ptr(),
                           b_ptr.data_ptr(), out.data_ptr(), self.zeros.data_ptr(),
                           self.args.data_ptr(), self.workspace.data_ptr(),
                           self.workspace.numel(), self.dev_index, self.sm_count, stream)
        if status != 0:
            raise RuntimeError(f"grouped_wgrad_sm90[{self.config}, {self.out_dtype}] E={E} M={M} "
                               f"N={N}: {_STATUS.get(status, f'status {status}')}")


_F8 = torch.float8_e4m3fn


def _bundle_pair(pair, name: str, kind: str, device: torch.device):
    """(data, scales, given_as_pointers) of an FP8 bundle: both device pointers (int64 [1], on
    `device`) or both tensors; the checks every bundle shares, before its shape checks."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise ValueError(f"{name}: expected a {kind} bundle (data, scales), tensors or device "
                         f"pointers, got {type(pair).__name__}")
    q, s = pair
    ptrs = [x for x in (q, s) if x.dtype == torch.int64 and x.numel() == 1]
    if ptrs and len(ptrs) != 2:
        raise ValueError(f"{name}: data and scales must both be tensors or both device pointers")
    if ptrs:
        _bundle_on(q, s, name, device, aligned=False)
    return q, s, bool(ptrs)


def _bundle_on(q, s, name: str, device: torch.device, aligned: bool = True):
    """Both parts of a bundle on `device` (and, for tensors, 16-byte aligned)."""
    for x, what in ((q, name), (s, f"{name} scales")):
        if x.device != device:
            raise ValueError(f"{what} is on {x.device}, expected {device}")
        if aligned and x.data_ptr() % 16:
            raise ValueError(f"{what}: address {x.data_ptr():#x} is not 16-byte aligned")


def _fp8_bundle(pair, name: str, mn_name: str, device: torch.device):
    """(data, scales) of a column bundle as device pointers (int64 [1]), with its Rp (the data's
    second dimension; 0 when given as pointers). Tensors are checked: data e4m3 [MN, Rp], scales
    fp32 [Rp/128, MN], both contiguous on `device`; returns (q_ptr, s_ptr, MN or None, Rp)."""
    q, s, pointers = _bundle_pair(pair, name, "column", device)
    if pointers:
        return q, s, None, 0
    if q.dim() != 2 or q.dtype != _F8 or not q.is_contiguous():
        raise ValueError(f"{name}: expected contiguous float8_e4m3fn data [{mn_name}, Rp], got "
                         f"{q.dtype} {tuple(q.shape)}")
    mn, rp = q.shape
    if rp % 128:
        raise ValueError(f"{name}: Rp={rp} (the data's second dimension) must be a multiple of "
                         "128")
    if s.dtype != torch.float32 or s.shape != (rp // 128, mn) or not s.is_contiguous():
        raise ValueError(f"{name} scales: expected contiguous float32 [{rp // 128}, {mn}] "
                         f"(Rp/128, {mn_name}), got {s.dtype} {tuple(s.shape)}")
    _bundle_on(q, s, name, device)
    from .rows import device_ptr
    return device_ptr(q), device_ptr(s), mn, rp


def _fp8_rows(pair, name: str, K: int, device: torch.device):
    """(data, scales) of an FP8 row bundle as device pointers (int64 [1]) and its row count
    (None when given as pointers). Tensors are checked: data e4m3 [R, K], scales fp32 [R, K/128],
    both contiguous and 16-byte aligned on `device`."""
    q, s, pointers = _bundle_pair(pair, name, "row", device)
    if pointers:
        return q, s, None
    if q.dim() != 2 or q.dtype != _F8 or not q.is_contiguous() or q.shape[1] != K:
        raise ValueError(f"{name}: expected contiguous float8_e4m3fn data [R, {K}], got "
                         f"{q.dtype} {tuple(q.shape)}")
    rows = q.shape[0]
    if s.dtype != torch.float32 or s.dim() != 2 or s.shape[1] != K // 128 or not s.is_contiguous():
        raise ValueError(f"{name} scales: expected contiguous float32 [R, {K // 128}], got "
                         f"{s.dtype} {tuple(s.shape)}")
    if s.shape[0] != rows:
        raise ValueError(f"{name}: {rows} data rows but {s.shape[0]} scale rows")
    _bundle_on(q, s, name, device)
    from .rows import device_ptr
    return device_ptr(q), device_ptr(s), rows


class GroupedFp8FpropSm90(_GroupedCallSm90):
    """out[r] = A[r] @ W[e]^T for the rows r of expert e, from an FP8 row bundle (1 x 128 scales
    along K) and FP8 weights (128 x 128 tile scales), bf16 out, on CUTLASS's ptr-array
    blockwise-scaled FP8 kernel (sm_90a): the contract of
    `grouped_gemm.fp8.fp8_grouped_mm(epilogue="store")`, fp32 accumulation promoted every 128
    of K.

    config "overlap": 128x128x128 tiles, two warpgroups on each tile, 1x2 clusters, each K
    block's promotion under the next block's wgmmas. One instance
    per (device, number of experts): it owns the device argument block and workspace, so its
    calls must be ordered on one stream. Nothing is read on the host; a call can be captured in
    a CUDA graph.
    """

    def __init__(self, num_experts: int, device, config: str = FP8_FPROP_CONFIGS[0]):
        if config not in FP8_FPROP_CONFIGS:
            raise ValueError(f"config={config!r}: expected one of {FP8_FPROP_CONFIGS}")
        self.config = config
        super().__init__(num_experts, device, lambda lib: lib.fp8_fprop_fns[config])

    def __call__(self, a, w: torch.Tensor, w_scales: torch.Tensor, expert_offsets: torch.Tensor,
                 out) -> None:
        """a: the A row bundle (q [R, K] e4m3, s [R, K/128] fp32), tensors or device pointers
        (int64 [1]); w [E, N, K] e4m3 contiguous, w_scales [E, N/128, K/128] fp32 contiguous;
        expert_offsets int32 [E+1] on the device (rows past offsets[E] are not touched); out
        bf16 [R, N] contiguous, or a device pointer to it."""
        if w.dim() != 3 or w.dtype != _F8 or not w.is_contiguous():
            raise ValueError(f"w: expected a contiguous float8_e4m3fn [E, N, K] tensor, got "
                             f"{w.dtype} {tuple(w.shape)}")
        E, N, K = w.shape
        _check_built_for(self, "w", E, w.device)
        if N % 128 or K % 128:
            raise ValueError(f"w: N={N} and K={K} must be multiples of 128 (the scaling blocks)")
        if (w_scales.dtype != torch.float32 or w_scales.shape != (E, N // 128, K // 128)
                or not w_scales.is_contiguous() or w_scales.device != self.device):
            raise ValueError(f"w_scales: expected contiguous float32 [{E}, {N // 128}, "
                             f"{K // 128}] on {self.device}, got {w_scales.dtype} "
                             f"{tuple(w_scales.shape)} on {w_scales.device}")
        _check_offsets(expert_offsets, E, self.device)
        qa, sa, a_rows = _fp8_rows(a, "a", K, self.device)
        out_rows = None
        if isinstance(out, torch.Tensor) and not (out.dtype == torch.int64 and out.numel() == 1):
            if out.dim() != 2 or out.shape[1] != N or out.dtype != torch.bfloat16:
                raise ValueError(f"out: expected bf16 [R, {N}], got {out.dtype} "
                                 f"{tuple(out.shape)}")
            out_rows = out.shape[0]
        out_ptr = _addr_tensor(out, "out", self.device)
        # the device traps on offsets[E] past the rows of a and out where their shapes are known
        known = [r for r in (a_rows, out_rows) if r is not None]
        r_cap = min(known) if known else -1
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with torch.cuda.device(self.dev_index):    # CUTLASS sets its kernel attributes there
            status = self._run(E, N, K, r_cap, expert_offsets.data_ptr(), qa.data_ptr(),
                               sa.data_ptr(), w.data_ptr(), w_scales.data_ptr(),
                               out_ptr.data_ptr(), self.args.data_ptr(),
                               self.workspace.data_ptr(), self.workspace.numel(), self.dev_index,
                               self.sm_count, stream)
        if status != 0:
            raise RuntimeError(f"grouped_fp8_fprop_sm90[{self.config}] E={E} N={N} K={K}: "
                               f"{_FP8_FPROP_STATUS.get(status, f'status {status}')}")


class GroupedFp8WgradSm90:
    """out[e] (+)= A_e B_e^T over each expert's padded token blocks, from FP8 column bundles, on
    CUTLASS's ptr-array blockwise-scaled FP8 kernels (sm_90a): the contract of
    `grouped_gemm.fp8.fp8_grouped_wgrad` (1 x 128 scales along the tokens on both operands,
    fp32 accumulation promoted every 128 tokens).

    config "overlap": 128x128x128 tiles, two warpgroups on each tile, 1x2 clusters, each K
    block's promotion under the next block's wgmmas. One instance
    per (device, number of experts): it owns the device argument block, workspace and zero block, so its calls must be
    ordered on one stream. Nothing is read on the host; a call can be captured in a CUDA graph
    (make the first call of a shape outside the capture: it sizes the zero block).
    """

    def __init__(self, num_experts: int, device, config: str = FP8_WGRAD_CONFIGS[0]):
        if config not in FP8_WGRAD_CONFIGS:
            raise ValueError(f"config={config!r}: expected one of {FP8_WGRAD_CONFIGS}")
        device = _hopper_device(device)
        self.config, self.E, self.device, self.dev_index = config, int(num_experts), device, \
            device.index
        self.sm_count = torch.cuda.get_device_properties(self.dev_index).multi_processor_count
        lib = load_library()
        self._fns = {dt: lib.fp8_wgrad_fns[(config, name)] for dt, name in _WGRAD_DTYPES.items()}
        # one argument block and workspace serve both out dtypes (sized for the larger)
        args_bytes = max(int(f[0](self.E)) for f in self._fns.values())
        self.workspace_bytes = max(int(f[1](self.E, self.sm_count)) for f in self._fns.values())
        self.args = torch.zeros(args_bytes, dtype=torch.uint8, device=device)
        self.workspace = torch.zeros(max(self.workspace_bytes, 16), dtype=torch.uint8,
                                     device=device)
        self.zeros = torch.zeros(0, dtype=torch.uint8, device=device)   # grown on first use
        self._old_zeros: list[torch.Tensor] = []   # smaller blocks earlier graphs may read

    def reserve(self, M: int, N: int) -> None:
        """Size the zero block for out[e] of M x N now (outside any capture), so that a first
        call of this shape inside a CUDA graph allocates nothing."""
        need = max(int(f[2](M, N)) for f in self._fns.values())
        if self.zeros.numel() < need:
            self._old_zeros.append(self.zeros)
            self.zeros = torch.zeros(need, dtype=torch.uint8, device=self.device)

    def _out(self, out, accumulate: bool):
        """(base address or 0, table tensor or None, dtype, M, N) of `out`."""
        from .grouped_gemm.wgrad import ExpertOutTable
        if isinstance(out, ExpertOutTable):
            E, M, N = out.shape
            addrs = out.addrs
            if addrs.dtype != torch.int64 or addrs.dim() != 1 or not addrs.is_contiguous():
                raise ValueError(f"out.addrs: expected a contiguous int64 [E] tensor, got "
                                 f"{addrs.dtype} {tuple(addrs.shape)}")
            base, table, dtype = 0, addrs, out.dtype
        elif isinstance(out, torch.Tensor):
            if out.dim() != 3 or not out.is_contiguous():
                raise ValueError(f"out: expected a contiguous [E, M, N] tensor, got "
                                 f"{tuple(out.shape)}")
            (E, M, N), base, table, dtype = out.shape, out.data_ptr(), None, out.dtype
            if base % 16:
                raise ValueError(f"out: address {base:#x} is not 16-byte aligned")
        else:
            raise ValueError(f"out: expected an [E, M, N] tensor or an ExpertOutTable, got "
                             f"{type(out).__name__}")
        if dtype not in _WGRAD_DTYPES:
            raise ValueError(f"out: dtype {dtype}, expected torch.bfloat16 or torch.float32")
        if accumulate and dtype != torch.float32:
            raise ValueError(f"out: accumulate=True needs an fp32 out, got {dtype}")
        _check_built_for(self, "out", E, out.device)
        if M % 128 or N % 128:
            raise ValueError(f"out: M={M} and N={N} must be multiples of 128")
        return base, table, dtype, M, N

    def __call__(self, a, b, expert_offsets: torch.Tensor, out, accumulate: bool = False) -> None:
        """a, b: column bundles (q_t [M, Rp] / [N, Rp] e4m3, s_t [Rp/128, M] / [Rp/128, N]
        fp32), tensors or device pointers (int64 [1]); Rp = layout.padded_rows(R, E) for the R
        = expert_offsets[-1] on the device. out: [E, M, N] bf16 / fp32 tensor, or an
        ExpertOutTable; accumulate=True (fp32 only) adds into it."""
        base, table, dtype, M, N = self._out(out, accumulate)
        _check_offsets(expert_offsets, self.E, self.device)
        qa, sa, am, rpa = _fp8_bundle(a, "a", "M", self.device)
        qb, sb, bn, rpb = _fp8_bundle(b, "b", "N", self.device)
        if am is not None and am != M:
            raise ValueError(f"a: {am} rows, expected out's M={M}")
        if bn is not None and bn != N:
            raise ValueError(f"b: {bn} rows, expected out's N={N}")
        if rpa and rpb and rpa != rpb:
            raise ValueError(f"a and b: Rp={rpa} and Rp={rpb} differ (one padded token space)")
        args_bytes, _, zero_bytes, run = self._fns[dtype]
        need = int(zero_bytes(M, N))
        if self.zeros.numel() < need:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"GroupedFp8WgradSm90: first call with out of {M} x {N} "
                                   f"inside a CUDA graph capture; call reserve({M}, {N}) "
                                   "before capturing")
            self._old_zeros.append(self.zeros)   # graphs captured earlier may still read it
            self.zeros = torch.zeros(need, dtype=torch.uint8, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with torch.cuda.device(self.dev_index):    # CUTLASS sets its kernel attributes there
            status = run(self.E, M, N, max(rpa, rpb), expert_offsets.data_ptr(),
                         qa.data_ptr(), sa.data_ptr(), qb.data_ptr(), sb.data_ptr(), base,
                         table.data_ptr() if table is not None else None,
                         int(bool(accumulate)), self.zeros.data_ptr(), self.args.data_ptr(),
                         self.workspace.data_ptr(), self.workspace.numel(), self.dev_index,
                         self.sm_count, stream)
        if status != 0:
            raise RuntimeError(f"grouped_fp8_wgrad_sm90[{self.config}, {dtype}] E={self.E} M={M} "
                               f"N={N}: {_FP8_STATUS.get(status, f'status {status}')}")
