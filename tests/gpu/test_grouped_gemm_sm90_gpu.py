"""CUTLASS's warp-specialized grouped FPROP and WGRAD GEMMs (csrc/grouped_gemm_sm90*.cu) on a
Hopper GPU.

Against fp64 oracles (`grouped_gemm_ref.grouped_mm_fwd_ref`, `grouped_mm_wgrad_ref`), with the
error bound of
test_grouped_gemm_gpu.py: bf16 outputs (u = 2^-8) from fp32 accumulation, so a correct kernel's
norm-wise relative error is ~2.3e-3; we require err <= 1e-2 and err <= 2 * err_torch + 1e-3
(err_torch: the same GEMM in fp32 torch, rounded to bf16; fp32 WGRAD outputs: err <= 1e-4).
Outputs are poisoned with NaN: rows inside [0, R) must be written, rows past R must stay NaN; a
WGRAD writes every expert's [M, N] block (zeros for an expert with no rows).

    pytest -m gpu tests/gpu/test_grouped_gemm_sm90_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

from megatron_dist_moe.kernels import grouped_gemm_sm90 as sm90  # noqa: E402
from megatron_dist_moe.kernels.grouped_gemm_ref import (  # noqa: E402
    grouped_mm_fwd_ref,
    grouped_mm_wgrad_ref,
)
from megatron_dist_moe.kernels.rows import device_ptr  # noqa: E402

if not sm90.available():
    pytest.skip("nvcc or the CUTLASS headers (nvidia-cutlass) are missing", allow_module_level=True)

BF16 = torch.bfloat16


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


def _problem(counts, N, K, seed=0, spare=37):
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, R = len(counts), sum(counts)
    offs = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32,
                        device="cuda")
    a = torch.randn(R + spare, K, device="cuda", generator=g).to(BF16)
    w = (torch.randn(E, N, K, device="cuda", generator=g) * K ** -0.5).to(BF16)
    out = torch.full((R + spare, N), float("nan"), dtype=BF16, device="cuda")
    return offs, a, w, out, R


def _check(out, a, w, offs, R):
    ref = grouped_mm_fwd_ref(a[:R], w, offs, out_dtype=torch.float64, compute_dtype=torch.float64)
    ref32 = grouped_mm_fwd_ref(a[:R], w, offs, out_dtype=BF16, compute_dtype=torch.float32)
    assert not out[:R].isnan().any(), "rows of the experts left unwritten"
    assert out[R:].isnan().all(), "rows past R were written"
    if R == 0:
        return
    err, err_torch = _rel(out[:R], ref), _rel(ref32, ref)
    assert err <= 1e-2 and err <= 2 * err_torch + 1e-3, (err, err_torch)


@pytest.mark.parametrize("config", sm90.CONFIGS)
@pytest.mark.parametrize("counts", [
    [256, 256, 256],                 # whole tiles
    [300, 0, 77, 1, 513],            # ragged, an empty expert, a single row
    [0, 0, 0],                       # nothing to do: nothing written
    [1000, 3, 0, 0, 129, 64, 7, 2],  # 8 experts, imbalanced
])
def test_fprop_matches_oracle(config, counts):
    N, K = 384, 512
    offs, a, w, out, R = _problem(counts, N, K)
    gemm = sm90.GroupedFpropSm90(len(counts), "cuda", config)
    gemm(w, offs, device_ptr(a), device_ptr(out))
    torch.cuda.synchronize()
    _check(out, a, w, offs, R)


@pytest.mark.parametrize("config", sm90.CONFIGS)
def test_fprop_guide_widths(config):
    """The W13 shape of the guide's load at fewer rows: N = 2F = 6144, K = D = 7168."""
    offs, a, w, out, R = _problem([700, 1500, 0, 333, 1024, 3], 6144, 7168, seed=3)
    gemm = sm90.GroupedFpropSm90(6, "cuda", config)
    gemm(w, offs, a, out)   # dense tensors are accepted too
    torch.cuda.synchronize()
    _check(out, a, w, offs, R)


