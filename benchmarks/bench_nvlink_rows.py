"""Row traffic over NVLink: pulling peer rows (loads) vs pushing rows to the peer (stores).

    torchrun --nproc-per-node=2 benchmarks/bench_nvlink_rows.py --out OUT [--rows 6144]
             [--programs 8,16,32,66,132] [--gemm]

Why: the forward gathers of x rows and the backward gathers of grad_h3 rows cost ~0.68 ms per
fwd+bwd at the guide load, and hiding them inside the GEMM (the staged pipeline's claims) slowed
the GEMM by about as much: a program that loads a peer row stalls for the NVLink round trip.
Stores to peer memory are posted (the SM does not wait for them), so an owner that pushes its
rows to the experts might move the same bytes with a few SMs while the GEMMs run on the rest.
This benchmark measures that before the dispatch is redesigned around it.

Each rank holds `rows` bf16 rows of D=7168 in symmetric memory. With P persistent programs:
    pull  copy `rows` rows from the peer's buffer (random row order) into a local buffer
    push  copy `rows` local rows into the peer's buffer (random row order)
Reported: ms (max over ranks, median of windows), GB/s over NVLink, and SM-milliseconds
(P / #SMs x ms: the SM time the copy takes from other work). With --gemm, each copy also runs
on a side stream next to a dense bf16 GEMM (12288 x 6144 x 7168, the W13 shape of the guide
load) and the GEMM's slow-down is reported. Correctness first: every copied row is compared
with the expected one. CSV rows (commit, GPU, shape, ms, GB/s as useful rate, ratio to pull at
the same P) and a plot go to OUT.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from common import append_csv, git_commit  # noqa: E402
from plotting import pyplot  # noqa: E402

D = 7168


@triton.jit
def _rows_persistent_kernel(src_ptrs, dst_ptrs, n_rows, W: tl.constexpr, BLOCK_W: tl.constexpr,
                            ROWS: tl.constexpr):
    """Row i: W bf16 elements from address src_ptrs[i] to dst_ptrs[i]; programs stride over
    blocks of ROWS rows (a persistent grid of any size)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_W)
    for blk in range(pid, tl.cdiv(n_rows, ROWS), nprog):
        rows = blk * ROWS + tl.arange(0, ROWS)
        live = rows < n_rows
        s = tl.load(src_ptrs + rows, mask=live, other=0).to(tl.pointer_type(tl.bfloat16))
        d = tl.load(dst_ptrs + rows, mask=live, other=0).to(tl.pointer_type(tl.bfloat16))
        for c0 in range(0, W, BLOCK_W):
            c = c0 + cols
            m = live[:, None] & (c < W)[None, :]
            v = tl.load(s[:, None] + c[None, :], mask=m)
            tl.store(d[:, None] + c[None, :], v, mask=m)


def copy_rows(src_ptrs, dst_ptrs, programs: int) -> None:
    n = src_ptrs.numel()
    _rows_persistent_kernel[(programs,)](src_ptrs, dst_ptrs, n, W=D, BLOCK_W=1024, ROWS=4,
                                         num_warps=4)


