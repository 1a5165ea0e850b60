"""CUTLASS's warp-specialized grouped FPROP and WGRAD GEMMs (csrc/grouped_gemm_sm90*.cu) on a
Hopper GPU.

Against fp64 oracles (`grouped_gemm_ref.grouped_mm_fwd_ref`, `grouped_mm_wgrad_ref`), with the
error bound of
test_grouped_gemm_gpu.py: bf16 outputs (u = 2^-8) from fp32 accumulation, so a correct kernel's
norm-wise relative error is ~2.3e-3; we require err <= 1e-2 and err <= 2 * err_torch + 1e-3
(err_torch: the same GEMM in fp32 torch, rounded to bf16; fp32 WGRAD outputs: err <= 1e-4).
Outputs are poisoned with NaN: rows inside [0, R) must be written, rows past R must stay NaN; a
WGRAD writes every expert's [M, N] block (zeros for an expert with no rows).

The FP8 block-scaled WGRAD (`GroupedFp8WgradSm90`) is checked against the torch twin of
`fp8_grouped_wgrad`: the same product on the dequantized column bundles (quant/fp8_block), in
fp64, with that check's bounds (tests/fp8_kernel_checks.py: norm-wise 1e-3 for fp32 out, 8e-3
for bf16). Its fp32 outputs are poisoned with NaN too, so a store that read its source operand
(beta = 0 must skip C) would fail.

The FP8 block-scaled FPROP (`GroupedFp8FpropSm90`) is checked against the torch twin of
`fp8_grouped_mm(epilogue="store")` (the dequantized row bundle times the dequantized weights, in
fp64; max error <= 4e-3 x max|ref|, tests/fp8_kernel_checks.py's bound for that kernel: one
bf16 unit and the FP8 tensor cores' block sums) and against our Triton kernel on the same
operands; rows past offsets[E] stay NaN.

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
from megatron_dist_moe.kernels.grouped_gemm.wgrad import ExpertOutTable  # noqa: E402
from megatron_dist_moe.kernels.rows import device_ptr  # noqa: E402
from megatron_dist_moe.layout import padded_rows  # noqa: E402
from megatron_dist_moe.quant import fp8_block as Q  # noqa: E402

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


# -- FP8 block-scaled WGRAD ----------------------------------------------------------------------
def _fp8_bundles(counts, M, N, seed=0, rows_cap=None):
    """Expert offsets and the column bundles of random a [R, M], b [R, N] (Rp of R, or of
    rows_cap when given: a graph's capacity)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, R = len(counts), sum(counts)
    offs = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32,
                        device="cuda")
    a = torch.randn(R, M, device="cuda", generator=g).to(BF16)
    b = (torch.randn(R, N, device="cuda", generator=g) * max(R, 1) ** -0.5).to(BF16)
    Rp = padded_rows(R, E)
    return offs, Q.quantize_cols(a, offs.long(), Rp), Q.quantize_cols(b, offs.long(), Rp)


def _fp8_twin(ac, bc, offs):
    """The torch twin of fp8_grouped_wgrad: A_e B_e^T over each padded segment of the
    dequantized bundles, in fp64; [E, M, N]."""
    po = Q.padded_offsets(offs).tolist()
    ad, bd = Q.dequantize_cols(*ac).double(), Q.dequantize_cols(*bc).double()   # [Rp, M / N]
    return torch.stack([ad[po[e]:po[e + 1]].T @ bd[po[e]:po[e + 1]]
                        for e in range(offs.numel() - 1)])


def _check_fp8_wgrad(out, ref, offs, prev=None):
    """out (the matrices, stacked) against the twin; prev: what accumulate added to."""
    got = out.double() if prev is None else out.double() - prev.double()
    assert not out.isnan().any(), "weight-gradient entries left unwritten"
    for e in range(out.shape[0]):
        if offs[e + 1] == offs[e]:
            want = 0 if prev is None else prev[e]
            assert (out[e] == want).all(), f"expert {e} has no rows: it must get exact zeros"
    if ref.norm() == 0:
        return
    err = _rel(got, ref)
    assert err <= (1e-3 if out.dtype == torch.float32 else 8e-3), err


