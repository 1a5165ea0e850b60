"""Building the CUDA C++ libraries of csrc/ on first use (nvcc, no torch headers, ctypes).

Each library (the CUTLASS grouped GEMMs, the NVFP4 decode GEMM) is one set of translation
units compiled in parallel and linked into a shared library, cached under $DIST_MOE_CSRC_CACHE
(default ~/.cache/megatron_dist_moe/csrc) in a folder named by the hash of its sources, the
flags, `nvcc --version` and what the caller adds (CUTLASS's version.h). Ranks that start
together take a file lock: one builds, the others wait and load.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["NVCC_FLAGS", "csrc_dir", "nvcc_path", "cache_root", "build", "LoadProbe"]

NVCC_FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
              "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC")


def csrc_dir(marker: str) -> Path:
    """The csrc/ folder ($DIST_MOE_CSRC_DIR or the repository's), checked by one of its files."""
    d = Path(os.environ.get("DIST_MOE_CSRC_DIR", Path(__file__).resolve().parents[2] / "csrc"))
    if not (d / marker).is_file():
        raise FileNotFoundError(
            f"{d / marker} not found: the CUDA kernels build from the repository's csrc/ "
            "folder; install the package editable (pip install -e .) or set DIST_MOE_CSRC_DIR")
    return d


def nvcc_path() -> str:
    for cand in (os.environ.get("CUDACXX"),
                 os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc")
                 if os.environ.get("CUDA_HOME") else None,
                 shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand):
            return cand
    raise RuntimeError("nvcc not found ($CUDACXX, $CUDA_HOME/bin, PATH): the csrc/ kernels "
                       "are compiled on first use")


def cache_root() -> Path:
    return Path(os.environ.get("DIST_MOE_CSRC_CACHE",
                               Path.home() / ".cache" / "megatron_dist_moe" / "csrc"))


def cache_key(sources: Sequence[Path], flags: Sequence[str], nvcc: str, extra: bytes) -> str:
    h = hashlib.sha256()
    for p in sources:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.encode())
    h.update(extra)
    return h.hexdigest()[:16]


def build(lib_name: str, src: Path, units: Sequence[str], headers: Sequence[str],
          includes: Sequence[str] = (), flags: Sequence[str] = NVCC_FLAGS, key_extra: bytes = b"",
          what: str = "CUDA kernels", takes: str = "seconds", verbose: bool = False) -> Path:
    """Compile src/<unit>.cu for every unit (one nvcc per unit, as many at once as there are
    cores) and link lib<lib_name>.so; returns its path, reusing the cached build when the key
    (sources, flags, nvcc, key_extra) matches."""
    nvcc = nvcc_path()
    sources = [src / h for h in headers] + [src / f"{u}.cu" for u in units]
    out_dir = cache_root() / cache_key(sources, flags, nvcc, key_extra)
    lib = out_dir / f"lib{lib_name}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # another rank may be building the same key
        if lib.is_file():
            return lib
        # a first use can take minutes: say so once, where a user waits for it
        print(f"megatron_dist_moe: building the {what} of csrc/ ({len(units)} unit"
              f"{'s' if len(units) > 1 else ''} with {nvcc}: {takes}, once; cached in "
              f"{out_dir})", file=sys.stderr, flush=True)

        def compile_one(unit: str) -> Path:
            obj = out_dir / f"{unit}.o"
            cmd = [nvcc, *flags, *includes, f"-I{src}", "-c", str(src / f"{unit}.cu"), "-o",
                   str(obj)]
            if verbose:
                print(f"[{lib_name}]", " ".join(cmd), flush=True)
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"nvcc failed on {unit}.cu:\n{r.stderr[-4000:]}")
            return obj

        # each nvcc of a CUTLASS unit takes ~1.5 GB
        with ThreadPoolExecutor(max(1, min(len(units), os.cpu_count() or 1))) as pool:
            objs = list(pool.map(compile_one, units))
        tmp = out_dir / f"lib.{os.getpid()}.so"
        r = subprocess.run([nvcc, "-shared", "-o", str(tmp), *map(str, objs)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"linking lib{lib_name}.so failed:\n{r.stderr[-4000:]}")
        os.replace(tmp, lib)
    return lib


class LoadProbe:
    """Whether a csrc/ library runs on a device: a CUDA device of compute capability 9.0 (the
    libraries' sm_90a code), not the Triton interpreter, `precondition()` true (e.g. the
    headers it needs are present), and `load()` (build on first use, or load from the cache)
    succeeding. One attempt per process: a failure is kept in `error` and warns once with
    `fallback` (what runs instead), so a model of many layers neither rebuilds nor warns per
    layer."""

    def __init__(self, load: Callable[[], object], fallback: str,
                 precondition: Callable[[], bool] = lambda: True):
        self.load, self.fallback, self.precondition = load, fallback, precondition
        self.error: BaseException | None = None

    def __call__(self, device) -> bool:
        import warnings

        import torch

        from .common import interpreting
        if device.type != "cuda" or interpreting():
            return False
        if torch.cuda.get_device_capability(device) != (9, 0) or self.error is not None:
            return False
        if not self.precondition():
            return False
        try:
            self.load()
        except (RuntimeError, OSError) as err:
            self.error = err
            warnings.warn(f"{self.fallback}: {err}", stacklevel=3)
            return False
        return True