def timed(fn, iters: int, windows: int = 5) -> float:
    """Median window (ms per call), max over ranks."""
    out = []
    for _ in range(windows):
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        t = torch.tensor([a.elapsed_time(b) / iters], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append(float(t))
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--rows", type=int, default=6144, help="rows moved per rank (guide: ~6.1k)")
    ap.add_argument("--programs", default="8,16,32,66,132")
    ap.add_argument("--gemm", action="store_true", help="also run next to a dense GEMM")
    args = ap.parse_args()
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        raise SystemExit(f"bench_nvlink_rows needs exactly 2 ranks, got WORLD_SIZE={world}")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    peer = 1 - rank
    R = args.rows
    buf = symm_mem.empty(2 * R * D, dtype=torch.bfloat16, device=dev)   # [src rows | push dst]
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    gen = torch.Generator().manual_seed(77 + rank)
    src = buf[: R * D].view(R, D)
    src.copy_(torch.randn(R, D, generator=gen).to(torch.bfloat16))
    local_dst = torch.empty(R, D, dtype=torch.bfloat16, device=dev)
    perm = torch.randperm(R, generator=torch.Generator().manual_seed(5)).to(dev)  # same on both
    row_bytes = D * 2
    peer_base = int(hdl.buffer_ptrs[peer])
    own_src = src.data_ptr() + perm * row_bytes
    # pull: local row i <- peer row perm[i];  push: peer push-region row perm[i] <- local row i
    pull_src = peer_base + perm * row_bytes
    pull_dst = local_dst.data_ptr() + torch.arange(R, device=dev) * row_bytes
    push_src = src.data_ptr() + torch.arange(R, device=dev) * row_bytes
    push_dst = peer_base + R * row_bytes + perm * row_bytes
    del own_src
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    peer_src = hdl.get_buffer(peer, (R, D), torch.bfloat16, 0)
    pushed = buf[R * D:].view(R, D)
    gbytes = R * row_bytes / 1e9

    # correctness first
    copy_rows(pull_src, pull_dst, 32)
    hdl.barrier(channel=0)
    torch.cuda.synchronize()
    ok_pull = torch.equal(local_dst, peer_src[perm])
    pushed.zero_()
    hdl.barrier(channel=0)
    copy_rows(push_src, push_dst, 32)
    hdl.barrier(channel=0)
    torch.cuda.synchronize()
    ok_push = torch.equal(pushed[perm], peer_src)   # the peer pushed its rows into our region
    flags = torch.tensor([ok_pull and ok_push], dtype=torch.int32, device=dev)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"check pull {'OK' if ok_pull else 'MISMATCH'}, push {'OK' if ok_push else 'MISMATCH'}",
              flush=True)
    if not int(flags):
        sys.exit(1)

    gemm = None
    if args.gemm:
        a = torch.randn(12288, 7168, device=dev, dtype=torch.bfloat16)
        w = torch.randn(7168, 6144, device=dev, dtype=torch.bfloat16)
        gemm = lambda: torch.mm(a, w)  # noqa: E731
        for _ in range(3):
            gemm()
        gemm_ms = timed(gemm, 10)
        if rank == 0:
            print(f"dense GEMM 12288x6144x7168 alone: {gemm_ms:.3f} ms "
                  f"({2 * 12288 * 6144 * 7168 / gemm_ms / 1e9:.0f} TFLOP/s)", flush=True)
    side = torch.cuda.Stream()
    rows_out, commit, gpu = [], git_commit(), torch.cuda.get_device_name()
    results = {}
    for P in (int(p) for p in args.programs.split(",")):
        for kind, (s_ptrs, d_ptrs) in (("pull", (pull_src, pull_dst)), ("push", (push_src, push_dst))):
            fn = lambda s_ptrs=s_ptrs, d_ptrs=d_ptrs, P=P: copy_rows(s_ptrs, d_ptrs, P)  # noqa: E731
            fn()
            ms = timed(fn, 20)
            note = f"P={P} of {sms} SMs; SM-ms {P / sms * ms:.3f}"
            if gemm is not None:
                def both(fn=fn):
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        fn()
                    gemm()
                    torch.cuda.current_stream().wait_stream(side)
                both_ms = timed(both, 10)
                note += f"; next to the GEMM: {both_ms:.3f} ms vs GEMM alone {gemm_ms:.3f} ms " \
                        f"(+{both_ms - gemm_ms:.3f})"
            results[(kind, P)] = ms
            rows_out.append(dict(commit=commit, gpu=gpu, ep=2, case=f"rows{R}", T=R, D=D, F="",
                                 K="", E_local="", imbalance="", path=kind, mode=f"P{P}",
                                 ms=round(ms, 4), ms_min="", ms_max="",
                                 useful_tflops=round(gbytes / (ms * 1e-3), 1),   # GB/s here
                                 ratio_to_baseline=(round(results[("pull", P)] / ms, 3)
                                                    if kind == "push" else 1.0),
                                 note=note))
            if rank == 0:
                print(f"{kind:<5} P={P:<4} {ms:7.3f} ms  {gbytes / (ms * 1e-3):7.1f} GB/s  {note}",
                      flush=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        append_csv(os.path.join(args.out, "bench_nvlink_rows.csv"), rows_out)
        plt = pyplot()
        if plt is not None:
            fig, ax = plt.subplots(figsize=(6, 4))
            for kind in ("pull", "push"):
                ps = sorted(p for k, p in results if k == kind)
                ax.plot(ps, [gbytes / (results[(kind, p)] * 1e-3) for p in ps], "o-", label=kind)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("programs (persistent)")
            ax.set_ylabel("GB/s per rank over NVLink")
            ax.set_title(f"{R} rows x {D} bf16, 2 ranks ({commit})", fontsize=9)
            ax.legend()
            fig.tight_layout()
            fig.savefig(os.path.join(args.out, "bench_nvlink_rows.png"), dpi=110)
    hdl.barrier(channel=0)
    torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