def test_fprop_in_cuda_graph_with_new_offsets():
    """Captured once, replayed with new device offsets and inputs at the same addresses: the
    per-group arguments are rebuilt on the device on every replay (no host reads)."""
    N, K, E = 256, 384, 4
    cap = 2000
    a = torch.empty(cap, K, dtype=BF16, device="cuda")
    w = torch.empty(E, N, K, dtype=BF16, device="cuda")
    out = torch.empty(cap, N, dtype=BF16, device="cuda")
    offs = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    gemm = sm90.GroupedFpropSm90(E, "cuda", "coop")
    a_ptr, out_ptr = device_ptr(a), device_ptr(out)
    gemm(w, offs, a_ptr, out_ptr)   # warm-up (module load) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(w, offs, a_ptr, out_ptr)
    for seed, counts in enumerate([[100, 0, 900, 17], [0, 1999, 0, 1], [5, 5, 5, 5]]):
        o, a_new, w_new, _, R = _problem(counts, N, K, seed=seed, spare=cap - sum(counts))
        a.copy_(a_new)
        w.copy_(w_new)
        offs.copy_(o)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, a, w, offs, R)


def test_fprop_rejects_bad_arguments():
    gemm = sm90.GroupedFpropSm90(2, "cuda", "coop")
    offs, a, w, out, _ = _problem([8, 8], 64, 64)
    with pytest.raises(ValueError, match="w has 3 experts"):
        gemm(torch.zeros(3, 64, 64, dtype=BF16, device="cuda"), offs, a, out)
    with pytest.raises(ValueError, match="expert_offsets"):
        gemm(w, offs.long(), a, out)
    with pytest.raises(ValueError, match="multiples of 8"):
        gemm(torch.zeros(2, 60, 64, dtype=BF16, device="cuda"), offs, a, out)
    with pytest.raises(ValueError, match="a: expected a device pointer"):
        gemm(w, offs, a.float(), out)
    with pytest.raises(ValueError, match="config="):
        sm90.GroupedFpropSm90(2, "cuda", "fastest")


# -- WGRAD ---------------------------------------------------------------------------------------
def _wgrad_problem(counts, M, N, out_dtype, seed=0, spare=21):
    g = torch.Generator(device="cuda").manual_seed(seed)
    R = sum(counts)
    offs = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32,
                        device="cuda")
    a = torch.randn(R + spare, M, device="cuda", generator=g).to(BF16)
    b = (torch.randn(R + spare, N, device="cuda", generator=g) * max(R, 1) ** -0.5).to(BF16)
    out = torch.full((len(counts), M, N), float("nan"), dtype=out_dtype, device="cuda")
    return offs, a, b, out, R


def _check_wgrad(out, a, b, offs, R):
    ref = grouped_mm_wgrad_ref(a[:R], b[:R], offs, out_dtype=torch.float64,
                               compute_dtype=torch.float64)
    assert not out.isnan().any(), "weight-gradient entries left unwritten"
    for e in range(out.shape[0]):
        if offs[e + 1] == offs[e]:
            assert (out[e] == 0).all(), f"expert {e} has no rows: its gradient must be exact zeros"
    if out.dtype == torch.float32:
        assert _rel(out, ref) <= 1e-4, _rel(out, ref)
        return
    ref32 = grouped_mm_wgrad_ref(a[:R], b[:R], offs, out_dtype=BF16, compute_dtype=torch.float32)
    err, err_torch = _rel(out, ref), _rel(ref32, ref)
    assert err <= 1e-2 and err <= 2 * err_torch + 1e-3, (err, err_torch)


@pytest.mark.parametrize("out_dtype", [BF16, torch.float32])
@pytest.mark.parametrize("config", sm90.WGRAD_CONFIGS)
@pytest.mark.parametrize("counts", [
    [256, 256, 256],                 # whole K tiles
    [300, 0, 77, 1, 513],            # ragged K, an empty expert, a single row
    [0, 0, 0],                       # no rows at all: zeros everywhere
    [1000, 3, 0, 0, 129, 64, 7, 2],  # 8 experts, imbalanced
])
def test_wgrad_matches_oracle(config, out_dtype, counts):
    M, N = 384, 512
    offs, a, b, out, R = _wgrad_problem(counts, M, N, out_dtype)
    gemm = sm90.GroupedWgradSm90(len(counts), "cuda", config, out_dtype)
    gemm(device_ptr(a), device_ptr(b), offs, out)
    torch.cuda.synchronize()
    _check_wgrad(out, a, b, offs, R)


