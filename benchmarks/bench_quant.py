"""The activation quantizers of fp8_block and mxfp8 at the guide's shapes, as the layer calls
them, in TB/s of bytes read + written against the HBM copy rate of the same run.

Every kernel is first checked bit for bit against its torch twin (quant/fp8_block.py,
quant/mxfp8.py) on the same inputs (the SwiGLU passes, whose activation's last bit may differ
from torch's, to a bounded rate of flipped roundings); a kernel that differs is reported and
not timed. fp8_block's backward SwiGLU pass with the quantizations after it runs composed (the
Triton pass storing bf16 grad_h1 and h2, then the CUDA quantizer twice) and fused
(quant_fp8_cuda.swiglu_bwd_quant), both counted at the fused kernel's bytes.

    python benchmarks/bench_quant.py --out bench_out [--group-rows 1,4,16,0] [--tiles all]
        [--fp8-tiles all]

--group-rows: the tile launch orders to time (common.grouped_tile: this many 128-row blocks
walk every column block together; 0 is the launchers' default). --tiles: mxfp8 `quantize`'s
tiles to time (rows x columns x warps, e.g. 32x32x1, or "all" for quant_mxfp8.QUANT_TILES;
default: the launcher's). --fp8-tiles: fp8_block `quantize_rows_cols`' tiles (column chunk x
warps, e.g. 64x4, or "all" for quant_fp8.QUANT_TILES), and "cuda" for the CUDA C++ quantizer
(quant_fp8_cuda, Execution.fp8_quant "cuda"; in "all" too). Rows: bench_quant.csv (commit, gpu,
precision, kernel, shape, group_rows, tile, us, tb_s, ratio to the copy rate), a plot
bench_quant.png.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import append_csv_fields, git_commit, time_windows  # noqa: E402
from plotting import pyplot  # noqa: E402

from megatron_dist_moe.activation import Activation  # noqa: E402
from megatron_dist_moe.kernels import quant_fp8 as KF, quant_mxfp8 as KM  # noqa: E402
from megatron_dist_moe.layout import padded_rows  # noqa: E402
from megatron_dist_moe.quant import fp8_block as QF, mxfp8 as QM  # noqa: E402

FIELDS = ["commit", "gpu", "precision", "kernel", "shape", "group_rows", "tile", "us", "us_min",
          "us_max", "tb_s", "ratio_to_copy", "equal"]
BF, F8, U8 = torch.bfloat16, torch.float8_e4m3fn, torch.uint8


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(U8) if t.element_size() == 1 else t.view(torch.int16) if t.element_size() == 2 \
        else t.view(torch.int32)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(bits(got.contiguous()), bits(want.contiguous()))


def guide_offsets(T: int, K: int, E: int, dev) -> torch.Tensor:
    """Expert row offsets of T tokens routed to K of E experts uniformly at random."""
    g = torch.Generator().manual_seed(1)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices.flatten()
    lens = torch.bincount(ids, minlength=E)
    return torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32).to(dev)


def order(group_rows, tile=None):
    """The launch-order and tile arguments: none (the launcher's defaults) for None."""
    return ({} if group_rows is None else {"group_rows": group_rows}) | (
        {} if tile is None else {"tile": tile})


def once(fn):
    """fn's result, computed on the first call (the twins at the guide's shapes take seconds)."""
    memo = []

    def get():
        if not memo:
            memo.append(fn())
        return memo[0]
    return get


@dataclass
class Case:
    """One quantizer call: run(group_rows or None), or run(group_rows or None, tile or None)
    where it takes a tile; check() -> bool against the twin, the bytes it reads and writes, its
    outputs (poisoned before every checked run, so that tiles a launch order skips cannot pass
    on an earlier order's results), and whether it takes a launch order and a tile."""

    run: Callable
    check: Callable
    nbytes: float
    shape: str
    outputs: list
    takes_order: bool = True
    takes_tile: bool = False
    reset: Callable | None = None   # restores an input the call overwrites, before the check

    def launch(self, group_rows, tile) -> None:
        """run() with the tile where the case takes one (tile is then None or an entry of its
        precision's QUANT_TILES; elsewhere it is ignored)."""
        self.run(group_rows, tile) if self.takes_tile else self.run(group_rows)


def poison(t: torch.Tensor) -> None:
    """Fill an output with bytes no twin produces on these inputs (NaN for bf16 / fp32 / e4m3,
    0xFF for E8M0 exponents)."""
    t.view(torch.uint8).fill_(0xFF)


def rate_differing(got: torch.Tensor, want: torch.Tensor) -> float:
    return (bits(got.contiguous()) != bits(want.contiguous())).float().mean().item()


def cases(R: int, E: int, D: int, F: int, offs: torch.Tensor, dev):
    """{(precision, kernel): Case}: the calls of Mxfp8Pipeline / Fp8BlockPipeline at these
    shapes. Column bundles count the rows of the padded segments the kernels write (`used`),
    not the allocation's host bound Rp."""
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=g).to(BF)   # noqa: E731
    Rp = padded_rows(R, E)
    offs_c = offs.long().cpu()
    used = int(QM.padded_offsets(offs_c)[-1])
    nr = offs[-1:].clone()
    x, gh1, h2 = rnd(R, D), rnd(R, 2 * F), rnd(R, F)
    h1 = (rnd(R, 2 * F) * 2).to(BF)
    act = Activation("swiglu", 1.702, 7.0)
    out = {}

    def mx_quant(name, src, K, rows_fake: bool, cols: bool, cols_fake: bool):
        rf = torch.empty(R, K, dtype=BF, device=dev) if rows_fake else None
        cb = (torch.empty(K, Rp, dtype=F8, device=dev),
              torch.empty(Rp // 32, K, dtype=U8, device=dev)) if cols else None
        cf = torch.empty(R, K, dtype=BF, device=dev) if cols_fake else None

        def run(gr, tile=None):
            KM.quantize(src, offs, R, K, rows_fake=rf, cols=cb, cols_fake=cf, **order(gr, tile))

        want_rf = once(lambda: QM.fake_rows(src))
        want_cb = once(lambda: QM.quantize_cols(src.cpu(), offs_c, Rp))
        want_cf = once(lambda: QM.fake_cols(src.cpu(), offs_c))

        def check():
            ok = True
            if rf is not None:
                ok &= same(rf, want_rf())
            if cb is not None:
                tq, te = want_cb()
                ok &= same(cb[0][:, :used].cpu(), tq[:, :used])
                ok &= same(cb[1][:used // 32].cpu(), te[:used // 32])
            if cf is not None:
                ok &= same(cf.cpu(), want_cf())
            return ok
        nbytes = R * K * 2 * (1 + rows_fake + cols_fake) + (used * K * (1 + 1 / 32) if cols
                                                            else 0)
        outs = [t for t in (rf, cf) if t is not None] + (list(cb) if cb else [])
        out[("mxfp8", name)] = Case(run, check, nbytes, f"{R}x{K}", outs, takes_tile=True)

    # forward: x_g -> fake rows (in place in the layer) + the saved column bundle
    mx_quant("quantize_x", x, D, True, True, False)
    # backward: g3 and grad_h1 -> fake rows + fake columns; h2 -> fake columns
    mx_quant("quantize_g3", x, D, True, False, True)
    mx_quant("quantize_gh1", gh1, 2 * F, True, False, True)
    mx_quant("quantize_h2", h2, F, False, False, True)

    h1q = (torch.empty(R, 2 * F, dtype=F8, device=dev),
           torch.empty(R, 2 * F // 32, dtype=U8, device=dev))
    h2f = torch.empty(R, F, dtype=BF, device=dev)
    want_h1q = once(lambda: QM.quantize_rows(h1))
    want_h2 = once(lambda: QM.fake_rows(act.forward(h1.float()).to(BF)))
    out[("mxfp8", "swiglu_quant")] = Case(
        lambda gr: KM.swiglu_quant(h1, nr, R, F, h2_fake=h2f, h1q=h1q, **order(gr)),
        lambda: (same(h1q[0], want_h1q()[0]) and same(h1q[1], want_h1q()[1])
                 # h2: the activation's last fp32 bit may differ from torch's, which can flip
                 # a rounding (the kernel check bounds such flips the same way)
                 and rate_differing(h2f, want_h2()) < 1e-3),
        R * 2 * F * (2 + 1 + 1 / 32) + R * F * 2, f"{R}x{2 * F}", [*h1q, h2f])
    q, e = QM.quantize_rows(gh1)
    deq = torch.empty(R, 2 * F, dtype=BF, device=dev)
    want_deq = once(lambda: QM.dequantize_rows(q, e).to(BF))
    out[("mxfp8", "dequantize_rows")] = Case(
        lambda gr: KM.dequantize_rows(q, e, nr, R, 2 * F, out=deq, **order(gr)),
        lambda: same(deq, want_deq()), R * 2 * F * (1 + 1 / 32 + 2), f"{R}x{2 * F}", [deq])
    qc, ec = (t.to(dev) for t in QM.quantize_cols(x.cpu(), offs_c, Rp))
    dqc = torch.empty(R, D, dtype=BF, device=dev)
    want_dqc = once(lambda: QM.fake_cols(x.cpu(), offs_c))
    out[("mxfp8", "dequantize_cols")] = Case(
        lambda gr: KM.dequantize_cols(qc, ec, offs, R, D, out=dqc, **order(gr)),
        lambda: same(dqc.cpu(), want_dqc()), used * D * (1 + 1 / 32) + R * D * 2, f"{R}x{D}",
        [dqc])

    T = max(1, R // 6)
    tok = torch.randint(0, T, (R,), device=dev, generator=g)

    def ptrs_of(src_tokens):
        return src_tokens.data_ptr() + tok * src_tokens.stride(0) * src_tokens.element_size()

    def fp8_quant(name, src, K, rows: bool, cols: bool, gather: bool = False):
        rb = (torch.empty(R, K, dtype=F8, device=dev),
              torch.empty(R, K // 128, device=dev)) if rows else None
        cb = (torch.empty(K, Rp, dtype=F8, device=dev),
              torch.empty(Rp // 128, K, device=dev)) if cols else None

        # ptrs: the layer's gathered form (row i read from ptrs[i], a token row of src)
        x_in, ptrs = (None, ptrs_of(src)) if gather else (src, None)
        dense = src[tok] if gather else src

        def run(gr, tile=None):
            if tile == "cuda":
                from megatron_dist_moe.kernels import quant_fp8_cuda
                quant_fp8_cuda.quantize_rows_cols(x_in, offs, R, K, rows=rb, cols=cb,
                                                  row_ptrs=ptrs)
            else:
                KF.quantize_rows_cols(x_in, offs, R, K, rows=rb, cols=cb, row_ptrs=ptrs,
                                      **order(gr, tile))

        want_rb = once(lambda: QF.quantize_rows(dense))
        want_cb = once(lambda: QF.quantize_cols(dense.cpu(), offs_c, Rp))

        def check():
            ok = True
            if rb is not None:
                wq, ws = want_rb()
                ok &= same(rb[0], wq) and same(rb[1], ws)
            if cb is not None:
                tq, ts = want_cb()
                ok &= same(cb[0][:, :used].cpu(), tq[:, :used])
                ok &= same(cb[1][:used // 128].cpu(), ts[:used // 128])
            return ok
        nbytes = R * K * 2 + (R * K * (1 + 4 / 128) if rows else 0) + (
            used * K * (1 + 4 / 128) if cols else 0)
        if gather:   # each token row is read by ~6 routes: count it once
            nbytes -= (R - T) * K * 2
        outs = (list(rb) if rb else []) + (list(cb) if cb else [])
        out[("fp8_block", name)] = Case(run, check, nbytes, f"{R}x{K}", outs, takes_tile=True)

    fp8_quant("quantize_x", x, D, True, True)
    fp8_quant("quantize_x_gathered", x[:T].contiguous(), D, True, True, gather=True)
    fp8_quant("quantize_gh1", gh1, 2 * F, True, True)
    fp8_quant("quantize_h2_cols", h2, F, False, True)
    f1 = (torch.empty(R, 2 * F, dtype=F8, device=dev), torch.empty(R, 2 * F // 128, device=dev))
    f2 = (torch.empty(R, F, dtype=F8, device=dev), torch.empty(R, F // 128, device=dev))
    want_f1 = once(lambda: QF.quantize_rows(h1))
    want_f2 = once(lambda: QF.quantize_rows(act.forward(h1.float()).to(BF)))
    out[("fp8_block", "swiglu_quant")] = Case(
        lambda gr: KF.swiglu_quant(h1, nr, R, F, h2q=f2, h1q=f1),
        lambda: (same(f1[0], want_f1()[0]) and same(f1[1], want_f1()[1])
                 # h2 as in mxfp8's swiglu_quant above
                 and rate_differing(f2[0], want_f2()[0]) < 1e-3
                 and rate_differing(f2[1], want_f2()[1]) < 1e-3),
        R * 2 * F * (2 + 1 + 4 / 128) + R * F * (1 + 4 / 128), f"{R}x{2 * F}", [*f1, *f2],
        takes_order=False)
    if torch.device(dev).type == "cuda":
        out.update(_swiglu_bwd_cases(R, E, F, offs, used, h1, act, rnd, dev))
    return out


def _swiglu_bwd_cases(R, E, F, offs, used, h1, act, rnd, dev):
    """fp8_block's backward SwiGLU pass, composed and fused (CUDA C++: GPU only)."""
    out = {}
    Rp = padded_rows(R, E)
    nr = offs[-1:].clone()
    # the backward's SwiGLU pass with the quantizations after it: the Triton pass (bf16 grad_h1
    # and h2, h2 over u) and the CUDA quantizer twice, as fp8_quant "cuda" ran it before the
    # fused kernel, against quant_fp8_cuda.swiglu_bwd_quant. Both count the fused kernel's
    # bytes (u and the h1 bundle read, the three bundles written), so TB/s compare as us do.
    # Their bf16 values may differ from the twin's in the last bit (exp, reciprocal), which
    # can flip an e4m3 rounding: the check bounds the rate of differing bytes as above.
    u0 = rnd(R, F)
    u_work = u0.clone()
    h1b = QF.quantize_rows(h1)
    gh1_tmp = torch.empty(R, 2 * F, dtype=BF, device=dev)

    def bundles():
        return ((torch.empty(R, 2 * F, dtype=F8, device=dev),
                 torch.empty(R, 2 * F // 128, device=dev)),
                (torch.empty(2 * F, Rp, dtype=F8, device=dev),
                 torch.empty(Rp // 128, 2 * F, device=dev)),
                (torch.empty(F, Rp, dtype=F8, device=dev), torch.empty(Rp // 128, F, device=dev)))

    from megatron_dist_moe.kernels.rows_ref import swiglu_bwd_quant_ref
    bwd_bytes = R * F * 2 + R * 2 * F * (1 + 4 / 128) + R * 2 * F * (1 + 4 / 128) + used * (
        3 * F) * (1 + 4 / 128)

    # With scores, as the layer runs them: row r's score in the owner's route table at a random
    # route (the rows are expert-major, the routes token-major), and each 128-column block's
    # score-gradient part one table slice after it (memory_plan's route_score_grads_delta and
    # score_part_stride). The scored cases count the parts' bytes too.
    n_parts = F // 128
    slice_floats = -(-R // 32) * 32   # 128-byte aligned slices
    table = torch.zeros((1 + n_parts) * slice_floats, device=dev)
    scores = torch.rand(R, generator=torch.Generator(device=dev).manual_seed(3), device=dev)
    route = torch.randperm(R, generator=torch.Generator(device=dev).manual_seed(4), device=dev)
    table[route] = scores
    parts = table[slice_floats:].view(n_parts, slice_floats)
    score = dict(score_ptrs=table.data_ptr() + route.to(torch.int64) * 4,
                 score_grad_delta=slice_floats * 4, part_stride=slice_floats * 4)

    def parts_bound():
        # the kernel's act(h1) may differ from torch's in its last bf16 bit: one bf16 unit
        # (at most 2^-7 of a value) of each term, plus fp32 summation in another order
        from megatron_dist_moe.quant.fp8_block import dequantize_rows
        terms = (u0.float() * act.forward(dequantize_rows(*h1b)).float()).abs()
        return terms.view(R, n_parts, 128).sum(-1) * (2.0 ** -7 + 1e-5)
    bound = once(parts_bound)

    def bwd_check(b, want):
        def check():
            ok = True
            for i, (q, s) in enumerate(b):
                wq, ws = want()[i]
                if i:   # the column bundles: the used padded rows
                    q, s, wq, ws = q[:, :used], s[:used // 128], wq[:, :used], ws[:used // 128]
                ok &= rate_differing(q, wq) < 1e-3 and rate_differing(s, ws) < 1e-3
            if want()[3] is not None:   # the score parts, read back through the route table
                ok &= bool(((parts[:, route].t() - want()[3]).abs() <= bound()).all())
            return ok
        return check

    for suffix, sc, s_R, extra_bytes, extra_outs in (
            ("", {}, None, 0, []),
            ("_scored", score, scores, R * 8 + R * 4 * (1 + n_parts), [parts])):
        want = once(lambda s_R=s_R: swiglu_bwd_quant_ref(u0, h1b, offs, Rp, act, s_R=s_R))
        bc, bf = bundles(), bundles()

        def composed(gr, bc=bc, sc=sc):
            from megatron_dist_moe.kernels import quant_fp8_cuda as QC
            KF.swiglu_bwd_rows(u_work, h1b, gh1_tmp, nr, R, F, block_n=128, **sc)
            QC.quantize_rows_cols(gh1_tmp, offs, R, 2 * F, rows=bc[0], cols=bc[1])
            QC.quantize_rows_cols(u_work, offs, R, F, cols=bc[2])

        def fused(gr, bf=bf, sc=sc):
            from megatron_dist_moe.kernels import quant_fp8_cuda as QC
            QC.swiglu_bwd_quant(u0, h1b, offs, R, F, gh1_rows=bf[0], gh1_cols=bf[1],
                                h2_cols=bf[2], part_cols=128, **sc)
        out[("fp8_block", f"swiglu_bwd_composed{suffix}")] = Case(
            composed, bwd_check(bc, want), bwd_bytes + extra_bytes, f"{R}x{F}",
            [t for b in bc for t in b] + extra_outs, takes_order=False,
            reset=lambda: u_work.copy_(u0))
        out[("fp8_block", f"swiglu_bwd_quant{suffix}")] = Case(
            fused, bwd_check(bf, want), bwd_bytes + extra_bytes, f"{R}x{F}",
            [t for b in bf for t in b] + extra_outs, takes_order=False)
    return out


def parse_tiles(text: str, flag: str, known: tuple, form: str, names: tuple = ()) -> list:
    """--tiles / --fp8-tiles: [None] (the launcher's tile), all of `known` and `names` for
    "all", else the listed tiles (form: "RxCxW" or "CxW") and names."""
    if not text:
        return [None]
    if text == "all":
        return list(known) + list(names)
    try:
        tiles = [t if t in names else tuple(int(v) for v in t.split("x"))
                 for t in text.split(",") if t]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: expected 'all' or {form}[,{form}...]") from None
    bad = [t for t in tiles if t not in known and t not in names]
    if bad:
        raise SystemExit(f"{flag}: {bad} not among the launcher's QUANT_TILES {known}")
    return tiles


def copy_rate(R: int, K: int, dev) -> float:
    """TB/s of one R x K bf16 device copy (read + write) in this run."""
    src, dst = torch.empty(R, K, dtype=BF, device=dev), torch.empty(R, K, dtype=BF, device=dev)
    t = time_windows(lambda: dst.copy_(src), graph=True)
    return 2 * R * K * 2 / t.median_ms / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--shape", default="2048x6x6x7168x3072", help="T x K x E x D x F")
    ap.add_argument("--group-rows", default="0",
                    help="launch orders to time, comma-separated (0: the default)")
    ap.add_argument("--tiles", default="",
                    help="mxfp8 quantize tiles RxCxW, comma-separated, or 'all' (default: the "
                         "launcher's)")
    ap.add_argument("--fp8-tiles", default="",
                    help="fp8_block quantize_rows_cols tiles CxW (column chunk x warps) or cuda, "
                         "comma-separated, or 'all' (default: the launcher's)")
    ap.add_argument("--kernels", default="", help="precision:kernel names to run (default all)")
    args = ap.parse_args()
    T, K, E, D, F = map(int, args.shape.split("x"))
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)
    commit = git_commit()
    offs = guide_offsets(T, K, E, dev)
    R = int(offs[-1])
    copy_tbs = copy_rate(R, D, dev)
    print(f"{gpu}: R={R} rows (T={T}, K={K}, E={E}); bf16 copy {copy_tbs:.2f} TB/s", flush=True)
    wanted = {k for k in args.kernels.split(",") if k}
    tiles = {"mxfp8": parse_tiles(args.tiles, "--tiles", KM.QUANT_TILES, "RxCxW"),
             "fp8_block": parse_tiles(args.fp8_tiles, "--fp8-tiles", KF.QUANT_TILES, "CxW",
                                      ("cuda",))}
    rows, failed = [], 0
    print("| precision | kernel | shape | group_rows | tile | us | TB/s | of copy | equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (prec, name), case in cases(R, E, D, F, offs, dev).items():
        if wanted and f"{prec}:{name}" not in wanted:
            continue
        orders = args.group_rows.split(",") if case.takes_order else ["0"]
        check, nbytes, shape = case.check, case.nbytes, case.shape
        for gr_text, tile in [(o, t) for o in orders for t in (tiles[prec] if case.takes_tile
                                                                 else [None])]:
            gr = int(gr_text)
            kw = gr if gr > 0 else None   # None: the launcher's default
            tile_text = ("default" if tile is None else tile if isinstance(tile, str)
                         else "x".join(map(str, tile)))
            for t in case.outputs:
                poison(t)
            if case.reset is not None:
                case.reset()
            def timed():
                case.launch(kw, tile)
            timed()
            torch.cuda.synchronize()
            ok = bool(check())
            if not ok:
                failed += 1
                print(f"| {prec} | {name} | {shape} | {gr} | {tile_text} | - | - | - | False |",
                      flush=True)
                continue
            t = time_windows(timed, graph=True)
            tbs = nbytes / t.median_ms / 1e9
            rows.append(dict(commit=commit, gpu=gpu, precision=prec, kernel=name, shape=shape,
                             group_rows=gr or "default", tile=tile_text,
                             us=round(t.median_ms * 1e3, 1),
                             us_min=round(t.min_ms * 1e3, 1), us_max=round(t.max_ms * 1e3, 1),
                             tb_s=round(tbs, 2), ratio_to_copy=round(tbs / copy_tbs, 3),
                             equal=ok))
            print(f"| {prec} | {name} | {shape} | {gr} | {tile_text} | {t.median_ms * 1e3:.1f} | "
                  f"{tbs:.2f} | {tbs / copy_tbs:.2f} | True |", flush=True)
    os.makedirs(args.out, exist_ok=True)
    append_csv_fields(os.path.join(args.out, "bench_quant.csv"), rows, FIELDS)
    plt = pyplot()
    if plt is not None and rows:
        ks = list(dict.fromkeys(f"{r['precision']}\n{r['kernel']}" for r in rows))
        variants = list(dict.fromkeys((r["group_rows"], r["tile"]) for r in rows))
        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(ks)), 4.5))
        w = 0.8 / len(variants)
        for i, v in enumerate(variants):
            pts = [(j, r["tb_s"]) for j, k in enumerate(ks) for r in rows
                   if f"{r['precision']}\n{r['kernel']}" == k and (r["group_rows"], r["tile"]) == v]
            ax.bar([j + w * i for j, _ in pts], [t for _, t in pts], w,
                   label=f"group_rows={v[0]}, tile={v[1]}")
        ax.axhline(copy_tbs, color="k", lw=0.8, ls="--", label=f"bf16 copy {copy_tbs:.2f}")
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(ks))], ks, fontsize=7)
        ax.set_ylabel("TB/s (bytes read + written)")
        ax.set_title(f"{gpu}, R={R}, commit {commit}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "bench_quant.png"), dpi=120)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
