"""Checks of the nvfp4 kernels (kernels/quant_nvfp4.py) against their torch twins
(quant/nvfp4.py), on any device: byte rows bit-equal, on rows with 40 binades of spread, zero
rows, E2M1 ties, NaN and inf. Run by tests/cpu/test_kernel_checks_interp.py (Triton's
interpreter) and tests/gpu/test_kernel_checks_gpu.py (sm_90; tests/kernel_checks.py). Each check_* takes (device, big).
"""

from __future__ import annotations

import torch


from megatron_dist_moe.activation import Activation
from megatron_dist_moe import memory_plan as MP
from megatron_dist_moe.layout import nvfp4_row_bytes
from megatron_dist_moe.quant import nvfp4 as NV
from kernel_checks import close as _close  # noqa: E402  (tests/ on sys.path)

BF = torch.bfloat16


def _bits_equal(name, got, want, K):
    got, want = got.cpu(), want.cpu()
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        r, c = (int(v) for v in bad[0])
        part = "packed" if c < K // 2 else "scales" if c < K // 2 + K // 16 else "S_dec/pad"
        raise AssertionError(f"{name}: {bad.shape[0]} bytes differ from the twin (first: row "
                             f"{r}, byte {c}, {part}: {int(got[r, c])} vs {int(want[r, c])})")


def _check_s_dec_only(name, got, full, K, fill):
    """got: byte rows written with s_dec_only (over `fill`): each row's S_dec and pad equal the
    full rows', its packed values and block scales untouched."""
    got, full = got.cpu(), full.cpu()
    body = K // 2 + K // 16
    assert (got[:, :body] == fill).all(), f"{name}: s_dec_only wrote packed values or scales"
    assert torch.equal(got[:, body:], full[:, body:]), f"{name}: s_dec_only's S_dec / pad differ"


def rows_of(R, K, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, K, generator=g)
    x = x * torch.exp2(torch.randint(-20, 21, (R, K), generator=g).float())
    x[1] = 0                                               # a zero row
    x[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 2) * 100
    x[3, 5] = float("nan")
    x[3, 32:48] = float("nan")                             # an all-NaN 16-value block
    x[4, 9] = float("inf")
    x[5] *= 2.0 ** -40
    return x.to(BF).to(device)


def check_quantize_rows(device, big=False):
    from megatron_dist_moe.kernels.quant_nvfp4 import quantize_rows
    for K in ((7168, 3072) if big else (256, 192)):
        R = 300 if big else 23
        x = rows_of(R, K, seed=K, device=device)
        out = torch.full((R + 2, nvfp4_row_bytes(K)), 0xAB, dtype=torch.uint8, device=device)
        quantize_rows(x, torch.tensor([R], dtype=torch.int32, device=device), R + 2, K, out=out)
        _bits_equal(f"rows K={K}", out[:R], NV.quantize_row_bytes(x.cpu()), K)
        assert (out[R:] == 0xAB).all(), "rows past num_rows written"
        # with a16 (the dense GEMM's h2), then with only S_dec stored: the same a16 bits
        n = torch.tensor([R], dtype=torch.int32, device=device)
        a16 = torch.full((R + 2, K), 3.0, dtype=torch.float16, device=device)
        order = "fragment" if K % 128 == 0 else "k"
        quantize_rows(x, n, R + 2, K, out=out, a16=a16, a16_order=order)
        _bits_equal(f"rows K={K} with a16", out[:R], NV.quantize_row_bytes(x.cpu()), K)
        out_s = torch.full_like(out, 0xAB)
        a16_s = torch.full_like(a16, 3.0)
        quantize_rows(x, n, R + 2, K, out=out_s, a16=a16_s, a16_order=order, s_dec_only=True)
        assert torch.equal(a16_s.view(torch.int16), a16.view(torch.int16)), (
            f"K={K}: s_dec_only changed quantize_rows' a16")
        _check_s_dec_only(f"rows K={K}", out_s[:R], out[:R], K, 0xAB)
        assert (out_s[R:] == 0xAB).all() and (a16_s[R:] == 3.0).all(), "s_dec_only: past R"


