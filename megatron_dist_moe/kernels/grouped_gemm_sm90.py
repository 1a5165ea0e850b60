"""Grouped GEMMs on CUTLASS's Hopper warp-specialized kernels (csrc/grouped_gemm_sm90*.cu).

    FPROP  out[r] = a[r] @ w[e]^T    for the rows r of expert e, [offsets[e], offsets[e+1])
    WGRAD  out[e] = a_e^T @ b_e      over the same rows (K = the expert's row count)

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
import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["CONFIGS", "WGRAD_CONFIGS", "GroupedFpropSm90", "GroupedWgradSm90", "available",
           "load_library", "build_library"]

# Tile configurations, one translation unit each: FPROP csrc/grouped_gemm_sm90_<name>.cu, WGRAD
# csrc/grouped_gemm_sm90_wgrad_<name>_<bf16|f32>.cu (one per stored weight-gradient dtype).
CONFIGS = ("coop", "pingpong")
WGRAD_CONFIGS = ("coop",)   # pingpong ran even with it on 2xH200 and was dropped
_WGRAD_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}
_UNITS = ([f"grouped_gemm_sm90_{c}" for c in CONFIGS]
          + [f"grouped_gemm_sm90_wgrad_{c}_{d}" for c in WGRAD_CONFIGS
             for d in _WGRAD_DTYPES.values()])
_HEADER = "grouped_gemm_sm90.cuh"
_NVCC_FLAGS = ["-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
               "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC"]
_ZERO_ROWS = 8   # kZeroRows in csrc/grouped_gemm_sm90.cuh: the rows an empty expert reads
_STATUS = {
    1: "bad shape: E < 1, or N or K (WGRAD: M or N) not a multiple of 8",
    2: "the workspace is smaller than CUTLASS asks for",
    3: "CUTLASS cannot implement this problem (can_implement failed)",
    4: "CUTLASS initialize failed",
    5: "a kernel launch failed",
}


def csrc_dir() -> Path:
    d = Path(os.environ.get("DIST_MOE_CSRC_DIR", Path(__file__).resolve().parents[2] / "csrc"))
    if not (d / _HEADER).is_file():
        raise FileNotFoundError(
            f"{d / _HEADER} not found: the CUTLASS kernels build from the repository's csrc/ "
            "folder; install the package editable (pip install -e .) or set DIST_MOE_CSRC_DIR")
    return d


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


def nvcc_path() -> str:
    for cand in (os.environ.get("CUDACXX"),
                 os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc")
                 if os.environ.get("CUDA_HOME") else None,
                 shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand):
            return cand
    raise RuntimeError("nvcc not found ($CUDACXX, $CUDA_HOME/bin, PATH): the CUTLASS kernels "
                       "are compiled on first use")


def available() -> bool:
    """True when the library can be built here (nvcc, CUTLASS headers and the sources found)."""
    try:
        csrc_dir(), cutlass_dir(), nvcc_path()
    except (RuntimeError, FileNotFoundError):
        return False
    return True


def _sources() -> list[Path]:
    d = csrc_dir()
    return [d / _HEADER] + [d / f"{u}.cu" for u in _UNITS]


def _cache_key(nvcc: str, cutlass: Path) -> str:
    h = hashlib.sha256()
    for p in _sources():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(_NVCC_FLAGS).encode())
    h.update(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.encode())
    version = cutlass / "include" / "cutlass" / "version.h"
    h.update(version.read_bytes() if version.is_file() else str(cutlass).encode())
    return h.hexdigest()[:16]


def build_library(verbose: bool = False) -> Path:
    """Compile the sources (one nvcc per configuration, in parallel) and link the shared
    library; returns its path, reusing the cached build when the key matches."""
    nvcc, cutlass = nvcc_path(), cutlass_dir()
    root = Path(os.environ.get("DIST_MOE_CSRC_CACHE",
                               Path.home() / ".cache" / "megatron_dist_moe" / "csrc"))
    out_dir = root / _cache_key(nvcc, cutlass)
    lib = out_dir / "libdm_grouped_gemm_sm90.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # another rank may be building the same key
        if lib.is_file():
            return lib
        includes = [f"-I{cutlass / 'include'}", f"-I{cutlass / 'tools' / 'util' / 'include'}",
                    f"-I{csrc_dir()}"]

        def compile_one(unit: str) -> Path:
            obj = out_dir / f"{unit}.o"
            cmd = [nvcc, *_NVCC_FLAGS, *includes, "-c", str(csrc_dir() / f"{unit}.cu"), "-o",
                   str(obj)]
            if verbose:
                print("[grouped_gemm_sm90]", " ".join(cmd), flush=True)
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"nvcc failed on {unit}.cu:\n{r.stderr[-4000:]}")
            return obj

        # one nvcc per unit, as many at once as there are cores (each takes ~1.5 GB)
        with ThreadPoolExecutor(max(1, min(len(_UNITS), os.cpu_count() or 1))) as pool:
            objs = list(pool.map(compile_one, _UNITS))
        tmp = out_dir / f"lib.{os.getpid()}.so"
        r = subprocess.run([nvcc, "-shared", "-o", str(tmp), *map(str, objs)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"linking the CUTLASS library failed:\n{r.stderr[-4000:]}")
        os.replace(tmp, lib)
    return lib


class _Lib:
    def __init__(self, path: Path):
        self.path = path
        self.dll = ctypes.CDLL(str(path))
        self.fns = {}
        i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        for cfg in CONFIGS:
            args_bytes = getattr(self.dll, f"dm_sm90_fprop_{cfg}_args_bytes")
            args_bytes.argtypes, args_bytes.restype = [i32], i64
            ws_bytes = getattr(self.dll, f"dm_sm90_fprop_{cfg}_workspace_bytes")
            ws_bytes.argtypes, ws_bytes.restype = [i32, i32], i64
            run = getattr(self.dll, f"dm_sm90_fprop_{cfg}_run")
            run.argtypes = [i32, i32, i32, vp, vp, vp, vp, vp, vp, i64, i32, i32, vp]
            run.restype = i32
            self.fns[cfg] = (args_bytes, ws_bytes, run)
        self.wgrad_fns = {}
        for cfg in WGRAD_CONFIGS:
            for dt in _WGRAD_DTYPES.values():
                name = f"dm_sm90_wgrad_{cfg}_{dt}"
                args_bytes = getattr(self.dll, f"{name}_args_bytes")
                args_bytes.argtypes, args_bytes.restype = [i32], i64
                ws_bytes = getattr(self.dll, f"{name}_workspace_bytes")
                ws_bytes.argtypes, ws_bytes.restype = [i32, i32], i64
                run = getattr(self.dll, f"{name}_run")
                run.argtypes = [i32, i32, i32, vp, vp, vp, vp, vp, vp, vp, i64, i32, i32, vp]
                run.restype = i32
                self.wgrad_fns[(cfg, dt)] = (args_bytes, ws_bytes, run)


@functools.lru_cache(maxsize=1)
def load_library() -> _Lib:
    return _Lib(build_library())


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
        if E != self.E:
            raise ValueError(f"w has {E} experts; this GEMM was built for {self.E}")
        if w.device != self.device:
            raise ValueError(f"w is on {w.device}, expected {self.device}")
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
        if E != self.E:
            raise ValueError(f"out has {E} experts; this GEMM was built for {self.E}")
        if out.device != self.device:
            raise ValueError(f"out is on {out.device}, expected {self.device}")
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
