"""CUTLASS's warp-specialized grouped FPROP GEMM (csrc/grouped_gemm_sm90*.cu) on a Hopper GPU.

Against an fp64 oracle (`grouped_gemm_ref.grouped_mm_fwd_ref`), with the error bound of
test_grouped_gemm_gpu.py: bf16 outputs (u = 2^-8) from fp32 accumulation, so a correct kernel's
norm-wise relative error is ~2.3e-3; we require err <= 1e-2 and err <= 2 * err_torch + 1e-3
(err_torch: the same GEMM in fp32 torch, rounded to bf16). Outputs are poisoned with NaN: rows
inside [0, R) must be written, rows past R must stay NaN.

    pytest -m gpu tests/gpu/test_grouped_gemm_sm90_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

from megatron_dist_moe.kernels import grouped_gemm_sm90 as sm90  # noqa: E402
from megatron_dist_moe.kernels.grouped_gemm_ref import grouped_mm_fwd_ref  # noqa: E402
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