def check_publish_quantized(device, big=False):
    """The source rank's one-launch publication: header [T, schedule word -1 (inference)], int16
    IDs, byte rows 2K bytes apart, bit-equal to quantize_rows' rows; nothing past T written."""
    from megatron_dist_moe.kernels.quant_nvfp4 import publish_quantized
    K, KI = (7168, 6) if big else (256, 3)
    for T in ((1, 8, 300) if big else (1, 5, 0)):
        x = rows_of(max(T, 6), K, seed=T, device=device)[:T].contiguous()
        ids = torch.randint(-1, 20, (T, KI), device=device)
        header = torch.full((2,), -7, dtype=torch.int32, device=device)
        ids16 = torch.full((T + 2, KI), 99, dtype=torch.int16, device=device)
        disp = torch.full((T + 2, 2 * K), 0xAB, dtype=torch.uint8, device=device)
        publish_quantized(x, ids, header, ids16, disp.view(torch.bfloat16), out_stride=2 * K)
        assert header.tolist() == [T, -1], f"T={T}: header {header.tolist()}"
        assert torch.equal(ids16[:T].long().cpu(), ids.cpu()), f"T={T}: ids differ"
        assert (ids16[T:] == 99).all() and (disp[T:] == 0xAB).all(), f"T={T}: past T written"
        W = nvfp4_row_bytes(K)
        if T:
            _bits_equal(f"publish K={K} T={T}", disp[:T, :W], NV.quantize_row_bytes(x.cpu()), K)


def check_swiglu_quant(device, big=False):
    from megatron_dist_moe.kernels.quant_nvfp4 import swiglu_quant
    R, F = (600, 3072) if big else (21, 128)
    for act in ("swiglu", "swiglu_clamped"):
        a = Activation(act, 1.702, 7.0 if act == "swiglu" else 1.5)
        g = torch.Generator().manual_seed(len(act))
        h1 = (torch.randn(R, 2 * F, generator=g) * 3).to(BF).to(device)
        out = torch.zeros(R, nvfp4_row_bytes(F), dtype=torch.uint8, device=device)
        swiglu_quant(h1, torch.tensor([R], dtype=torch.int32, device=device), R, F, out=out,
                     activation=act, swiglu_alpha=a.alpha, swiglu_limit=a.limit)
        want = NV.quantize_row_bytes(a.forward(h1.cpu().float()).to(BF))
        # the kernel's exp may differ from torch's in the last fp32 bit, which can flip a bf16
        # rounding of h2 and so one E2M1 code or a row's scale: the dequantized rows must agree
        # within one E2M1 step of each block, and flips must be rare
        got_v = NV.dequantize_row_bytes(out.cpu(), F)
        want_v = NV.dequantize_row_bytes(want, F)
        _, s, s_dec = NV.split_row_bytes(want, F)
        step = (s.float() * s_dec[:, None]).repeat_interleave(16, 1) * 2   # the top E2M1 step
        assert bool(((got_v - want_v).abs() <= step + 1e-30).all()), f"{act}: h2 rows off"
        flips = (out.cpu() != want).float().mean().item()
        assert flips < 2e-3, f"{act}: {flips:.2e} of the bytes differ from the twin"
        # the same pass's a16, in both orders: bit-equal to dequantize_rows of its byte rows
        from megatron_dist_moe.kernels.quant_nvfp4 import dequantize_rows
        n = torch.tensor([R - 3], dtype=torch.int32, device=device)
        for order in ("k", "fragment"):
            out2 = torch.zeros_like(out)
            a16 = torch.full((R, F), 7.0, dtype=torch.float16, device=device)
            swiglu_quant(h1, n, R, F, out=out2, activation=act, swiglu_alpha=a.alpha,
                         swiglu_limit=a.limit, a16=a16, a16_order=order)
            want16 = torch.empty(R - 3, F, dtype=torch.float16, device=device)
            dequantize_rows(out2, n, R, F, out=want16, order=order)
            assert torch.equal(out2[:R - 3], out[:R - 3]), f"{act}: rows differ with a16"
            assert torch.equal(a16[:R - 3].view(torch.int16), want16.view(torch.int16)), (
                f"{act}, order {order}: swiglu_quant's a16 differs from dequantize_rows")
            assert (a16[R - 3:] == 7.0).all(), f"{act}: a16 past num_rows written"
            # only S_dec stored in the byte rows: the same a16 bits, the same S_dec
            out3 = torch.full_like(out, 0xAB)
            a16s = torch.full_like(a16, 7.0)
            swiglu_quant(h1, n, R, F, out=out3, activation=act, swiglu_alpha=a.alpha,
                         swiglu_limit=a.limit, a16=a16s, a16_order=order, s_dec_only=True)
            assert torch.equal(a16s.view(torch.int16), a16.view(torch.int16)), (
                f"{act}, order {order}: s_dec_only changed a16")
            _check_s_dec_only(f"swiglu_quant {act}", out3[:R - 3], out2[:R - 3], F, 0xAB)
            assert (out3[R - 3:] == 0xAB).all(), f"{act}: s_dec_only wrote rows past num_rows"


