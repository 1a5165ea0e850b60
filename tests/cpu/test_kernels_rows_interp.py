"""Row-movement and owner-side kernels (kernels/rows.py) under Triton's CPU interpreter.

Each case runs in a subprocess with TRITON_INTERPRET=1 so the interpreter setting never leaks
into other tests. Metadata moves (gather/scatter/copy) must match bit for bit; fp32 sums match
the torch twins to fp32 rounding.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

BODY = textwrap.dedent(r'''
    import torch
    from megatron_dist_moe.kernels import rows as K
    from megatron_dist_moe.kernels import rows_ref as R
    torch.manual_seed(0)
    bf = torch.bfloat16
    D, F, T, Kk = 96, 80, 7, 3
    # publication: header [T, schedule word], int16 IDs and the rows, nothing past T (D wider
    # than one block); the word: -1 without a training forward, else slot x (max + 1) + layers
    selected = torch.tensor([2, 3], dtype=torch.int64)
    for (Tp, Dp), sched, word in (((5, 96), None, -1), ((0, 96), (selected, 5), 13),
                                  ((3, 4100), (selected, 5), 13)):
        xp = torch.randn(Tp, Dp).to(bf)
        idp = torch.randint(-1, 30, (Tp, Kk))
        hdr = torch.full((3,), -3, dtype=torch.int32)
        ids16 = torch.full((Tp + 2, Kk), 77, dtype=torch.int16)
        disp = torch.full(((Tp + 2) * Dp,), 9.0).to(bf)
        K.publish_tokens(xp, idp, hdr, ids16, disp, sched=sched)
        assert hdr.tolist() == [Tp, word, -3], ("publish header", Tp, hdr.tolist())
        assert torch.equal(ids16[:Tp].long(), idp), ("publish ids", Tp)
        assert torch.equal(disp[:Tp * Dp].view(Tp, Dp), xp), ("publish rows", Tp)
        assert (ids16[Tp:] == 77).all() and (disp[Tp * Dp:] == 9).all(), ("publish past T", Tp)
    # gather: rows from scattered addresses, 0 = zero row, rows >= n untouched
    src = torch.randn(20, D).to(bf)
    idx = torch.tensor([3, 0, 19, 7, 7])
    ptrs = torch.zeros(8, dtype=torch.int64)
    ptrs[:5] = src.data_ptr() + idx * D * 2
    ptrs[1] = 0
    dst = torch.full((8, D), float("nan")).to(bf)
    K.gather_rows(ptrs, K.device_ptr(dst), torch.tensor([5], dtype=torch.int32), D, bf, 8)
    exp = src[idx].clone(); exp[1] = 0
    assert torch.equal(dst[:5], exp), "gather"
    assert torch.isnan(dst[5:].float()).all(), "gather wrote past n"
    # fan-out gather: each token row read once, written to every row it routes to here; rows
    # at or past n untouched; equal to gather_rows over the matching addresses
    EPf, Tf, Kf, W = 2, 5, 3, 40                   # W < BLOCK_W and not a power of two
    srcs = [torch.randn(Tf + 1, W).to(bf) for _ in range(EPf)]   # token t at t * W * 2 bytes
    base = torch.tensor([x.data_ptr() for x in srcs], dtype=torch.int64)
    dest = torch.full((EPf * Tf * Kf,), -1, dtype=torch.int32)
    perm = torch.randperm(EPf * Tf * Kf)[:11]      # 11 routes land here, in a shuffled order
    dest[perm] = torch.arange(11, dtype=torch.int32)
    dest[perm[10]] = 12                            # a row past n = 11: never written
    outf = torch.full((13, W), float("nan")).to(bf)
    K.fanout_rows(base, W * 2, dest, Tf, Kf, K.device_ptr(outf), torch.tensor([11], dtype=torch.int32), W, bf)
    reff = R.fanout_rows_ref(torch.stack([x[:Tf] for x in srcs]), dest, 11,
                             torch.full((13, W), float("nan")).to(bf))
    assert torch.equal(outf[:10], reff[:10]) and torch.isnan(outf[10:].float()).all(), "fanout"
    gp = torch.zeros(13, dtype=torch.int64)
    for j, i in enumerate(dest.tolist()):
        if 0 <= i < 11:
            r, t = divmod(j // Kf, Tf)
            gp[i] = int(base[r]) + t * W * 2
    viag = torch.full((13, W), float("nan")).to(bf)
    K.gather_rows(gp, K.device_ptr(viag), torch.tensor([10], dtype=torch.int32), W, bf, 13)
    assert torch.equal(viag[:10], outf[:10]), "fanout vs gather_rows"
    outz = torch.full((13, W), 5.0).to(bf)         # num_rows 0 (a failed routing check)
    K.fanout_rows(base, W * 2, dest, Tf, Kf, K.device_ptr(outz), torch.tensor([0], dtype=torch.int32), W, bf)
    assert (outz == 5).all(), "fanout wrote with num_rows = 0"
    # scatter: 0 = skip
    out = torch.full((20, D), 7.0).to(bf)
    sp = torch.zeros(8, dtype=torch.int64)
    sp[:5] = out.data_ptr() + torch.tensor([1, 2, 3, 4, 5]) * D * 2
    sp[2] = 0
    K.scatter_rows(K.device_ptr(dst), sp, torch.tensor([5], dtype=torch.int32), D, bf, 8)
    assert torch.equal(out[[1, 2, 4, 5]], dst[[0, 1, 3, 4]]) and (out[3] == 7).all(), "scatter"
    # copy_rows with a device row count
    a = torch.randn(6, D).to(bf); b = torch.zeros(6, D).to(bf)
    K.copy_rows(K.device_ptr(a), K.device_ptr(b), torch.tensor([4]), D, 6)
    assert torch.equal(b[:4], a[:4]) and (b[4:] == 0).all(), "copy_rows"
    # owner-side kernels
    routes = torch.randn(T, Kk, D).to(bf)
    ids = torch.randint(-1, 4, (T, Kk), dtype=torch.int32); ids[0] = -1
    s = torch.where(ids >= 0, torch.rand(T, Kk), 0.0)
    routes[ids < 0] = float("nan")            # stale rows must never leak
    y = torch.empty(T, D, dtype=bf)
    saved = torch.full((T, Kk, D), 5.0).to(bf)
    for flag in (0, 1):
        K.combine_routes(routes, ids, s, y, K.device_ptr(saved), torch.tensor([flag]))
        ref = R.combine_routes_ref(routes, ids, s)
        assert torch.allclose(y.float(), ref, atol=2e-2, rtol=1e-2) and (y[0] == 0).all(), "combine"
        live = ids >= 0
        if flag:
            assert torch.equal(saved[live], routes[live]), "combine save"
        else:
            assert (saved == 5).all(), "combine saved with flag 0"
    # the pulling combine: route (t, k) read from its row of an expert GEMM's dense rows
    perm = torch.randperm(T * Kk)
    dense = torch.full((T * Kk + 3, D), float("nan")).to(bf)     # rows of no route: NaN
    dense[perm] = routes.view(T * Kk, D)
    src_rows = perm.to(torch.int32)
    src_rows[(ids < 0).view(-1)] = -1
    n_dense = torch.tensor([T * Kk], dtype=torch.int32)
    y_pull = torch.empty(T, D, dtype=bf)
    K.combine_routes(None, ids, s, y_pull, pull=(K.device_ptr(dense), src_rows, n_dense))
    assert torch.equal(y_pull, y), "the pulling combine differs from the combine buffer's"
    # an active route whose row is -1 or past the row count reads zeros (a failed routing
    # check leaves R = 0 and unwritten entries)
    t1, k1 = int(torch.nonzero(ids[1:] >= 0)[0, 0]) + 1, int(torch.nonzero(ids[1:] >= 0)[0, 1])
    odd = src_rows.clone()
    odd[t1 * Kk + k1] = -1
    zeroed = routes.clone()
    zeroed[t1, k1] = 0
    y_ref = torch.empty(T, D, dtype=bf)
    K.combine_routes(zeroed, ids, s, y_ref)
    K.combine_routes(None, ids, s, y_pull, pull=(K.device_ptr(dense), odd, n_dense))
    assert torch.equal(y_pull, y_ref), "the pulling combine read a route whose row is -1"
    K.combine_routes(None, ids, s, y_pull, pull=(K.device_ptr(dense), src_rows,
                                                 torch.tensor([0], dtype=torch.int32)))
    assert (y_pull == 0).all(), "the pulling combine read rows past the row count"
    gy = torch.randn(T, D).to(bf)
    gr = routes.clone(); gs = torch.empty(T, Kk)
    K.publish_grad_routes(gy, K.device_ptr(gr), ids, s, gr, gs)
    rgr, rgs = R.publish_grad_routes_ref(gy, routes, ids, s)
    live = ids >= 0
    # one bf16 ulp: the interpreter's fp32->bf16 conversion may round differently from RTNE
    assert torch.allclose(gr[live].float(), rgr[live].float(), rtol=8e-3, atol=1e-6), "publish"
    assert torch.allclose(gs, rgs, atol=1e-4, rtol=1e-4) and (gs[~live] == 0).all(), "grad scores"
    # expert-side score gradients (save_route_outputs=False): owner publish, row score
    # addresses, per-row score gradient
    gr2 = torch.full((T + 2, D), 3.0).to(bf)
    own_s = torch.full((T, Kk), 9.0)
    K.publish_grad_y(gy, s, gr2, own_s)
    assert torch.equal(gr2[:T], gy) and (gr2[T:] == 3).all(), "publish_grad_y rows"
    assert torch.equal(own_s, s), "publish_grad_y scores"
    # the owner's sum of the experts' score-gradient parts: a fixed order, inactive routes 0
    parts = torch.randn(5, T * Kk + 7)
    gsum = torch.full((T, Kk), 9.0)
    K.sum_score_parts(parts, 3, ids, gsum)
    ref = parts[:3, :T * Kk].sum(0).view(T, Kk)
    assert torch.allclose(gsum[live], ref[live], rtol=1e-6, atol=1e-6), "sum_score_parts"
    assert (gsum[~live] == 0).all(), "sum_score_parts: inactive routes must be 0"
    # two "owners": combine regions of 4 routes of D bf16 each, routing regions with scores at 64
    comb = [torch.zeros(4, D, dtype=bf) for _ in range(2)]
    rout = [torch.zeros(64 + 4 * 4, dtype=torch.uint8) for _ in range(2)]
    cb = torch.tensor([c.data_ptr() for c in comb]); rb = torch.tensor([r.data_ptr() for r in rout])
    cptr = torch.tensor([cb[1] + 2 * D * 2, cb[0] + 3 * D * 2, 0, cb[1], 77, 88], dtype=torch.int64)
    sptr = torch.full((6,), -1, dtype=torch.int64)
    gptr = torch.full((6,), -1, dtype=torch.int64)
    K.route_score_ptrs(cptr, torch.tensor([4], dtype=torch.int32), cb, 4 * D * 2, rb, 64, D * 2,
                       2, sptr, gptr)
    assert sptr.tolist() == [int(rb[1]) + 64 + 8, int(rb[0]) + 64 + 12, 0, int(rb[1]) + 64, 0, 0], sptr
    # routes 2, 3, 0 with K = 2 belong to tokens 1, 1, 0: their grad_y rows at the region start
    assert gptr.tolist() == [int(cb[1]) + D * 2, int(cb[0]) + D * 2, 0, int(cb[1]), 0, 0], gptr
    u = torch.randn(5, F).to(bf); h2 = torch.randn(5, F).to(bf)
    scores = torch.rand(4) + 0.5
    grads = torch.full((4,), 9.0)
    both = torch.cat([scores, grads])          # score i at 4*i, its gradient 16 bytes later
    sp = torch.zeros(5, dtype=torch.int64)
    sp[:4] = both.data_ptr() + torch.tensor([2, 0, 3, 1]) * 4
    u0, h0 = u.clone(), h2.clone()
    K.score_grad_rows(K.device_ptr(u), K.device_ptr(h2), sp, torch.tensor([3], dtype=torch.int32),
                      F, 16, 5)
    order = torch.tensor([2, 0, 3])
    rg, ru, rh = R.score_grad_rows_ref(u0[:3], h0[:3], scores[order])
    assert torch.allclose(both[4:][order], rg, rtol=1e-4, atol=1e-4) and both[4 + 1] == 9.0, "grad_s"
    assert torch.allclose(u[:3].float(), ru.float(), rtol=8e-3, atol=1e-6), "s u"
    assert torch.allclose(h2[:3].float(), rh.float(), rtol=8e-3, atol=1e-6), "s h2"
    assert torch.equal(u[3:], u0[3:]) and torch.equal(h2[3:], h0[3:]), "rows past n touched"
    gx = torch.empty(T, D, dtype=bf)
    K.reduce_routes(routes, ids, gx)
    assert torch.allclose(gx.float(), R.reduce_routes_ref(routes, ids), atol=2e-2, rtol=1e-2), "reduce"
    gx_pull = torch.empty(T, D, dtype=bf)
    K.reduce_routes(None, ids, gx_pull, pull=(K.device_ptr(dense), src_rows, n_dense))
    assert torch.equal(gx_pull, gx), "the pulling reduction differs from the dispatch buffer's"
    # activation forward / backward (both forms)
    for clamped in (False, True):
        h1 = (3 * torch.randn(9, 2 * F)).to(bf)
        h2 = torch.empty(9, F, dtype=bf)
        n = torch.tensor([8], dtype=torch.int32)
        K.swiglu_fwd(K.device_ptr(h1), K.device_ptr(h2), n, F, 9, clamped, 1.702, 2.0)
        ref = R.act_ref(h1[:8].float(), F, clamped, 1.702, 2.0)
        assert torch.allclose(h2[:8].float(), ref, atol=1e-2, rtol=1e-2), ("act fwd", clamped)
        gh2 = torch.randn(9, F).to(bf)
        gh1 = torch.empty(9, 2 * F, dtype=bf)
        K.swiglu_bwd(K.device_ptr(h1), K.device_ptr(gh2), K.device_ptr(gh1), n, F, 9, clamped, 1.702, 2.0)
        ref = R.act_bwd_ref(h1[:8], gh2[:8], F, clamped, 1.702, 2.0)
        assert torch.allclose(gh1[:8].float(), ref, atol=2e-2, rtol=2e-2), ("act bwd", clamped)
    print("ROWS_OK")
''')


def test_row_kernels_match_torch_twins():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", BODY], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ROWS_OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