@pytest.mark.parametrize("config", sm90.WGRAD_CONFIGS)
def test_wgrad_guide_widths(config):
    """The guide's W2 WGRAD (M = D = 7168, N = F = 3072) at fewer rows, experts ragged."""
    offs, a, b, out, R = _wgrad_problem([700, 1500, 0, 333, 1029, 3], 7168, 3072, BF16, seed=4)
    gemm = sm90.GroupedWgradSm90(6, "cuda", config)
    gemm(a, b, offs, out)   # dense tensors are accepted too
    torch.cuda.synchronize()
    _check_wgrad(out, a, b, offs, R)


@pytest.mark.parametrize("config", sm90.WGRAD_CONFIGS)
def test_wgrad_bf16_store_equals_rounded_fp32_store(config):
    """As for the Triton WGRAD: the bf16 unit's epilogue rounds the fp32 sums once, so its output
    equals the fp32 unit's rounded to bf16, bit for bit (what experts.wgrad_store_dtype relies on)."""
    counts = [700, 1500, 0, 333, 1029, 3]
    offs, a, b, out16, R = _wgrad_problem(counts, 1024, 768, BF16, seed=6)
    out32 = torch.full(out16.shape, float("nan"), dtype=torch.float32, device="cuda")
    sm90.GroupedWgradSm90(6, "cuda", config, BF16)(a, b, offs, out16)
    sm90.GroupedWgradSm90(6, "cuda", config, torch.float32)(a, b, offs, out32)
    torch.cuda.synchronize()
    rounded = out32.to(BF16)
    assert torch.equal(out16, rounded), (
        f"bf16 store differs from the rounded fp32 store in {int((out16 != rounded).sum())} of "
        f"{rounded.numel()} values")


def test_wgrad_in_cuda_graph_with_new_offsets():
    M, N, E, cap = 256, 384, 4, 2000
    a = torch.empty(cap, M, dtype=BF16, device="cuda")
    b = torch.empty(cap, N, dtype=BF16, device="cuda")
    out = torch.empty(E, M, N, dtype=BF16, device="cuda")
    offs = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    gemm = sm90.GroupedWgradSm90(E, "cuda", "coop")
    a_ptr, b_ptr = device_ptr(a), device_ptr(b)
    gemm(a_ptr, b_ptr, offs, out)   # warm-up (module load, zero block) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(a_ptr, b_ptr, offs, out)
    for seed, counts in enumerate([[100, 0, 900, 17], [0, 1999, 0, 1], [5, 5, 5, 5]]):
        o, a_new, b_new, _, R = _wgrad_problem(counts, M, N, BF16, seed=seed,
                                               spare=cap - sum(counts))
        a.copy_(a_new)
        b.copy_(b_new)
        offs.copy_(o)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_wgrad(out, a, b, offs, R)


def test_wgrad_rejects_bad_arguments():
    gemm = sm90.GroupedWgradSm90(2, "cuda", "coop")
    offs, a, b, out, _ = _wgrad_problem([8, 8], 64, 64, BF16)
    with pytest.raises(ValueError, match="out has 3 experts"):
        gemm(a, b, offs, torch.zeros(3, 64, 64, dtype=BF16, device="cuda"))
    with pytest.raises(ValueError, match="out: expected a contiguous torch.bfloat16"):
        gemm(a, b, offs, out.float())
    with pytest.raises(ValueError, match="multiples of 8"):
        gemm(a, b, offs, torch.zeros(2, 60, 64, dtype=BF16, device="cuda"))
    with pytest.raises(ValueError, match="expert_offsets"):
        gemm(a, b, offs.long(), out)
    with pytest.raises(ValueError, match="b: expected a device pointer"):
        gemm(a, b.float(), offs, out)
    with pytest.raises(ValueError, match="out_dtype="):
        sm90.GroupedWgradSm90(2, "cuda", "coop", torch.float16)