def check_fanout_dequantize(device, big=False):
    """The owner's fan-out of byte rows with their decode: x_g rows equal the source rows, a16
    equals dequantize_rows(x_g) bitwise in both orders, rows at or past num_rows untouched."""
    from megatron_dist_moe.kernels.quant_nvfp4 import dequantize_rows, fanout_dequantize
    D, EP, T, KR = (7168, 2, 9, 6) if big else (256, 2, 5, 3)
    W = nvfp4_row_bytes(D)
    g = torch.Generator().manual_seed(D)
    srcs = []
    for r in range(EP):       # each rank's rows in 2D-byte slots, as the dispatch buffer
        b = torch.full((T, 2 * D), 0xCD, dtype=torch.uint8)
        b[:, :W] = NV.quantize_row_bytes(rows_of(max(T, 6), D, seed=10 + r)[:T])
        srcs.append(b.to(device))
    base = torch.tensor([b.data_ptr() for b in srcs], dtype=torch.int64, device=device)
    n_routes = EP * T * KR
    R = n_routes // 2
    dest = torch.full((n_routes,), -1, dtype=torch.int32)
    perm = torch.randperm(n_routes, generator=g)[:R + 1]
    dest[perm[:R]] = torch.randperm(R, generator=g).to(torch.int32)
    dest[perm[R]] = R + 1                              # past num_rows: never written
    dest = dest.to(device)
    n = torch.tensor([R], dtype=torch.int32, device=device)
    for order in ("k", "fragment"):
        xg = torch.full((R + 2, W), 0xEE, dtype=torch.uint8, device=device)
        a16 = torch.full((R + 2, D), 5.0, dtype=torch.float16, device=device)
        fanout_dequantize(base, 2 * D, dest, T, KR, xg, n, D, a16=a16, order=order)
        want = torch.full_like(xg, 0xEE)
        for j, i in enumerate(dest.tolist()):
            if 0 <= i < R:
                r, t = divmod(j // KR, T)
                want[i] = srcs[r][t, :W]
        assert torch.equal(xg, want), f"order {order}: fanned-out byte rows differ"
        want16 = torch.empty(R, D, dtype=torch.float16, device=device)
        dequantize_rows(xg, n, R, D, out=want16, order=order)
        assert torch.equal(a16[:R].view(torch.int16), want16.view(torch.int16)), (
            f"order {order}: fanout_dequantize's a16 differs from dequantize_rows")
        assert (a16[R:] == 5.0).all(), f"order {order}: a16 past num_rows written"
        xs = torch.full_like(xg, 0xEE)
        a16s = torch.full_like(a16, 5.0)
        fanout_dequantize(base, 2 * D, dest, T, KR, xs, n, D, a16=a16s, order=order,
                          s_dec_only=True)
        assert torch.equal(a16s.view(torch.int16), a16.view(torch.int16)), (
            f"order {order}: s_dec_only changed the fan-out's a16")
        _check_s_dec_only(f"fanout order {order}", xs, want, D, 0xEE)
    xz = torch.full((R + 2, W), 0xEE, dtype=torch.uint8, device=device)
    fanout_dequantize(base, 2 * D, dest, T, KR, xz, torch.zeros_like(n), D,
                      a16=torch.zeros(R + 2, D, dtype=torch.float16, device=device))
    assert (xz == 0xEE).all(), "num_rows = 0 (a failed routing check): rows written"




def check_nvfp4_mm(device, big=False):
    """Both epilogues against the twin math (dequantized fp32 operands): one bf16 unit of the
    stored output (2^-8 of max|ref|, the kernel applies the global scales after the sum). Big:
    the guide's W13 shape with decode-regime rows (DECODE_TILES, mma.sync) and training-size
    rows (LARGE_TILES, wgmma), and rows between (SMALL_TILES, MEDIUM_TILES)."""
    for lens in ([[8, 0, 1, 13, 5, 7], [40, 0, 1, 60, 64, 33], [100, 0, 1, 200, 130, 90],
                  [8, 0, 1, 13, 500, 2048]] if big else
                 [[8, 0, 1, 13, 5, 7]]):
        _check_nvfp4_mm(device, lens, (6144, 7168) if big else (96, 256))


def _check_nvfp4_mm(device, lens, NK):
    import megatron_dist_moe as dm
    from megatron_dist_moe.kernels.grouped_gemm.nvfp4 import nvfp4_grouped_mm
    E = len(lens)
    N, K = NK
    offs = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)
    R = sum(lens)
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(R, K, generator=g) * torch.logspace(-2, 2, R)[:, None]).to(BF).to(device)
    w = (torch.randn(E, N, K, generator=g) / K ** 0.5).to(BF).to(device)
    prepared = dm.prepare_expert_weights(w, torch.zeros(E, K, N // 2, dtype=BF, device=device))
    W = prepared.w13
    a = NV.quantize_row_bytes(x)
    xd, wd = NV.dequantize_row_bytes(a, K), W.dequantize()
    o = offs.tolist()
    ref = torch.cat([xd[o[e]:o[e + 1]] @ wd[e].T for e in range(E)])
    out = torch.full((R, N), float("nan"), dtype=BF, device=device)
    nvfp4_grouped_mm(a=a, weight=W, expert_offsets=offs, max_rows=R + 3, epilogue="store",
                     out=out)
    _close(f"nvfp4 store R={R}", out.float(), ref, 8e-3)
    # A decoded once (dequantize_rows) instead of in the GEMM: the same operand values
    from megatron_dist_moe.kernels.quant_nvfp4 import dequantize_rows
    a16 = torch.full((R + 3, K), float("nan"), dtype=torch.float16, device=device)
    dequantize_rows(a, torch.tensor([R], dtype=torch.int32, device=device), R + 3, K, out=a16)
    out3 = torch.full_like(out, float("nan"))
    nvfp4_grouped_mm(a=a, weight=W, expert_offsets=offs, max_rows=R + 3, epilogue="store",
                     out=out3, a16=a16)
    assert torch.equal(out, out3), f"R={R}: the GEMM on pre-decoded A rows differs"
    if out.is_cuda:   # the packed-PTX decode and the Triton-op decode give the same bits
        out2 = torch.full_like(out, float("nan"))
        nvfp4_grouped_mm(a=a, weight=W, expert_offsets=offs, max_rows=R + 3, epilogue="store",
                         out=out2, decode="f16")
        assert torch.equal(out, out2), f"R={R}: the f16_asm and f16 decodes differ"
    dst = torch.full((R + 2, N), float("nan"), dtype=BF, device=device)
    perm = torch.randperm(R + 2, generator=torch.Generator().manual_seed(2))[:R].to(device)
    ptrs = dst.data_ptr() + perm.long() * N * 2
    ptrs[3] = 0
    nvfp4_grouped_mm(a=a, weight=W, expert_offsets=offs, max_rows=R, epilogue="scatter",
                     out_row_ptrs=ptrs)
    keep = torch.arange(R, device=device) != 3
    _close(f"nvfp4 scatter R={R}", dst[perm][keep].float(), ref[keep], 8e-3)
    assert torch.isnan(dst[perm[3]].float()).all(), "row with address 0 was written"


def check_nvfp4_decode_mm(device, big=False):
    """The CUDA decode-regime GEMM (csrc/nvfp4_decode_mm.cu), every variant, against the twin
    math within one bf16 unit (as check_nvfp4_mm) and against the Triton kernel on the same
    a16: ragged and empty experts, more rows per expert than one pass takes (the weights are
    read again per group), N not a multiple of a block's rows, both epilogues, and a CUDA graph
    replayed after the offsets change in place."""
    from megatron_dist_moe.kernels.grouped_gemm import nvfp4_decode
    assert nvfp4_decode.loads(torch.device(device)), (
        "the CUDA decode GEMM did not load (it needs an sm_90 GPU and nvcc)")
    shapes = [(6144, 7168), (7168, 3072), (288, 256)] if big else [(288, 256)]
    for N, K in shapes:
        for lens in ([8, 0, 1, 13, 5, 7], [40, 0, 3, 17, 9, 33], [1, 1, 1, 1, 1, 1]):
            _check_decode_mm(device, lens, N, K, nvfp4_decode.variants())


def check_a16_fragment_order(device, big=False):
    """dequantize_rows(order="fragment") against the k order permuted by its torch twin
    (quant/nvfp4.a16_fragment_index), bitwise, for one-block rows and chunked ones."""
    from megatron_dist_moe.kernels.quant_nvfp4 import dequantize_rows
    for K in ((256, 3072, 7168, 9216) if big else (256, 640)):
        x = torch.randn(37, K, generator=torch.Generator().manual_seed(K)).to(BF).to(device)
        a = NV.quantize_row_bytes(x)
        n = torch.tensor([37], dtype=torch.int32, device=device)
        k_ord = torch.empty(37, K, dtype=torch.float16, device=device)
        f_ord = torch.empty_like(k_ord)
        dequantize_rows(a, n, 37, K, out=k_ord)
        dequantize_rows(a, n, 37, K, out=f_ord, order="fragment")
        assert torch.equal(f_ord, k_ord[:, NV.a16_fragment_index(K).to(device)]), (
            f"dequantize_rows(order='fragment') K={K}: differs from a16_fragment_index's order")


def check_nvfp4_wgmma_mm(device, big=False):
    """The CUDA wgmma GEMM (csrc/nvfp4_wgmma_mm.cu), every variant, as check_nvfp4_decode_mm
    (twin math, the Triton kernel, scatter, graph replay with new offsets) on a16 in the
    fragment order: experts of more rows than one token tile (and fewer), empty experts, N
    not a multiple of a block's 128 or 256 weight rows. The stream-K variants also: the same
    bits twice (their fixed summation order), a graph replayed twice (each launch leaves its
    flags clean for the next), and fewer k-chunk units than blocks (224 x 256: ranges inside
    one tile, empty blocks)."""
    from megatron_dist_moe.kernels.grouped_gemm import nvfp4_decode, nvfp4_wgmma
    assert nvfp4_decode.loads(torch.device(device)), (
        "the CUDA NVFP4 GEMMs did not load (they need an sm_90 GPU and nvcc)")
    shapes = [(6144, 7168), (7168, 3072), (224, 256)] if big else [(224, 256)]
    for N, K in shapes:
        for lens in ([300, 0, 1, 130, 64, 257], [8, 0, 1, 13, 5, 7], [33, 0, 0, 0, 0, 96]):
            _check_decode_mm(device, lens, N, K, nvfp4_wgmma.variants(),
                             nvfp4_wgmma.nvfp4_wgmma_mm, "fragment")


def check_nvfp4_dense_mm(device, big=False):
    """The GEMM on weights decoded per call (kernels/grouped_gemm/nvfp4_dense.py): the decoded
    fp16 weights bitwise against the twin's values (E2M1 x block scale), then as
    check_nvfp4_decode_mm (twin math, the Triton kernel on the same a16, scatter, graph replay
    with new offsets) with a scratch of one expert (the experts in groups, their offsets a
    slice) and of every expert."""
    import megatron_dist_moe as dm
    from megatron_dist_moe.kernels.grouped_gemm import nvfp4_dense
    for N, K in ([(6144, 7168), (7168, 3072), (224, 256)] if big else [(224, 256)]):
        w = (torch.randn(3, N, K, generator=torch.Generator().manual_seed(N)) / K ** 0.5)
        W = dm.prepare_expert_weights(w.to(BF).to(device),
                                      torch.zeros(3, K, N // 2, dtype=BF, device=device)).w13
        w16 = torch.full((2 * N * K,), float("nan"), dtype=torch.float16, device=device)
        nvfp4_dense.decode_weights(W, 1, 3, w16)
        want = NV.dequantize_weight(W.packed, W.scales, torch.ones(3, device=device))[1:]
        assert torch.equal(w16.view(2, N, K).float(), want), (
            f"decode_weights [N={N}, K={K}]: differs from the twin's E2M1 x block scale values")
        lens_all = ([[300, 0, 1, 130, 64, 257], [8, 0, 1, 13, 5, 7]] if big or device != "cpu"
                    else [[8, 0, 1, 13, 5, 7]])
        for lens in lens_all:
            _check_decode_mm(device, lens, N, K, (2 * N * K, MP.NVFP4_WEIGHT_SCRATCH_BYTES),
                             _dense_mm, graph_first=device != "cpu")
        _check_dense_swiglu(device, W, N, K, lens_all[0])


def _check_dense_swiglu(device, W, N, K, lens):
    """W13's SwiGLU epilogue on the dense GEMM, then quantize_rows of its bf16 h2, against the
    store epilogue's bf16 h1, then swiglu_quant: the same h2 byte rows and a16, bit for bit
    (both activations, experts in groups of one and all at once). The GEMMs get the row bound
    of 1,024 rows per expert, so a GPU runs the tiles the pipeline's dense form runs."""
    import megatron_dist_moe as dm
    from megatron_dist_moe.kernels.quant_nvfp4 import (dequantize_rows, quantize_rows,
                                                        swiglu_quant)
    if N // 2 % 64:   # the row quantizers' F: a multiple of 64
        N = 256
        w = torch.randn(W.shape[0], N, K, generator=torch.Generator().manual_seed(N)) / K ** 0.5
        W = dm.prepare_expert_weights(w.to(BF).to(device),
                                      torch.zeros(W.shape[0], K, N // 2, dtype=BF,
                                                  device=device)).w13
    E, F, R = W.shape[0], N // 2, sum(lens[: W.shape[0]])
    offs = torch.tensor([0] + torch.tensor(lens[:E]).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)
    x = (torch.randn(R, K, generator=torch.Generator().manual_seed(9)) * 3).to(BF).to(device)
    a = NV.quantize_row_bytes(x)
    nrows = torch.tensor([R], dtype=torch.int32, device=device)
    a16 = torch.empty(R, K, dtype=torch.float16, device=device)
    dequantize_rows(a, nrows, R, K, out=a16)
    rb = nvfp4_row_bytes(F)
    bound_rows = max(R, 1024 * E)
    for act in ("swiglu", "swiglu_clamped"):
        kw = dict(activation=act, swiglu_alpha=1.702, swiglu_limit=0.5)
        for bound in (2 * N * K, MP.NVFP4_WEIGHT_SCRATCH_BYTES):
            h1 = torch.full((R, N), float("nan"), dtype=BF, device=device)
            _dense_mm(variant=bound, a=a, a16=a16, weight=W, expert_offsets=offs,
                      max_rows=bound_rows, out=h1)
            want_q = torch.zeros(R, rb, dtype=torch.uint8, device=device)
            want16 = torch.full((R, F), float("nan"), dtype=torch.float16, device=device)
            swiglu_quant(h1, nrows, R, F, out=want_q, a16=want16, **kw)
            h2 = torch.full((R, F), float("nan"), dtype=BF, device=device)
            _dense_mm(variant=bound, a=a, a16=a16, weight=W, expert_offsets=offs,
                      max_rows=bound_rows, epilogue="swiglu", h2=h2, **kw)
            got_q = torch.zeros_like(want_q)
            got16 = torch.full_like(want16, float("nan"))
            quantize_rows(h2, nrows, R, F, out=got_q, a16=got16)
            name = f"nvfp4_dense_mm swiglu epilogue ({act}, scratch {bound} B) [N={N}, K={K}]"
            assert torch.equal(got_q, want_q), f"{name}: h2 byte rows differ from swiglu_quant's"
            assert torch.equal(got16, want16), f"{name}: h2's a16 differs from swiglu_quant's"


def _dense_mm(*, variant, **kw):
    """nvfp4_dense_mm with the plan's scratch bound set to `variant` bytes (the checks' variant
    slot)."""
    from megatron_dist_moe.kernels.grouped_gemm import nvfp4_dense
    E, N, K = kw["weight"].shape
    saved, MP.NVFP4_WEIGHT_SCRATCH_BYTES = MP.NVFP4_WEIGHT_SCRATCH_BYTES, variant
    try:
        scratch = torch.empty(nvfp4_dense.scratch_numel([(E, N, K)]), dtype=torch.float16,
                              device=kw["weight"].device)
        nvfp4_dense.nvfp4_dense_mm(scratch=scratch, **kw)
    finally:
        MP.NVFP4_WEIGHT_SCRATCH_BYTES = saved


def _check_decode_mm(device, lens, N, K, variants, fn=None, order="k", graph_first=True):
    import megatron_dist_moe as dm
    from megatron_dist_moe.kernels.grouped_gemm.nvfp4 import nvfp4_grouped_mm
    from megatron_dist_moe.kernels.quant_nvfp4 import dequantize_rows
    E, R = len(lens), sum(lens)
    offs = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)
    g = torch.Generator().manual_seed(N + K + R)
    x = (torch.randn(R, K, generator=g) * torch.logspace(-2, 2, R)[:, None]).to(BF).to(device)
    w = (torch.randn(E, N, K, generator=g) / K ** 0.5).to(BF).to(device)
    W = dm.prepare_expert_weights(w, torch.zeros(E, K, N // 2, dtype=BF, device=device)).w13
    a = NV.quantize_row_bytes(x)
    o = offs.tolist()
    xd, wd = NV.dequantize_row_bytes(a, K), W.dequantize()
    ref = torch.cat([xd[o[e]:o[e + 1]] @ wd[e].T for e in range(E)])
    a16 = torch.full((R + 3, K), float("nan"), dtype=torch.float16, device=device)
    dequantize_rows(a, torch.tensor([R], dtype=torch.int32, device=device), R + 3, K, out=a16)
    tri = torch.full((R, N), float("nan"), dtype=BF, device=device)
    nvfp4_grouped_mm(a=a, a16=a16, weight=W, expert_offsets=offs, max_rows=R, out=tri)
    if order != "k":
        dequantize_rows(a, torch.tensor([R], dtype=torch.int32, device=device), R + 3, K,
                        out=a16, order=order)
    for variant in variants:
        stream_k = fn is not None and fn.__name__ == "nvfp4_wgmma_mm" and _stream_k(variant)
        _check_decode_variant(device, lens, N, K, variant, offs, a, a16, W, xd, wd, ref, tri,
                              graph=(graph_first and variant == variants[0]) or stream_k, fn=fn,
                              repeat=stream_k)


def _stream_k(variant):
    from megatron_dist_moe.kernels.grouped_gemm import nvfp4_wgmma
    return nvfp4_wgmma.variant_shape(variant)["stream_k"]


def _check_decode_variant(device, lens, N, K, variant, offs, a, a16, W, xd, wd, ref, tri,
                          graph, fn=None, repeat=False):
    from megatron_dist_moe.kernels.grouped_gemm.nvfp4_decode import nvfp4_decode_mm
    fn = fn or nvfp4_decode_mm
    E, R = len(lens), sum(lens)
    name = f"{fn.__name__} variant {variant} [N={N}, K={K}] lens {lens}"
    out = torch.full((R, N), float("nan"), dtype=BF, device=device)
    fn(a=a, a16=a16, weight=W, expert_offsets=offs, max_rows=R, out=out, variant=variant)
    _close(name, out.float(), ref, 8e-3)
    # the same exact products, summed in another order: at most one bf16 rounding apart
    _close(f"{name} vs the Triton kernel", out.float(), tri.float(), 2 ** -7)
    if repeat:
        again = torch.full_like(out, float("nan"))
        fn(a=a, a16=a16, weight=W, expert_offsets=offs, max_rows=R, out=again, variant=variant)
        assert torch.equal(again, out), f"{name}: a second launch gave other bits"
    dst = torch.full((R + 2, N), float("nan"), dtype=BF, device=device)
    perm = torch.randperm(R + 2, generator=torch.Generator().manual_seed(2))[:R].to(device)
    ptrs = dst.data_ptr() + perm.long() * N * 2
    ptrs[0] = 0
    fn(a=a, a16=a16, weight=W, expert_offsets=offs, max_rows=R, epilogue="scatter",
       out_row_ptrs=ptrs, variant=variant)
    keep = torch.arange(R, device=device) != 0
    assert torch.equal(dst[perm][keep], out[keep]), f"{name}: scatter differs from store"
    assert torch.isnan(dst[perm[0]].float()).all(), f"{name}: row with address 0 written"
    # a graph captured once and replayed after the rows move between experts
    if graph:
        offs_g = offs.clone()
        out_g = torch.full_like(out, float("nan"))
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            replay = torch.cuda.CUDAGraph()
            with torch.cuda.graph(replay, stream=stream):
                fn(a=a, a16=a16, weight=W, expert_offsets=offs_g, max_rows=R, out=out_g,
                   variant=variant)
        lens2 = list(reversed(lens))
        offs_g.copy_(torch.tensor([0] + torch.tensor(lens2).cumsum(0).tolist(),
                                  dtype=torch.int32))
        replay.replay()
        torch.cuda.synchronize(device)
        o2 = offs_g.tolist()
        ref2 = torch.cat([xd[o2[e]:o2[e + 1]] @ wd[e].T for e in range(E)])
        _close(f"{name}: graph replay with new offsets", out_g.float(), ref2, 8e-3)
        if repeat:
            first = out_g.clone()
            out_g.fill_(float("nan"))
            replay.replay()
            torch.cuda.synchronize(device)
            assert torch.equal(out_g, first), f"{name}: a second graph replay gave other bits"


CHECKS = {f.__name__[len("check_"):]: f for f in (check_quantize_rows, check_publish_quantized,
                                                  check_swiglu_quant, check_fanout_dequantize,
                                                  check_nvfp4_mm, check_a16_fragment_order,
                                                  check_nvfp4_decode_mm, check_nvfp4_wgmma_mm,
                                                  check_nvfp4_dense_mm)}
GPU_ONLY = ("nvfp4_decode_mm", "nvfp4_wgmma_mm")   # CUDA C++: no interpreter
