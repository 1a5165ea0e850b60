"""csrc/: the CUTLASS grouped GEMM library builds for sm_90a here (no GPU needed) and exports
its entry points; its Python wrapper rejects what it cannot run, with the argument named.

The build compiles every tile configuration (bf16 FPROP / WGRAD, the FP8 WGRAD and FP8 FPROP
units; about 9-15 minutes on 2 cores) into a temporary
cache folder, then calls the library's host-only functions (argument-block and workspace
sizes). Skipped where nvcc or the CUTLASS headers (`pip install nvidia-cutlass`, in the dev
extra) are missing. The kernels themselves run in tests/gpu/test_grouped_gemm_sm90_gpu.py.
"""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest
import torch

from megatron_dist_moe.kernels import grouped_gemm_sm90 as sm90

needs_build = pytest.mark.skipif(not sm90.available(),
                                 reason="nvcc or the CUTLASS headers are missing")


@needs_build
@pytest.mark.slow
@pytest.mark.timeout(2400)   # seven nvcc units (three FP8): 9-15 min on 2 cores, past the 900 s default
def test_library_builds_and_exports_every_unit(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_CSRC_CACHE", str(tmp_path))
    lib_path = sm90.build_library()
    assert lib_path.is_file() and tmp_path in lib_path.parents
    assert sm90.build_library() == lib_path          # cached: same key, no rebuild
    lib = sm90._Lib(lib_path)
    for cfg in sm90.CONFIGS:
        args_bytes, ws_bytes, run = lib.fns[cfg]
        # 3 pointer arrays + 3 stride arrays + the shapes, each 16-byte aligned
        assert args_bytes(6) >= 6 * (3 * 8 + 3 * 8 + 3 * 4)
        assert args_bytes(6) % 16 == 0 and args_bytes(12) > args_bytes(6)
        # the ptr-array kernels keep per-SM TMA descriptors in the workspace
        assert ws_bytes(6, 132) > 0 and ws_bytes(6, 132) >= ws_bytes(6, 66)
        # bad shapes are refused before anything is launched (no GPU touched)
        null = ctypes.c_void_p(0)
        assert run(6, 100, 7168, null, null, null, null, null, null, 0, 0, 132, null) == 1
        assert run(0, 128, 128, null, null, null, null, null, null, 0, 0, 132, null) == 1
    assert sorted(lib.wgrad_fns) == sorted((c, d) for c in sm90.WGRAD_CONFIGS
                                           for d in ("bf16", "f32"))
    for (cfg, dt), (args_bytes, ws_bytes, run) in lib.wgrad_fns.items():
        assert args_bytes(6) >= 6 * (3 * 8 + 3 * 8 + 3 * 4) and args_bytes(6) % 16 == 0
        assert ws_bytes(6, 132) > 0
        null = ctypes.c_void_p(0)
        # M (the contiguous dimension of a) must be a multiple of 8, and E >= 1
        assert run(6, 100, 512, null, null, null, null, null, null, null, 0, 0, 132, null) == 1
        assert run(0, 128, 128, null, null, null, null, null, null, null, 0, 0, 132, null) == 1
    assert sorted(lib.fp8_wgrad_fns) == sorted((c, d) for c in sm90.FP8_WGRAD_CONFIGS
                                               for d in ("bf16", "f32"))
    for (cfg, dt), (args_bytes, ws_bytes, zero_bytes, run) in lib.fp8_wgrad_fns.items():
        # 6 pointer arrays + 3 stride arrays + 2 scale layouts + the shapes, 16-byte aligned
        assert args_bytes(6) >= 6 * (6 * 8 + 3 * 8 + 3 * 4) and args_bytes(6) % 16 == 0
        assert args_bytes(12) > args_bytes(6)
        assert ws_bytes(6, 132) > 0 and ws_bytes(6, 132) >= ws_bytes(6, 66)
        # an empty expert reads max(M, N) rows of 128 zero bytes
        assert zero_bytes(6144, 7168) == 7168 * 128 and zero_bytes(7168, 3072) == 7168 * 128
        null = ctypes.c_void_p(0)

        def fp8_run(E, M, N, rp_cap, accumulate=0, run=run):
            return run(E, M, N, rp_cap, null, null, null, null, null, null, null, accumulate,
                       null, null, null, 0, 0, 132, null)
        # refused before anything is launched: M or N not a multiple of 16, E < 1, an Rp that
        # is not a multiple of 128
        assert fp8_run(6, 100, 512, 1024) == 1
        assert fp8_run(6, 512, 520, 1024) == 1
        assert fp8_run(0, 128, 128, 1024) == 1
        assert fp8_run(6, 128, 128, 1000) == 1
        assert fp8_run(6, 128, 128, -128) == 1
        # the bf16 units have no source operand: accumulate is refused; the f32 units pass the
        # checks and then find the workspace (0 bytes here) too small
        assert fp8_run(6, 128, 128, 1024, accumulate=1) == (1 if dt == "bf16" else 2)
        assert fp8_run(6, 128, 128, 1024) == 2
    assert sorted(lib.fp8_fprop_fns) == sorted(sm90.FP8_FPROP_CONFIGS)
    for cfg, (args_bytes, ws_bytes, run) in lib.fp8_fprop_fns.items():
        assert args_bytes(6) >= 6 * (6 * 8 + 3 * 8 + 3 * 4) and args_bytes(6) % 16 == 0
        assert args_bytes(12) > args_bytes(6)
        assert ws_bytes(6, 132) > 0 and ws_bytes(6, 132) >= ws_bytes(6, 66)
        null = ctypes.c_void_p(0)

        def fprop_run(E, N, K, r_cap=-1, run=run):
            return run(E, N, K, r_cap, null, null, null, null, null, null, null, null, 0, 0,
                       132, null)
        # refused before anything is launched: N or K not a multiple of 128, E < 1, a row
        # bound below -1 (-1: unknown)
        assert fprop_run(6, 6144, 7100) == 1
        assert fprop_run(6, 6100, 7168) == 1
        assert fprop_run(0, 6144, 7168) == 1
        assert fprop_run(6, 6144, 7168, r_cap=-2) == 1
        # valid shapes pass the checks and then find the workspace (0 bytes here) too small
        assert fprop_run(6, 6144, 7168) == 2
        assert fprop_run(6, 6144, 7168, r_cap=0) == 2


def test_cache_key_follows_the_sources(tmp_path, monkeypatch):
    if not sm90.available():
        pytest.skip("nvcc or the CUTLASS headers are missing")
    src = tmp_path / "csrc"
    src.mkdir()
    for p in sm90._sources():
        (src / p.name).write_bytes(p.read_bytes())
    monkeypatch.setenv("DIST_MOE_CSRC_DIR", str(src))
    nvcc, cutlass = sm90.nvcc_path(), sm90.cutlass_dir()
    key = sm90._cache_key(nvcc, cutlass)
    (src / "grouped_gemm_sm90_coop.cu").write_text(
        (src / "grouped_gemm_sm90_coop.cu").read_text() + "\n// changed\n")
    assert sm90._cache_key(nvcc, cutlass) != key


def test_wrapper_names_what_it_cannot_run(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="config='fastest'"):
        sm90.GroupedFpropSm90(2, "cpu", "fastest")
    with pytest.raises(ValueError, match="device=cpu"):
        sm90.GroupedFpropSm90(2, torch.device("cpu"))
    with pytest.raises(ValueError, match="config='fastest'"):
        sm90.GroupedWgradSm90(2, "cpu", "fastest")
    with pytest.raises(ValueError, match="out_dtype=torch.float16"):
        sm90.GroupedWgradSm90(2, "cpu", "coop", torch.float16)
    with pytest.raises(ValueError, match="device=cpu"):
        sm90.GroupedWgradSm90(2, "cpu", "coop")
    with pytest.raises(ValueError, match="config='fastest'"):
        sm90.GroupedFp8WgradSm90(2, "cpu", "fastest")
    with pytest.raises(ValueError, match="device=cpu"):
        sm90.GroupedFp8WgradSm90(2, "cpu", sm90.FP8_WGRAD_CONFIGS[0])
    with pytest.raises(ValueError, match="config='fastest'"):
        sm90.GroupedFp8FpropSm90(2, "cpu", "fastest")
    with pytest.raises(ValueError, match="device=cpu"):
        sm90.GroupedFp8FpropSm90(2, "cpu", sm90.FP8_FPROP_CONFIGS[0])
    monkeypatch.setenv("DIST_MOE_CSRC_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="DIST_MOE_CSRC_DIR"):
        sm90.csrc_dir()
    monkeypatch.setenv("DIST_MOE_CUTLASS_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="no include/cutlass/cutlass.h"):
        sm90.cutlass_dir()


def _built(cls, E: int, **attrs):
    """An instance of a wrapper as built for E experts on cpu, without its library (the
    checks below run before anything is launched)."""
    gemm = object.__new__(cls)
    gemm.E, gemm.device = E, torch.device("cpu")
    for k, v in attrs.items():
        setattr(gemm, k, v)
    return gemm


def test_wrappers_check_the_experts_and_device_they_were_built_for():
    """Every wrapper's operand check names the argument (all three share one check; a missing
    method crashed the FP8 WGRAD's first call on the GPU)."""
    w = torch.zeros(3, 128, 128, dtype=torch.bfloat16)
    offs = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="w has 3 experts; this GEMM was built for 2"):
        _built(sm90.GroupedFpropSm90, 2, config="coop")(w, offs, w[0], w[0])
    with pytest.raises(ValueError, match="out has 3 experts; this GEMM was built for 2"):
        _built(sm90.GroupedWgradSm90, 2, config="coop", out_dtype=torch.bfloat16)(
            w[0], w[0], offs, w)
    fp8 = _built(sm90.GroupedFp8WgradSm90, 2, config=sm90.FP8_WGRAD_CONFIGS[0])
    with pytest.raises(ValueError, match="out has 3 experts; this GEMM was built for 2"):
        fp8._out(w, accumulate=False)
    assert fp8._out(w[:2].contiguous(), accumulate=False)[2:] == (torch.bfloat16, 128, 128)
    fp8.device = torch.device("meta")
    with pytest.raises(ValueError, match="out is on cpu, expected meta"):
        fp8._out(w[:2].contiguous(), accumulate=False)


def test_fp8_fprop_wrapper_names_the_bad_argument():
    """GroupedFp8FpropSm90 checks every operand against the contract of
    fp8_grouped_mm(epilogue="store") before anything reaches the library."""
    f8 = torch.float8_e4m3fn
    E, N, K, R = 2, 256, 384, 40
    fprop = _built(sm90.GroupedFp8FpropSm90, E, config=sm90.FP8_FPROP_CONFIGS[0])
    w = torch.zeros(E, N, K, dtype=f8)
    ws = torch.zeros(E, N // 128, K // 128)
    offs = torch.tensor([0, 16, R], dtype=torch.int32)
    a = (torch.zeros(R, K, dtype=f8), torch.zeros(R, K // 128))
    out = torch.zeros(R, N, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="w: expected a contiguous float8_e4m3fn"):
        fprop(a, w.float(), ws, offs, out)
    with pytest.raises(ValueError, match="w has 3 experts; this GEMM was built for 2"):
        fprop(a, torch.zeros(3, N, K, dtype=f8), ws, offs, out)
    with pytest.raises(ValueError, match="N=200 and K=384 must be multiples of 128"):
        fprop(a, torch.zeros(E, 200, K, dtype=f8), ws, offs, out)
    with pytest.raises(ValueError, match=r"w_scales: expected contiguous float32 \[2, 2, 3\]"):
        fprop(a, w, ws[:, :1], offs, out)
    with pytest.raises(ValueError, match=r"expert_offsets: expected int32 \[3\]"):
        fprop(a, w, ws, offs[:2], out)
    with pytest.raises(ValueError, match=r"a: expected contiguous float8_e4m3fn data \[R, 384\]"):
        fprop((a[0][:, :128].contiguous(), a[1]), w, ws, offs, out)
    with pytest.raises(ValueError, match=r"a scales: expected contiguous float32 \[R, 3\]"):
        fprop((a[0], a[1][:, :2].contiguous()), w, ws, offs, out)
    with pytest.raises(ValueError, match="a: 40 data rows but 39 scale rows"):
        fprop((a[0], a[1][:39]), w, ws, offs, out)
    with pytest.raises(ValueError, match="a: data and scales must both be tensors or both"):
        fprop((a[0], torch.zeros(1, dtype=torch.int64)), w, ws, offs, out)
    with pytest.raises(ValueError, match=r"out: expected bf16 \[R, 256\]"):
        fprop(a, w, ws, offs, out.float())


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDACXX"),
                    reason="nvcc is missing")
def test_nvfp4_decode_library_builds_and_refuses_bad_shapes(tmp_path, monkeypatch):
    """The NVFP4 GEMMs' own library (two units, no CUTLASS) builds here in seconds, lists
    both GEMMs' variants, and their entry points refuse bad shapes before launching anything."""
    from megatron_dist_moe.kernels.grouped_gemm import nvfp4_decode as nd
    monkeypatch.setenv("DIST_MOE_CSRC_CACHE", str(tmp_path))
    nd._lib.cache_clear()
    nd._dll.cache_clear()
    try:
        path = nd.build_library()
        assert path.is_file() and tmp_path in path.parents and nd.build_library() == path
        codes = nd.variants()
        for n in (1, 8, 16):    # the defaults are instances of the library
            for K in (3072, 7168):
                assert nd.default_variant(6 * n, 6, K) in codes
        assert nd.default_variant(6 * 17, 6, 7168) is None
        run = nd._run_fn()
        null = None
        good = dict(variant=codes[0], E=6, N=6144, K=7168, stride=4048)

        def call(**kw):
            a = {**good, **kw}
            out = ctypes.c_void_p(16) if kw.get("out", True) else None
            rows = ctypes.c_void_p(16) if kw.get("rows", False) else None
            return run(a["variant"], a["E"], a["N"], a["K"], a["stride"], null, null, null, null,
                       null, null, out, rows, null)
        assert call(N=100) == 1 and call(K=7000) == 1 and call(E=0) == 1
        assert call(stride=4046) == 1 and call(variant=1) == 1
        assert call(rows=True) == 1 and call(out=False) == 1      # exactly one epilogue
        assert "32 weight rows per warp" in nd.describe(32142)
        # the wgmma GEMM, in the same library: its defaults are instances, bad shapes refused
        from megatron_dist_moe.kernels.grouped_gemm import nvfp4_wgmma as nw
        wcodes = nw.variants()
        assert wcodes and all(nw.is_variant(c) for c in wcodes)
        assert not any(nw.is_variant(c) for c in codes)
        for n in (33, 48, 64, 160, 161, 2048):
            assert nw.cuda_variant(6 * n, 6, 7168) in wcodes
        wrun = nd._lib()["nvfp4_wgmma_mm"][0]
        assert wrun(wcodes[0], 257, 6144, 7168, 4048, null, null, null, null, null, null,
                    ctypes.c_void_p(16), null, null, null, 0) == 1      # more than 256 experts
        assert wrun(wcodes[0], 6, 6144, 7000, 4048, null, null, null, null, null, null,
                    ctypes.c_void_p(16), null, null, null, 0) == 1
        assert "256 weight rows x 128 token rows" in nw.describe(5012824)
        # stream-K variants: a workspace (status word, flags, fp32 tiles), refused without
        sk = [c for c in wcodes if nw.variant_shape(c)["stream_k"]]
        assert sk and "stream-K" in nw.describe(sk[0])
        max_blocks_per_sm = 2   # the library's kMaxBlocksPerSm: the flags' region is sized by it
        for c in wcodes:   # the library's sizing against the layout written out here
            v = nw.variant_shape(c)
            blocks = 132 * v["blocks_per_sm"]   # flags for the largest grid: tiles at one offset
            assert nw.workspace_bytes(c, 132) == (
                64 + -(-4 * 132 * max_blocks_per_sm // 16) * 16
                + blocks * v["weight_rows"] * v["token_rows"] * 4 if v["stream_k"] else 0)
            assert nd._dll().dm_nvfp4_wgmma_mm_workspace(c, 132) == nw.workspace_bytes(c, 132)
        assert nd._dll().dm_nvfp4_wgmma_mm_workspace(codes[0], 132) == -1
        assert wrun(sk[0], 6, 6144, 7168, 4048, null, null, null, null, null, null,
                    ctypes.c_void_p(16), null, null, null, 0) == 1      # no workspace
        assert wrun(sk[0], 6, 6144, 7168, 4048, null, null, null, null, null, null,
                    ctypes.c_void_p(16), null, null, ctypes.c_void_p(24), 1) == 1   # misaligned
    finally:
        nd._lib.cache_clear()
        nd._dll.cache_clear()


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDACXX"),
                    reason="nvcc is missing")
def test_fp8_block_quantizer_library_builds_and_refuses_bad_arguments(tmp_path, monkeypatch):
    """fp8_block's CUDA quantizing kernels (one unit, no CUTLASS) build here in seconds, and
    both entry points refuse bad arguments before launching anything (status 1)."""
    from megatron_dist_moe.kernels import quant_fp8_cuda as qc
    monkeypatch.setenv("DIST_MOE_CSRC_CACHE", str(tmp_path))
    qc._lib.cache_clear()
    try:
        path = qc.build_library()
        assert path.is_file() and tmp_path in path.parents and qc.build_library() == path
        run = qc._lib().dm_fp8_block_quant_run
        p = ctypes.c_void_p(16)

        def call(K=7168, E=6, n_pb=100, x=p, rows=None, q=p, s=p, qt=p, st=p):
            return run(K, E, n_pb, x, rows, p, q, s, qt, st, 0, 0.0, None)
        assert call(K=7000) == 1 and call(K=0) == 1 and call(E=0) == 1 and call(n_pb=0) == 1
        assert call(x=None) == 1 and call(rows=p) == 1       # exactly one of x and row_ptrs
        assert call(q=None) == 1 and call(st=None) == 1      # a bundle is both of its tensors
        assert call(q=None, s=None, qt=None, st=None) == 1   # no bundle
        assert call(n_pb=2 ** 40) == 1                       # more blocks than a grid holds

        # the SwiGLU backward + quantization entry point
        bwd = qc._lib().dm_fp8_block_swiglu_bwd_quant_run

        def call_bwd(F=3072, E=6, n_pb=100, scores=None, part_cols=128, null_at=None):
            ptrs = [None if i == null_at else p for i in range(10)]
            return bwd(F, E, n_pb, *ptrs, scores, 0, 0, part_cols, 0, 1.702, 7.0, 0, 0.0, None)
        assert call_bwd(F=3000) == 1 and call_bwd(F=0) == 1 and call_bwd(E=0) == 1
        assert all(call_bwd(null_at=i) == 1 for i in range(10))   # every operand is needed
        assert call_bwd(n_pb=0) == 1 and call_bwd(n_pb=2 ** 40) == 1
        for part_cols in (0, 8, 48, 256):                     # with scores: 16..128 dividing 128
            assert call_bwd(scores=p, part_cols=part_cols) == 1
    finally:
        qc._lib.cache_clear()
