"""Grouped GEMM microbenchmark: our Triton kernels versus torch._grouped_mm (bf16, one GPU).

Checks correctness first (exit code 1 on a mismatch), then times each kernel and its torch
counterpart and prints ms and TFLOP/s. Kernels (R rows over E experts, D hidden, F intermediate):

  fwd_swiglu         h1 = x @ W13[e]^T and h2 = SwiGLU(h1)       torch: _grouped_mm + eager SwiGLU
  fwd_swiglu_claim   same, rows gathered by address in claim mode: each m-tile copied once into
                     a_copy_out (in column slices) by the programs that reach it, then read
                     densely (TMA)                               torch: index_select + the above
  fwd_w2_scatter     y = h2 @ W2[e]^T, rows scattered by address  torch: _grouped_mm + index_copy_
  dgrad_w2           grad_h2 = grad_h3 @ W2[e]                    torch: _grouped_mm
  dgrad_w2_claim     same, grad_h3 rows gathered by claim into a_copy_out  torch: index_select + gm
  dgrad_w2_swiglu_bwd  W2 DGRAD with the SwiGLU backward in its epilogue    torch: gm + eager bwd
  dgrad_w13          grad_x = grad_h1 @ W13[e]                    torch: _grouped_mm
  wgrad_w13          dW13[e] = grad_h1_e^T @ x_e (bf16 out)       torch: _grouped_mm 2D x 2D
  wgrad_w2           dW2[e] = grad_h3_e^T @ h2_e (bf16 out)       torch: _grouped_mm 2D x 2D

"ratio" is our TFLOP/s over torch's for the same work (>1: we are faster); for the fused kernels
torch's time includes its unfused epilogue work (SwiGLU, gather, scatter), and the torch GEMM
alone is printed too (impl "torch_gemm").

Claim kernels also print our two-kernel baseline, "ours_gather_gemm" (rows.gather_rows into the
dense buffer, then the dense GEMM), and the dense GEMM alone, "ours_gemm"; the summary line
"copy hidden" = (gather_gemm - claim) / (gather_gemm - gemm): 1 means the claim kernel costs
what the dense GEMM alone does. --peer puts the gathered source rows on GPU 1 (reads over
NVLink, as in production; needs 2 GPUs); without it they are local (HBM) and the copy is cheap.
--claim-sweep times claim look-ahead / copy width / slice width / group_m variants.
--cutlass adds CUTLASS's Hopper warp-specialized grouped GEMM (kernels/grouped_gemm_sm90.py,
built from csrc/ on first use) for the FPROP kernels: "cutlass_<config>" is the GEMM into h1 plus
our SwiGLU row kernel (fwd_swiglu; comparable to "ours"), "cutlass_<config>_gemm" the GEMM alone
(comparable to "torch_gemm"; for fwd_w2_scatter without the scatter).

    python benchmarks/bench_grouped_gemm.py --csv bench_out/grouped_gemm.csv [--sweep]
    python benchmarks/bench_grouped_gemm.py --shapes 6x2048x7168x3072 --kernels fwd_swiglu
    python benchmarks/bench_grouped_gemm.py --kernels fwd_swiglu_claim,dgrad_w2_claim --peer --claim-sweep
    python benchmarks/bench_grouped_gemm.py --kernels fwd_swiglu,fwd_w2_scatter --cutlass
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dist_moe.kernels.grouped_gemm import (  # noqa: E402
    ClaimFlags, GroupedGemmConfig, device_ptr, grouped_mm_dgrad, grouped_mm_fwd, grouped_mm_wgrad)
from megatron_dist_moe.kernels.rows import gather_rows  # noqa: E402

BF16 = torch.bfloat16
# name -> (experts, rows per expert, D, F); both have R = 12288 rows
SHAPES = {"e6_f3072": (6, 2048, 7168, 3072), "e8_f2048": (8, 1536, 7168, 2048)}
KERNELS = ("fwd_swiglu", "fwd_swiglu_claim", "fwd_w2_scatter", "dgrad_w2",
           "dgrad_w2_claim", "dgrad_w2_swiglu_bwd", "dgrad_w13", "wgrad_w13", "wgrad_w2")
CLAIM_KERNELS = {"fwd_swiglu_claim": "fwd_swiglu", "dgrad_w2_claim": "dgrad_w2"}  # -> dense twin
SWEEP = [
    GroupedGemmConfig(128, 256, 64, 8, 8, 3, tma=False),
    GroupedGemmConfig(128, 256, 64, 8, 8, 3, tma=True),
    GroupedGemmConfig(128, 256, 64, 8, 8, 4, tma=True),
    GroupedGemmConfig(128, 128, 64, 8, 8, 4, tma=False),
    GroupedGemmConfig(128, 128, 64, 8, 8, 5, tma=True),
    GroupedGemmConfig(256, 128, 64, 8, 8, 3, tma=True),
]
# WGRAD-only candidates (its K loop runs over an expert's rows, ~2048: short, so the pipeline
# fill and the epilogue weigh more): longer K steps, deeper or shallower pipelines, grouping.
WGRAD_SWEEP = [
    GroupedGemmConfig(128, 256, 128, 8, 8, 2, tma=True),
    GroupedGemmConfig(128, 256, 64, 8, 8, 5, tma=True),
    GroupedGemmConfig(128, 256, 64, 4, 8, 4, tma=True),
    GroupedGemmConfig(128, 256, 64, 16, 8, 4, tma=True),
    GroupedGemmConfig(256, 128, 64, 8, 8, 4, tma=True),
    GroupedGemmConfig(128, 128, 128, 8, 8, 3, tma=True),
    GroupedGemmConfig(128, 128, 64, 8, 4, 5, tma=True),
]
_CLAIM_BASE = GroupedGemmConfig(128, 256, 64, 8, 8, 4, tma=True)
CLAIM_SWEEP = (
    [replace(_CLAIM_BASE, claim_ahead=a, claim_slice_k=sk) for a in (0, 1, 2)
     for sk in (256, 512, 1024)]
    + [replace(_CLAIM_BASE, claim_ahead=1, claim_slice_k=512, claim_ahead_slices=n)
       for n in (1, 4)]
    + [replace(_CLAIM_BASE, group_m=g) for g in (4, 16)]
    + [replace(_CLAIM_BASE, tma=False)]
)


def _cfg_name(cfg: GroupedGemmConfig, claim: bool = False) -> str:
    name = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}s{cfg.num_stages}w{cfg.num_warps}" + ("tma" if cfg.tma else "")
    if not claim and cfg.group_m != 8:
        name += f"g{cfg.group_m}"
    if claim:
        name += (f"-a{cfg.claim_ahead}k{cfg.copy_k}g{cfg.group_m}"
                 f"sl{cfg.slice_k}x{cfg.claim_ahead_slices}")
    return name


def enable_peer_access(a: int, b: int) -> None:
    """Peer access both ways (torch turns on src's access to dst's memory on a cross-GPU copy)."""
    for s_dev, d_dev in ((a, b), (b, a)):
        torch.empty(16, device=f"cuda:{d_dev}").copy_(torch.ones(16, device=f"cuda:{s_dev}"))
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)


def _parse_shape(s: str):
    if s in SHAPES:
        return s, SHAPES[s]
    e, rows, d, f = (int(v) for v in s.lower().split("x"))
    return f"e{e}_r{rows}_d{d}_f{f}", (e, rows, d, f)


def _commit() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import git_commit   # one rule for every benchmark ($GIT_COMMIT, else git)
    return git_commit()


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


class Problem:
    """All buffers of one shape, allocated once; kernels are closures over them."""

    def __init__(self, e, rows, d, f, seed=0, peer=False):
        g = torch.Generator(device="cuda").manual_seed(seed)
        dev = "cuda"

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, device=dev, generator=g) * scale).to(BF16)

        self.e, self.d, self.f, self.r = e, d, f, e * rows
        r = self.r
        self.offs = torch.arange(0, r + 1, rows, dtype=torch.int32, device=dev)  # [E+1]
        self.offs_t = self.offs[1:].contiguous()  # torch: cumulative ends [E]
        self.x, self.g3, self.g1 = rnd(r, d), rnd(r, d), rnd(r, 2 * f)
        self.w13, self.w2 = rnd(e, 2 * f, d, scale=d ** -0.5), rnd(e, d, f, scale=f ** -0.5)
        self.h1, self.h2 = torch.empty(r, 2 * f, dtype=BF16, device=dev), torch.empty(r, f, dtype=BF16, device=dev)
        self.h2.copy_(rnd(r, f))
        self.y = torch.empty(r, d, dtype=BF16, device=dev)
        self.g2, self.gx = torch.empty(r, f, dtype=BF16, device=dev), torch.empty(r, d, dtype=BF16, device=dev)
        self.dw13 = torch.empty(e, 2 * f, d, dtype=BF16, device=dev)
        self.dw2 = torch.empty(e, d, f, dtype=BF16, device=dev)
        self.x_saved = torch.empty(r, d, dtype=BF16, device=dev)
        # a permutation stands in for the routing gather/scatter (single GPU: same addresses)
        self.src_idx = torch.randperm(r, device=dev, generator=g)
        self.dst_idx = torch.randperm(r, device=dev, generator=g)
        # gathered rows come from src_x / src_g3: copies of x / g3 on GPU 1 with --peer
        src_dev = "cuda:1" if peer else dev
        self.src_x, self.src_g3 = self.x.to(src_dev), self.g3.to(src_dev)
        self.g_idx = torch.randperm(r, device=dev, generator=g)
        self.a_rows = self.src_x.data_ptr() + self.src_idx.to(torch.int64) * d * 2
        self.g3_rows = self.src_g3.data_ptr() + self.g_idx.to(torch.int64) * d * 2
        self.y_rows = self.y.data_ptr() + self.dst_idx.to(torch.int64) * d * 2
        self.g3_saved = torch.empty(r, d, dtype=BF16, device=dev)
        # fused SwiGLU backward: h1_src is the saved h1; h1_work is overwritten in place
        self.h1_src = rnd(r, 2 * f, scale=2.0)
        self.h1_work = self.h1_src.clone()
        # its own h2: the fused epilogue rebuilds h2 from h1_work, and wgrad_w2 reads self.h2
        self.h2_work = torch.empty_like(self.h2)
        self.flags = ClaimFlags(r, None, e, dev)  # one flag set, all launches in stream order
        self.p = {k: device_ptr(getattr(self, k)) for k in
                  ("x", "g3", "g1", "h1", "h2", "y", "g2", "gx", "x_saved", "g3_saved",
                   "h1_work", "h1_src", "h2_work")}
        # torch-side outputs
        self.t = {}

    # ---- ours
    def ours(self, kernel, cfg=None):
        p, kw = self.p, dict(expert_offsets=self.offs, max_rows=self.r, config=cfg)
        if kernel == "fwd_swiglu":
            return lambda: grouped_mm_fwd(w=self.w13, a=p["x"], epilogue="swiglu", h1=p["h1"], h2=p["h2"], **kw)
        if kernel == "fwd_swiglu_claim":
            return lambda: grouped_mm_fwd(w=self.w13, a_row_ptrs=self.a_rows, a_copy_out=p["x_saved"],
                                          claim_flags=self.flags, epilogue="swiglu", h1=p["h1"],
                                          h2=p["h2"], **kw)
        if kernel == "dgrad_w2_claim":
            return lambda: grouped_mm_dgrad(w=self.w2, a_row_ptrs=self.g3_rows, a_copy_out=p["g3_saved"],
                                            claim_flags=self.flags, out=p["g2"], **kw)
        if kernel == "fwd_w2_scatter":
            return lambda: grouped_mm_fwd(w=self.w2, a=p["h2"], epilogue="scatter", out_row_ptrs=self.y_rows, **kw)
        if kernel == "dgrad_w2":
            return lambda: grouped_mm_dgrad(w=self.w2, a=p["g3"], out=p["g2"], **kw)
        if kernel == "dgrad_w2_swiglu_bwd":
            # the epilogue overwrites h1 with grad_h1, so every call first restores h1_work
            # (repeats on drifted values reach inf/NaN, and GEMM clocks depend on the data:
            # main() subtracts restore_h1(), timed alone)
            def fn():
                self.restore_h1()
                grouped_mm_dgrad(w=self.w2, a=p["g3"], epilogue="swiglu_bwd",
                                 h1=p["h1_work"], h2=p["h2_work"], **kw)
            return fn
        if kernel == "dgrad_w13":
            return lambda: grouped_mm_dgrad(w=self.w13, a=p["g1"], out=p["gx"], **kw)
        if kernel == "wgrad_w13":
            return lambda: grouped_mm_wgrad(p["g1"], p["x"], self.offs, self.dw13, dtype=BF16, config=cfg)
        if kernel == "wgrad_w2":
            return lambda: grouped_mm_wgrad(p["g3"], p["h2"], self.offs, self.dw2, dtype=BF16, config=cfg)
        raise ValueError(kernel)

    def restore_h1(self):
        self.h1_work.copy_(self.h1_src)

    def ours_gather_gemm(self, kernel):
        """Our two-kernel pipeline for a claim kernel: gather rows into the dense buffer
        (rows.gather_rows), then the dense GEMM on it (default config)."""
        p, num_rows = self.p, self.offs[-1:]
        kw = dict(expert_offsets=self.offs, max_rows=self.r)
        if kernel == "fwd_swiglu_claim":
            def fn():
                gather_rows(self.a_rows, p["x_saved"], num_rows, self.d, BF16, self.r)
                grouped_mm_fwd(w=self.w13, a=p["x_saved"], epilogue="swiglu", h1=p["h1"], h2=p["h2"], **kw)
            return fn

        def fn():
            gather_rows(self.g3_rows, p["g3_saved"], num_rows, self.d, BF16, self.r)
            grouped_mm_dgrad(w=self.w2, a=p["g3_saved"], out=p["g2"], **kw)
        return fn

    def ours_output(self, kernel):
        return {"fwd_swiglu": (self.h1, self.h2), "fwd_swiglu_claim": (self.h1, self.h2), "dgrad_w2_claim": (self.g2,),
                "fwd_w2_scatter": (self.y,), "dgrad_w2": (self.g2,), "dgrad_w13": (self.gx,),
                "dgrad_w2_swiglu_bwd": (self.h1_work,),
                "wgrad_w13": (self.dw13,), "wgrad_w2": (self.dw2,)}[kernel]

    # ---- CUTLASS (csrc/grouped_gemm_sm90*.cu)
    CUTLASS_KERNELS = ("fwd_swiglu", "fwd_w2_scatter", "wgrad_w13", "wgrad_w2")

    def cutlass_fns(self, kernel, gemm):
        """(our full equivalent, GEMM alone, outputs to check against torch's) on the CUTLASS
        GEMM `gemm` (a GroupedFpropSm90, or a GroupedWgradSm90 for the WGRAD kernels)."""
        from megatron_dist_moe.kernels import rows as K_rows
        p, n = self.p, self.offs[-1:]
        if kernel == "fwd_swiglu":
            def only():
                gemm(self.w13, self.offs, p["x"], p["h1"])

            def full():
                only()
                K_rows.swiglu_fwd(p["h1"], p["h2"], n, self.f, self.r, False, 1.702, 7.0)
            return full, only, (self.h1, self.h2)
        if kernel == "fwd_w2_scatter":   # the GEMM alone, into g3 (the scatter is not done)
            def only():
                gemm(self.w2, self.offs, p["h2"], p["g3_saved"])
            return None, only, (self.g3_saved,)
        if kernel in ("wgrad_w13", "wgrad_w2"):   # gemm: a GroupedWgradSm90
            a, b, out = (("g1", "x", self.dw13) if kernel == "wgrad_w13"
                         else ("g3", "h2", self.dw2))

            def only():
                gemm(p[a], p[b], self.offs, out)
            return None, only, (out,)
        raise ValueError(kernel)

    def check_cutlass(self, kernel, gemm) -> float:
        full, only, outs = self.cutlass_fns(kernel, gemm)
        for t in outs:
            t.fill_(float("nan"))
        (full or only)()
        if kernel == "fwd_swiglu":
            ref = self.torch_fns(kernel)[0]()
        else:
            ref = self.torch_fns(kernel)[1]()
            ref = ref if isinstance(ref, tuple) else (ref,)
        return max(_rel(o, t) for o, t in zip(outs, ref))

    # ---- torch
    def torch_fns(self, kernel):
        """(full torch equivalent, GEMM alone); each returns its outputs."""
        f, gm, offs = self.f, torch._grouped_mm, self.offs_t

        def swiglu(h1):
            return (torch.nn.functional.silu(h1[:, :f].float()) * h1[:, f:].float()).to(BF16)

        if kernel in ("fwd_swiglu", "fwd_swiglu_claim"):
            gather = kernel != "fwd_swiglu"

            def gemm():
                return gm(self.x, self.w13.transpose(1, 2), offs=offs)

            def full():
                x = self.x.index_select(0, self.src_idx) if gather else self.x
                h1 = gm(x, self.w13.transpose(1, 2), offs=offs)
                return h1, swiglu(h1)
            return full, gemm
        if kernel == "fwd_w2_scatter":
            y_t = torch.empty_like(self.y)

            def gemm():
                return gm(self.h2, self.w2.transpose(1, 2), offs=offs)

            def full():
                y_t.index_copy_(0, self.dst_idx, gemm())
                return (y_t,)
            return full, gemm
        if kernel == "dgrad_w2":
            fn = lambda: (gm(self.g3, self.w2, offs=offs),)  # noqa: E731
            return fn, fn
        if kernel == "dgrad_w2_claim":
            def gemm():
                return (gm(self.g3, self.w2, offs=offs),)

            def full():
                return (gm(self.g3.index_select(0, self.g_idx), self.w2, offs=offs),)
            return full, gemm
        if kernel == "dgrad_w2_swiglu_bwd":
            from megatron_dist_moe.kernels.rows_ref import act_bwd_ref

            def gemm():
                return (gm(self.g3, self.w2, offs=offs),)

            def full():
                gh2 = gm(self.g3, self.w2, offs=offs)
                return (act_bwd_ref(self.h1_src, gh2, f, False, 1.702, 7.0).to(BF16),)
            return full, gemm
        if kernel == "dgrad_w13":
            fn = lambda: (gm(self.g1, self.w13, offs=offs),)  # noqa: E731
            return fn, fn
        if kernel == "wgrad_w13":
            fn = lambda: (gm(self.g1.t(), self.x, offs=offs),)  # noqa: E731
            return fn, fn
        if kernel == "wgrad_w2":
            fn = lambda: (gm(self.g3.t(), self.h2, offs=offs),)  # noqa: E731
            return fn, fn
        raise ValueError(kernel)

    def flops(self, kernel) -> float:
        r, d, f = self.r, self.d, self.f
        return 2.0 * r * d * f * (2 if kernel in ("fwd_swiglu", "fwd_swiglu_claim", "dgrad_w13",
                                                  "wgrad_w13") else 1)

    def check(self, kernel, cfg=None) -> float:
        """Max relative (norm-wise) difference of our outputs to torch's."""
        for t in self.ours_output(kernel) + (self.x_saved, self.g3_saved):
            t.fill_(float("nan"))
        self.ours(kernel, cfg)()
        ref = self.torch_fns(kernel)[0]()
        if kernel == "fwd_swiglu_claim":
            assert torch.equal(self.x_saved, self.x.index_select(0, self.src_idx)), "a_copy_out mismatch"
        if kernel == "dgrad_w2_claim":
            assert torch.equal(self.g3_saved, self.g3.index_select(0, self.g_idx)), "a_copy_out mismatch"
        return max(_rel(o, t) for o, t in zip(self.ours_output(kernel), ref))


def _time_ms(fn, timer: str, rep: int) -> float:
    import triton.testing as tt
    if timer == "graph":
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            return tt.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return tt.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=None, help="append result rows to this CSV file")
    ap.add_argument("--sweep", action="store_true", help="also time a few tile configs per kernel")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma list of {list(SHAPES)} or ExROWSxDxF (rows per expert)")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma list of kernels")
    ap.add_argument("--timer", choices=("bench", "graph"), default="bench",
                    help="triton do_bench median (bench) or CUDA-graph replays (graph)")
    ap.add_argument("--rep", type=int, default=300, help="timing budget per measurement, ms")
    ap.add_argument("--tol", type=float, default=1e-2, help="max relative difference to torch")
    ap.add_argument("--peer", action="store_true",
                    help="gathered/claimed source rows on GPU 1 (NVLink reads; needs 2 GPUs)")
    ap.add_argument("--cutlass", action="store_true",
                    help="also time CUTLASS's warp-specialized grouped GEMM (csrc/, built on first use)")
    ap.add_argument("--claim-sweep", action="store_true",
                    help="time claim-mode variants (look-ahead, copy width, group_m, no TMA)")
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    if args.peer:
        assert torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(0, 1), (
            "--peer needs two GPUs with peer access")
        enable_peer_access(0, 1)

    gpu, commit = torch.cuda.get_device_name(), _commit()
    kernels = [k for k in args.kernels.split(",") if k]
    rows_out, failed = [], []
    print(f"# {gpu}  commit {commit}  torch {torch.__version__}  timer={args.timer}"
          f"  source rows: {'GPU 1 (peer)' if args.peer else 'local'}")
    hdr = f"{'shape':<22}{'kernel':<20}{'impl':<18}{'config':<34}{'ms':>9}{'TFLOP/s':>9}{'ratio':>7}"
    for shape_arg in args.shapes.split(","):
        shape_name, (e, rows, d, f) = _parse_shape(shape_arg)
        shape_name += "_peer" if args.peer else ""
        prob = Problem(e, rows, d, f, peer=args.peer)
        print(hdr)
        for kernel in kernels:
            err = prob.check(kernel)
            if not err <= args.tol:  # also catches NaN (unwritten outputs)
                print(f"MISMATCH {shape_name} {kernel}: relative difference to torch {err:.3e} > {args.tol}")
                failed.append((shape_name, kernel))
                continue
            flops = prob.flops(kernel)
            full, gemm = prob.torch_fns(kernel)
            try:
                t_full = _time_ms(full, args.timer, args.rep)
                t_gemm = _time_ms(gemm, args.timer, args.rep) if gemm is not full else t_full
            except RuntimeError as ex:  # e.g. a torch build whose _grouped_mm lacks this form
                print(f"torch {kernel} unavailable: {ex}")
                t_full = t_gemm = float("nan")
            results = [("torch", "-", t_full), ]
            if gemm is not full:
                results.append(("torch_gemm", "-", t_gemm))
            # time spent outside the kernel inside prob.ours(kernel): subtracted from our rows
            t_extra = (_time_ms(prob.restore_h1, args.timer, args.rep)
                       if kernel == "dgrad_w2_swiglu_bwd" else 0.0)
            t_ours = _time_ms(prob.ours(kernel), args.timer, args.rep) - t_extra
            results.append(("ours", "default", t_ours))
            if args.cutlass and kernel in Problem.CUTLASS_KERNELS:
                from megatron_dist_moe.kernels import grouped_gemm_sm90 as sm90
                wgrad = kernel.startswith("wgrad")
                for cname in sm90.WGRAD_CONFIGS if wgrad else sm90.CONFIGS:
                    gemm_c = (sm90.GroupedWgradSm90 if wgrad else sm90.GroupedFpropSm90)(
                        e, "cuda", cname)
                    e_c = prob.check_cutlass(kernel, gemm_c)
                    if not e_c <= args.tol:
                        print(f"MISMATCH {shape_name} {kernel} cutlass_{cname}: {e_c:.3e}")
                        failed.append((shape_name, kernel, f"cutlass_{cname}"))
                        continue
                    c_full, c_only, _ = prob.cutlass_fns(kernel, gemm_c)
                    if c_full is not None:
                        results.append((f"cutlass_{cname}", "-", _time_ms(c_full, args.timer, args.rep)))
                    results.append((f"cutlass_{cname}_gemm", "-", _time_ms(c_only, args.timer, args.rep)))
            if kernel in CLAIM_KERNELS:
                t_gg = _time_ms(prob.ours_gather_gemm(kernel), args.timer, args.rep)
                t_dense = _time_ms(prob.ours(CLAIM_KERNELS[kernel]), args.timer, args.rep)
                results += [("ours_gather_gemm", "default", t_gg), ("ours_gemm", "default", t_dense)]
                hidden = (t_gg - t_ours) / max(t_gg - t_dense, 1e-9)
                print(f"  {kernel}: claim {t_ours:.3f} ms, gather+gemm {t_gg:.3f} ms, dense gemm "
                      f"{t_dense:.3f} ms -> copy hidden {hidden:.0%}")
                if args.claim_sweep:
                    best = None
                    for cfg in CLAIM_SWEEP:
                        name = _cfg_name(cfg, claim=True)
                        try:
                            e_cfg = prob.check(kernel, cfg)
                            if not e_cfg <= args.tol:
                                print(f"  claim sweep {name}: MISMATCH {e_cfg:.3e}")
                                failed.append((shape_name, kernel, name))
                                continue
                            ms = _time_ms(prob.ours(kernel, cfg), args.timer, args.rep)
                        except Exception as ex:  # reported, not fatal (e.g. does not compile)
                            print(f"  claim sweep {name}: failed: {type(ex).__name__}: {str(ex)[:200]}")
                            continue
                        results.append(("ours_claim", name, ms))
                        if best is None or ms < best[1]:
                            best = (name, ms)
                    if best:
                        print(f"  best {kernel}: {best[0]} {best[1]:.3f} ms "
                              f"(copy hidden {(t_gg - best[1]) / max(t_gg - t_dense, 1e-9):.0%})")
            if args.sweep:
                best = None
                for cfg in SWEEP + (WGRAD_SWEEP if kernel.startswith("wgrad") else []):
                    name = _cfg_name(cfg, claim=kernel in CLAIM_KERNELS)
                    try:
                        e_cfg = prob.check(kernel, cfg)
                        if not e_cfg <= args.tol:
                            print(f"  sweep {name}: MISMATCH {e_cfg:.3e}")
                            failed.append((shape_name, kernel, name))
                            continue
                        ms = _time_ms(prob.ours(kernel, cfg), args.timer, args.rep) - t_extra
                    except Exception as ex:  # a config that does not compile here is reported, not fatal
                        print(f"  sweep {name}: failed: {type(ex).__name__}: {str(ex)[:200]}")
                        continue
                    results.append(("ours_sweep", name, ms))
                    if best is None or ms < best[1]:
                        best = (name, ms)
                if best:
                    print(f"  best {kernel}: {best[0]} {best[1]:.3f} ms {flops / best[1] / 1e9:.0f} TFLOP/s")
            for impl, cfg_name, ms in results:
                tflops = flops / ms / 1e9
                ratio = t_full / ms
                print(f"{shape_name:<22}{kernel:<20}{impl:<18}{cfg_name:<34}{ms:9.3f}{tflops:9.0f}{ratio:7.2f}")
                rows_out.append(dict(commit=commit, gpu=gpu, shape=shape_name, experts=e, rows=e * rows,
                                     d=d, f=f, kernel=kernel, impl=impl, config=cfg_name,
                                     ms=round(ms, 4), tflops=round(tflops, 1),
                                     ratio_vs_torch=round(ratio, 3)))
        del prob
        torch.cuda.empty_cache()

    if args.csv and rows_out:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        new = not args.csv.exists()
        with args.csv.open("a", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows_out[0]))
            if new:
                w.writeheader()
            w.writerows(rows_out)
        print(f"appended {len(rows_out)} rows to {args.csv}")
    if failed:
        print(f"FAILED correctness: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