@pytest.mark.parametrize("out_dtype", [BF16, torch.float32])
@pytest.mark.parametrize("config", sm90.FP8_WGRAD_CONFIGS)
@pytest.mark.parametrize("counts", [
    [256, 256, 256],                 # whole 128-token blocks
    [300, 0, 77, 1, 513],            # ragged, an empty expert, a single token
    [0, 0, 0],                       # no tokens at all: zeros everywhere
    [1000, 3, 0, 0, 129, 64, 7, 2],  # 8 experts, imbalanced
])
def test_fp8_wgrad_matches_twin(config, out_dtype, counts):
    M, N = 384, 512
    offs, ac, bc = _fp8_bundles(counts, M, N)
    out = torch.full((len(counts), M, N), float("nan"), dtype=out_dtype, device="cuda")
    sm90.GroupedFp8WgradSm90(len(counts), "cuda", config)(ac, bc, offs, out)
    torch.cuda.synchronize()
    _check_fp8_wgrad(out, _fp8_twin(ac, bc, offs), offs)


@pytest.mark.parametrize("config", sm90.FP8_WGRAD_CONFIGS)
@pytest.mark.parametrize("M, N", [(6144, 7168), (7168, 3072)], ids=["w13", "w2"])
def test_fp8_wgrad_guide_widths(config, M, N):
    """The guide's W13 / W2 WGRAD widths at fewer tokens, experts ragged, one empty."""
    offs, ac, bc = _fp8_bundles([700, 1500, 0, 333, 1029, 3], M, N, seed=4)
    out = torch.full((6, M, N), float("nan"), dtype=BF16, device="cuda")
    gemm = sm90.GroupedFp8WgradSm90(6, "cuda", config)
    gemm((device_ptr(ac[0]), device_ptr(ac[1])), bc, offs, out)   # device pointers work too
    torch.cuda.synchronize()
    _check_fp8_wgrad(out, _fp8_twin(ac, bc, offs), offs)


@pytest.mark.parametrize("config", sm90.FP8_WGRAD_CONFIGS)
def test_fp8_wgrad_accumulates_into_expert_table(config):
    """accumulate=True adds into per-expert fp32 matrices anywhere in memory (Megatron's
    main_grad); an expert without tokens leaves its matrix as it was."""
    counts, M, N = [300, 0, 77, 513], 256, 384
    offs, ac, bc = _fp8_bundles(counts, M, N, seed=7)
    g = torch.Generator(device="cuda").manual_seed(8)
    prev = torch.randn(len(counts), M, N, device="cuda", generator=g)
    accs = [prev[e].clone() for e in range(len(counts))]
    gemm = sm90.GroupedFp8WgradSm90(len(counts), "cuda", config)
    gemm(ac, bc, offs, ExpertOutTable.of(accs), accumulate=True)
    torch.cuda.synchronize()
    _check_fp8_wgrad(torch.stack(accs), _fp8_twin(ac, bc, offs), offs, prev=prev)
    # a plain store into the table: the previous values must not be read
    for t in accs:
        t.fill_(float("nan"))
    gemm(ac, bc, offs, ExpertOutTable.of(accs))
    torch.cuda.synchronize()
    _check_fp8_wgrad(torch.stack(accs), _fp8_twin(ac, bc, offs), offs)


