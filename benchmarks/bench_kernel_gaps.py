"""What one kernel boundary costs inside a CUDA graph, and what programmatic launch saves.

    python benchmarks/bench_kernel_gaps.py --out OUT [--kernels 64] [--replays 20]
    torchrun --nproc-per-node=2 benchmarks/bench_kernel_gaps.py --out OUT   # + the peer cases

Why: the guide-load layer idles 0.25 ms per forward (about 21 us per kernel boundary) and
0.94 ms per forward + backward between kernels (docs/perf_notes.md), far above the few
microseconds a graph-launched boundary should cost. Each case captures `--kernels` launches in one
CUDA graph, replays it, and reports microseconds per launch, once with plain launches and once
with programmatic dependent launch (DIST_MOE_PDL's prologue and launch attribute):

    tiny          one program that bumps a counter: the floor of a launch + boundary
    smem->tiny    a persistent grouped GEMM over 0 rows (one program per SM, each holding the
                  ~200 KB of shared memory of the 128x256x64 TMA tile, none with work) followed
                  by the tiny kernel: the cost of switching the shared-memory carve-out
    rows->tiny    a 4 MB row copy (many small programs) followed by the tiny kernel
    peer->tiny    (2 GPUs) the same 4 MB stored into the peer's memory over NVLink, then the tiny
                  kernel: what draining posted peer writes costs at a boundary; against the
                  local copy of the same bytes

Correctness first: the counter must equal the number of tiny launches, and every copied row
must match. CSV rows (commit, GPU, case, us per launch as "ms" x 1000 in the note, ratio of
plain to PDL) and a bar plot go to OUT.
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
from common import append_csv, git_commit, time_windows  # noqa: E402
from plotting import pyplot  # noqa: E402

from megatron_dist_moe.kernels import launch as L  # noqa: E402
from megatron_dist_moe.kernels.launch import grid_dependency_wait  # noqa: E402

ROW_W = 7168          # bf16 elements per row (the guide's D)
COPY_ROWS = 292       # ~4 MB


@triton.jit
def _tiny_kernel(counter_ptr, PDL: tl.constexpr = False):
    grid_dependency_wait(PDL)
    tl.atomic_add(counter_ptr, 1)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, W: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr = False):
    grid_dependency_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    for c0 in range(0, W, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < W
        tl.store(dst_ptr + row * W + c, tl.load(src_ptr + row * W + c, mask=m), mask=m)


def summarize(per_launch_us: list[float]) -> dict:
    """Median and range of per-launch microseconds over timing windows."""
    if not per_launch_us:
        raise ValueError("no timing windows")
    return dict(us=statistics.median(per_launch_us), us_min=min(per_launch_us),
                us_max=max(per_launch_us))


def time_graph(step, launches: int, replays: int) -> dict:
    """us per launch of a graph that holds `launches` launches of `step` (common.time_windows:
    warm-up, capture, windows of `replays` replays, max over ranks)."""
    t = time_windows(step, graph=True, iters=replays)
    return summarize([ms * 1e3 / launches for ms in t.windows_ms])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--kernels", type=int, default=64, help="launches per captured graph")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl")
    dev = torch.device("cuda", torch.cuda.current_device())
    os.makedirs(args.out, exist_ok=True)
    from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_fwd
    from megatron_dist_moe.kernels.rows import device_ptr

    N = args.kernels
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(1234)   # the same rows on every rank
    src = torch.randn(COPY_ROWS, ROW_W, device=dev, generator=gen).to(torch.bfloat16)
    dst = torch.empty_like(src)
    # the persistent GEMM over zero rows: one program per SM with the full TMA tile's smem
    w13 = torch.randn(6, 1024, 7168, device=dev).to(torch.bfloat16)   # the 128x256 TMA tile
    zero_offs = torch.zeros(7, dtype=torch.int32, device=dev)
    a = torch.empty(24576, 7168, dtype=torch.bfloat16, device=dev)
    h = torch.empty(24576, 1024, dtype=torch.bfloat16, device=dev)
    peer = buf = None
    if world > 1:
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(COPY_ROWS * ROW_W, dtype=torch.bfloat16, device=dev)
        hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        peer = hdl.get_buffer((rank + 1) % world, (COPY_ROWS * ROW_W,), torch.bfloat16)

    def launcher(kind: str, pdl: bool):
        """One step of `kind`; our GEMM's own launch follows L.PDL, set by the caller."""
        kw = dict(PDL=True, launch_pdl=True) if pdl else {}

        def tiny():
            _tiny_kernel[(1,)](counter, num_warps=1, **kw)

        def copy(to):
            _copy_kernel[(COPY_ROWS,)](src, to, W=ROW_W, BLOCK=1024, num_warps=4, **kw)

        def step():
            for _ in range(N if kind == "tiny" else N // 2):
                if kind == "smem->tiny":
                    grouped_mm_fwd(w=w13, expert_offsets=zero_offs, max_rows=24576, a=a,
                                   epilogue="store", out=device_ptr(h))
                elif kind == "rows->tiny":
                    copy(dst)
                elif kind == "peer->tiny":
                    copy(peer)
                tiny()
        return step

    kinds = ["tiny", "smem->tiny", "rows->tiny"] + (["peer->tiny"] if peer is not None else [])
    gpu, commit = torch.cuda.get_device_name(dev), git_commit()
    rows, failed = [], []
    for kind in kinds:
        res = {}
        for pdl in (False, True):
            old = L.PDL
            L.PDL = pdl
            try:
                step = launcher(kind, pdl)
                counter.zero_()
                dst.zero_()
                if kind == "peer->tiny":   # clear this rank's buffer before the peer writes
                    buf.zero_()
                    torch.cuda.synchronize()
                    dist.barrier()
                step()
                torch.cuda.synchronize()
                tiny_per_step = N if kind == "tiny" else N // 2
                ok = int(counter.item()) == tiny_per_step
                if kind == "rows->tiny":
                    ok = ok and torch.equal(dst, src)
                if kind == "peer->tiny":   # the peer stored its rows (the same draw) here
                    dist.barrier()
                    ok = ok and torch.equal(buf.view(COPY_ROWS, ROW_W), src)
                if not ok:
                    failed.append((kind, pdl))
                    print(f"MISMATCH {kind} pdl={pdl}: counter {int(counter.item())}")
                    continue
                res[pdl] = time_graph(step, N, args.replays)
            finally:
                L.PDL = old
        for pdl, t in res.items():
            ratio = res[False]["us"] / t["us"] if False in res else ""
            if rank == 0:
                print(f"{kind:<12} {'pdl' if pdl else 'plain':<6} {t['us']:7.2f} us per launch "
                      f"[{t['us_min']:.2f}-{t['us_max']:.2f}]", flush=True)
            rows.append(dict(commit=commit, gpu=gpu, ep=world, case=kind,
                             path="pdl" if pdl else "plain", mode="graph",
                             ms=round(t["us"] / 1e3, 6), ms_min=round(t["us_min"] / 1e3, 6),
                             ms_max=round(t["us_max"] / 1e3, 6), useful_tflops="",
                             ratio_to_baseline=round(ratio, 3) if ratio != "" else "",
                             note=f"{N} launches per graph; us per launch"))
    if rank == 0 and rows:
        append_csv(os.path.join(args.out, "bench_kernel_gaps.csv"), rows)
        plot(rows, os.path.join(args.out, "bench_kernel_gaps.png"), gpu)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 1 if failed else 0


def plot(rows: list[dict], path: str, gpu: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, path_name in enumerate(("plain", "pdl")):
        ys = [next((r["ms"] * 1e3 for r in rows if r["case"] == c and r["path"] == path_name), 0)
              for c in cases]
        ax.bar([j + 0.4 * i for j in range(len(cases))], ys, 0.4, label=path_name)
    ax.set_xticks([j + 0.2 for j in range(len(cases))])
    ax.set_xticklabels(cases)
    ax.set_ylabel("us per launch (graph replay)")
    ax.set_title(f"kernel boundaries, {gpu}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