@pytest.mark.parametrize("config", sm90.FP8_WGRAD_CONFIGS)
def test_fp8_wgrad_bf16_store_equals_rounded_fp32_store(config):
    """One mainloop for both out dtypes: the bf16 units round the fp32 units' sums once."""
    counts, M, N = [700, 1500, 0, 333, 1029, 3], 1024, 768
    offs, ac, bc = _fp8_bundles(counts, M, N, seed=6)
    out16 = torch.full((6, M, N), float("nan"), dtype=BF16, device="cuda")
    out32 = torch.full((6, M, N), float("nan"), dtype=torch.float32, device="cuda")
    gemm = sm90.GroupedFp8WgradSm90(6, "cuda", config)
    gemm(ac, bc, offs, out16)
    gemm(ac, bc, offs, out32)
    torch.cuda.synchronize()
    rounded = out32.to(BF16)
    assert torch.equal(out16, rounded), (
        f"bf16 store differs from the rounded fp32 store in {int((out16 != rounded).sum())} of "
        f"{rounded.numel()} values")


@pytest.mark.parametrize("config", sm90.FP8_WGRAD_CONFIGS)
def test_fp8_wgrad_in_cuda_graph_with_new_offsets(config):
    """Captured once, replayed with new device offsets: the padded segments, the row stride Rp
    of this call's R and the zero-block groups are all rebuilt on the device. The bundles live
    in capacity buffers, written with each call's Rp (as quantize_rows_cols writes them)."""
    M, N, E, cap = 256, 384, 4, 2000
    Rp_cap = padded_rows(cap, E)
    qa = torch.zeros(M, Rp_cap, dtype=torch.float8_e4m3fn, device="cuda")
    sa = torch.zeros(Rp_cap // 128, M, device="cuda")
    qb = torch.zeros(N, Rp_cap, dtype=torch.float8_e4m3fn, device="cuda")
    sb = torch.zeros(Rp_cap // 128, N, device="cuda")
    out = torch.empty(E, M, N, dtype=torch.float32, device="cuda")
    acc = [torch.zeros(M, N, device="cuda") for _ in range(E)]
    table = ExpertOutTable.of(acc)
    offs = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    gemm = sm90.GroupedFp8WgradSm90(E, "cuda", config)
    gemm((qa, sa), (qb, sb), offs, out)   # warm-up (module load, zero block) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm((qa, sa), (qb, sb), offs, out)
        gemm((qa, sa), (qb, sb), offs, table, accumulate=True)
    total = torch.zeros(E, M, N, dtype=torch.float64, device="cuda")
    for seed, counts in enumerate([[100, 0, 900, 17], [0, 1999, 0, 1], [5, 5, 5, 5]]):
        o, ac, bc = _fp8_bundles(counts, M, N, seed=seed)
        for dst, src in ((qa, ac[0]), (sa, ac[1]), (qb, bc[0]), (sb, bc[1])):
            dst.view(-1)[:src.numel()].copy_(src.reshape(-1))
        offs.copy_(o)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = _fp8_twin(ac, bc, o)
        _check_fp8_wgrad(out, ref, o)
        total += ref
        assert _rel(torch.stack(acc), total) <= 1e-3


def test_fp8_wgrad_rejects_bad_arguments():
    gemm = sm90.GroupedFp8WgradSm90(2, "cuda", sm90.FP8_WGRAD_CONFIGS[0])
    offs, ac, bc = _fp8_bundles([100, 60], 256, 128)
    out = torch.zeros(2, 256, 128, device="cuda")
    with pytest.raises(ValueError, match="out has 3 experts"):
        gemm(ac, bc, offs, torch.zeros(3, 256, 128, device="cuda"))
    with pytest.raises(ValueError, match="accumulate=True needs an fp32 out"):
        gemm(ac, bc, offs, out.to(BF16), accumulate=True)
    with pytest.raises(ValueError, match="out: dtype torch.float16"):
        gemm(ac, bc, offs, out.half())
    with pytest.raises(ValueError, match="multiples of 128"):
        gemm(ac, bc, offs, torch.zeros(2, 256, 136, device="cuda"))
    with pytest.raises(ValueError, match="b: 128 rows, expected out's N=256"):
        gemm(ac, bc, offs, torch.zeros(2, 256, 256, device="cuda"))
    with pytest.raises(ValueError, match="a: expected contiguous float8_e4m3fn"):
        gemm((ac[0].float(), ac[1]), bc, offs, out)
    with pytest.raises(ValueError, match="a scales: expected contiguous float32"):
        gemm((ac[0], ac[1][:-1]), bc, offs, out)
    with pytest.raises(ValueError, match="a: expected a column bundle"):
        gemm(ac[0], bc, offs, out)
    with pytest.raises(ValueError, match="differ"):
        gemm(ac, (torch.cat([bc[0], bc[0]], 1), torch.cat([bc[1], bc[1]], 0)), offs, out)
    with pytest.raises(ValueError, match="expert_offsets"):
        gemm(ac, bc, offs.long(), out)
    with pytest.raises(ValueError, match="config="):
        sm90.GroupedFp8WgradSm90(2, "cuda", "fastest")


# -- FP8 block-scaled FPROP ----------------------------------------------------------------------
def _fp8_fprop_problem(counts, N, K, seed=0, spare=37):
    """Offsets, the A row bundle of random rows [R + spare, K], FP8 weights [E, N, K] with their
    tile scales (quant/fp8_block), a NaN-poisoned bf16 out [R + spare, N], and R."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, R = len(counts), sum(counts)
    offs = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32,
                        device="cuda")
    # rows of very different magnitudes: the per-row, per-128 scales must be applied per row
    x = (torch.randn(R + spare, K, device="cuda", generator=g)
         * torch.logspace(-2, 2, R + spare, device="cuda")[:, None]).to(BF16)
    w = (torch.randn(E, N, K, device="cuda", generator=g) * K ** -0.5).to(BF16)
    wq, ws = Q.quantize_weight(w)
    out = torch.full((R + spare, N), float("nan"), dtype=BF16, device="cuda")
    return offs, Q.quantize_rows(x), wq, ws, out, R


def _fp8_fprop_twin(a, wq, ws, offs):
    """out[r] = dequant(a)[r] @ dequant(w[e])^T over each expert's rows, in fp64; [R, N]."""
    ad = Q.dequantize_rows(*a).double()
    wd = Q.dequantize_weight(wq, ws).double()
    o = offs.tolist()
    return torch.cat([ad[o[e]:o[e + 1]] @ wd[e].T for e in range(len(o) - 1)])


def _check_fp8_fprop(out, ref, R):
    assert not out[:R].isnan().any(), "rows of the experts left unwritten"
    assert out[R:].isnan().all(), "rows past offsets[E] were written"
    if R:
        err = ((out[:R].double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
        assert err <= 4e-3, err


@pytest.mark.parametrize("config", sm90.FP8_FPROP_CONFIGS)
@pytest.mark.parametrize("counts", [
    [256, 256, 256],                 # whole tiles
    [300, 0, 77, 1, 513],            # ragged, an empty expert, a single row
    [0, 0, 0],                       # no rows at all
    [1000, 3, 0, 0, 129, 64, 7, 2],  # 8 experts, imbalanced
    [1, 1, 1, 1, 1, 1],              # decode: one row per expert
])
def test_fp8_fprop_matches_twin(config, counts):
    N, K = 512, 384
    offs, a, wq, ws, out, R = _fp8_fprop_problem(counts, N, K)
    sm90.GroupedFp8FpropSm90(len(counts), "cuda", config)(a, wq, ws, offs, out)
    torch.cuda.synchronize()
    _check_fp8_fprop(out, _fp8_fprop_twin(a, wq, ws, offs), R)


@pytest.mark.parametrize("config", sm90.FP8_FPROP_CONFIGS)
@pytest.mark.parametrize("N, K", [(6144, 7168), (7168, 3072)], ids=["w13", "w2"])
def test_fp8_fprop_guide_widths_match_triton(config, N, K):
    """The guide's W13 / W2 FPROP widths, experts ragged and one empty: the twin's bound, and
    within one bf16 unit of our Triton kernel on the same operands (device pointers work)."""
    from megatron_dist_moe.kernels.grouped_gemm.fp8 import fp8_grouped_mm
    counts = [700, 1500, 0, 333, 1029, 3]
    offs, a, wq, ws, out, R = _fp8_fprop_problem(counts, N, K, seed=4)
    gemm = sm90.GroupedFp8FpropSm90(6, "cuda", config)
    gemm((device_ptr(a[0]), device_ptr(a[1])), wq, ws, offs, device_ptr(out))
    torch.cuda.synchronize()
    ref = _fp8_fprop_twin(a, wq, ws, offs)
    _check_fp8_fprop(out, ref, R)
    tri = torch.full_like(out, float("nan"))
    fp8_grouped_mm(a=a, w=wq, w_scales=ws, expert_offsets=offs, max_rows=R + 37,
                   epilogue="store", out=tri)
    torch.cuda.synchronize()
    diff = (out[:R].float() - tri[:R].float()).abs()
    unit = tri[:R].float().abs().clamp(min=1e-30) * 2.0 ** -7
    assert (diff <= unit + 1e-3 * ref.abs().max().item()).all(), diff.max().item()


@pytest.mark.parametrize("config", sm90.FP8_FPROP_CONFIGS)
def test_fp8_fprop_in_cuda_graph_with_new_offsets(config):
    """Captured once, replayed with new device offsets over capacity buffers: the groups'
    shapes, pointers and scale pointers are rebuilt on the device."""
    N, K, E, cap = 384, 512, 4, 2000
    qa = torch.zeros(cap, K, dtype=torch.float8_e4m3fn, device="cuda")
    sa = torch.zeros(cap, K // 128, device="cuda")
    out = torch.empty(cap, N, dtype=BF16, device="cuda")
    offs = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    _, _, wq, ws, _, _ = _fp8_fprop_problem([1] * E, N, K, seed=9)
    gemm = sm90.GroupedFp8FpropSm90(E, "cuda", config)
    gemm((qa, sa), wq, ws, offs, out)   # warm-up (module load) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm((qa, sa), wq, ws, offs, out)
    for seed, counts in enumerate([[100, 0, 900, 17], [0, 1999, 0, 1], [5, 5, 5, 5]]):
        o, a, _, _, _, R = _fp8_fprop_problem(counts, N, K, seed=seed, spare=0)
        qa[:R].copy_(a[0])
        sa[:R].copy_(a[1])
        offs.copy_(o)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_fp8_fprop(out, _fp8_fprop_twin((qa[:R], sa[:R]), wq, ws, o), R)


def test_fp8_fprop_rejects_bad_arguments():
    gemm = sm90.GroupedFp8FpropSm90(2, "cuda", sm90.FP8_FPROP_CONFIGS[0])
    offs, a, wq, ws, out, R = _fp8_fprop_problem([100, 60], 256, 384)
    with pytest.raises(ValueError, match="w has 3 experts"):
        gemm(a, torch.cat([wq, wq[:1]]), ws, offs, out)
    with pytest.raises(ValueError, match="w_scales: expected contiguous float32"):
        gemm(a, wq, ws[:, :1].contiguous(), offs, out)
    with pytest.raises(ValueError, match=r"a: expected contiguous float8_e4m3fn data \[R, 384\]"):
        gemm((a[0][:, :256].contiguous(), a[1]), wq, ws, offs, out)
    with pytest.raises(ValueError, match=r"out: expected bf16 \[R, 256\]"):
        gemm(a, wq, ws, offs, out.float())
    with pytest.raises(ValueError, match="expert_offsets"):
        gemm(a, wq, ws, offs.long(), out)
    with pytest.raises(ValueError, match="config="):
        sm90.GroupedFp8FpropSm90(2, "cuda", "fastest")
