"""Shared benchmark plumbing: the guide's timing method, CSV rows and plots.

Timing (design guide §07): 10 warm-ups, then 5 windows x 30 iterations; each window is timed
with CUDA events (inside one CUDA-graph replay loop where the path allows it), divided by 30,
reduced with MAX over ranks; the reported time is the median window, with the window range.
"""

from __future__ import annotations

import csv
import os
import statistics
import subprocess
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from plotting import pyplot

WARMUP = 10
WINDOWS = 5
ITERS = 30


def git_commit() -> str:
    """Short commit hash: $GIT_COMMIT when set (the GPU machine gets no .git), else git."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        return os.environ.get("GIT_COMMIT", "unknown")


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    windows_ms: list[float] = field(default_factory=list)


def capture_graph(fn: Callable[[], None], group=None, warm_calls: int = 3) -> torch.cuda.CUDAGraph:
    """Warm `fn` up on a side stream, then capture one call into a CUDA graph (all ranks)."""
    import gc

    gc.collect()   # no stray frees of earlier contexts inside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm_calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier(group=group)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_windows(fn: Callable[[], None], graph: bool, group=None, warmup: int = WARMUP,
                 windows: int = WINDOWS, iters: int = ITERS) -> Timing:
    """Time `fn` per the guide's method. graph=True captures one call into a CUDA graph and
    replays it `iters` times per window (one capture keeps the graph's memory pool small)."""
    if graph:
        g = capture_graph(fn, group)

        def run():
            for _ in range(iters):
                g.replay()
        for _ in range(warmup):
            g.replay()
    else:
        for _ in range(warmup):
            fn()

        def run():
            for _ in range(iters):
                fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(windows):
        if dist.is_initialized():
            dist.barrier(group=group)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        t = torch.tensor([a.elapsed_time(b) / iters], device="cuda")
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        out.append(float(t))
    if graph:
        del g
    return Timing(statistics.median(out), min(out), max(out), out)


DENSE_N = 8192   # the dense bf16 matmul behind every floor: N x N times N x N


def dense_mm_setup(device, n: int = DENSE_N) -> tuple[Callable[[], None], float, float]:
    """(call, FLOPs per call, relative error) of a bf16 torch.mm n x n x n into a preallocated
    output; the error is that of 64 sampled rows against fp32 (a correct matmul gives ~2e-3)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16) / n ** 0.5
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    rows = torch.linspace(0, n - 1, min(64, n), device=device).long()
    ref = a[rows].float() @ b.float()
    torch.mm(a, b, out=out)
    err = float((out[rows].float() - ref).norm() / ref.norm())

    def call():
        torch.mm(a, b, out=out)
    return call, 2.0 * n ** 3, err


def dense_mm_peak(device, group=None, n: int = DENSE_N) -> tuple[Timing, float]:
    """The bf16 matmul rate the floors are computed from, timed like the layer (graph, warm-ups,
    windows, slowest rank) in the same run: (Timing, TFLOP/s). Raises if the product is wrong."""
    call, flops, err = dense_mm_setup(device, n)
    if not err < 1e-2:
        raise RuntimeError(f"dense bf16 mm {n}^3: relative error {err:.2e} against fp32 (>= 1e-2)")
    t = time_windows(call, graph=True, group=group)
    return t, flops / (t.median_ms * 1e-3) / 1e12


def profile_graph(fn: Callable[[], None], path: str, replays: int = 5, group=None,
                  iter_ms: float | None = None) -> None:
    """Per-kernel CUDA times of `fn` replayed from a CUDA graph (what the timings measure), then
    the same folded into parts (profile_breakdown.py; `iter_ms` adds the row "timed iteration -
    profiled kernels"): the table goes to `path`, the parts to `path` with .csv."""
    from torch.profiler import ProfilerActivity, profile

    g = capture_graph(fn, group, warm_calls=1)
    # as many back-to-back replays as the timing's warm-up and first window, so the profiled
    # replays see the clocks of a GPU under sustained load, as the timed windows do
    # (bench_sustained.py); the synchronize before profiling is a pause of microseconds
    for _ in range(WARMUP + ITERS):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if dist.is_initialized():
            # the profiler's start-up takes different times on different ranks: without this,
            # the first replays' barriers absorb that skew (profile_breakdown leaves the NCCL
            # kernel of this barrier out)
            dist.barrier(group=group)
            torch.cuda.synchronize()
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    if path:
        with open(path, "w") as f:
            f.write(f"per-kernel CUDA time over {replays} graph replays\n")
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=200)
            f.write(table)
        from profile_breakdown import breakdown, format_table, parse_profile_table

        parts = breakdown(parse_profile_table(table), replays, iter_ms)
        with open(path, "a") as f:
            f.write("\n\nwhere the time goes (per iteration)\n" + format_table(parts) + "\n")
        with open(os.path.splitext(path)[0] + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(parts[0]))
            w.writeheader()
            w.writerows(parts)
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"[rank {rank}] {os.path.basename(path)}\n" + format_table(parts), flush=True)
        # where the idle time sits: kernel start/end times on the device (open the trace in
        # Perfetto, or: profile_breakdown.py --gaps TRACE.json)
        import json

        from profile_breakdown import format_gaps, idle_gaps, kernel_intervals, plot_timeline

        trace_path = os.path.splitext(path)[0] + "_trace.json"
        prof.export_chrome_trace(trace_path)
        with open(trace_path) as f:
            intervals = kernel_intervals(json.load(f))
        if intervals:
            gaps = format_gaps(idle_gaps(intervals, replays))
            with open(path, "a") as f:
                f.write("\n\nidle time by transition (per iteration)\n" + gaps + "\n")
            print(f"[rank {rank}] idle time by transition\n" + gaps, flush=True)
            plot_timeline(intervals, replays, os.path.splitext(path)[0] + "_timeline.png")
    del g


def parse_config_overrides(text: str) -> dict:
    """'save_route_outputs=0 pipeline=staged' -> Config overrides (ints, floats, 0/1 -> bools
    for bool fields, else strings); field names are checked against Config."""
    import dataclasses

    import megatron_dist_moe as dm

    fields = {f.name: f for f in dataclasses.fields(dm.Config)}
    out = {}
    for item in text.replace(",", " ").split():
        name, eq, value = item.partition("=")
        if not eq or name not in fields:
            raise ValueError(f"config override {item!r}: expected FIELD=value with a Config field")
        kind = fields[name].type if isinstance(fields[name].type, str) else fields[name].type.__name__
        if "bool" in kind:
            if value not in ("0", "1", "True", "False"):
                raise ValueError(f"config override {item!r}: a bool field takes 0/1")
            out[name] = value in ("1", "True")
        elif "int" in kind and "float" not in kind:
            out[name] = int(value)
        elif "float" in kind:
            out[name] = float(value)
        else:
            out[name] = value
    return out


CSV_FIELDS = ["commit", "gpu", "ep", "case", "T", "D", "F", "K", "E_local", "imbalance",
              "precision", "path", "mode", "ms", "ms_min", "ms_max", "useful_tflops",
              "ratio_to_baseline", "note"]


def append_csv(path: str, rows: list[dict]) -> None:
    append_csv_fields(path, rows, CSV_FIELDS)


def append_csv_fields(path: str, rows: list[dict], fields: list[str]) -> None:
    """Append rows to a CSV file with these columns (header when the file is new). A file
    written with other columns (an older version of the benchmark) is rewritten with the union
    of both, its rows keeping their values, so that no row lands under another's header."""
    if os.path.exists(path):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            old_fields, old_rows = list(reader.fieldnames or []), list(reader)
        if old_fields != list(fields):
            fields = old_fields + [c for c in fields if c not in old_fields]
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
                w.writeheader()
                w.writerows(old_rows)
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(r)


def plot_rows(rows: list[dict], path: str, title: str) -> None:
    """Grouped bars: useful TFLOP/s per case, one bar per path, for each mode."""
    plt = pyplot()
    if plt is None:
        return
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(7 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rs = [r for r in rows if r["mode"] == mode]
        cases = list(dict.fromkeys(r["case"] for r in rs))
        paths = list(dict.fromkeys(r["path"] for r in rs))
        w = 0.8 / max(1, len(paths))
        for i, p in enumerate(paths):
            xs, ys = [], []
            for j, c in enumerate(cases):
                m = [r for r in rs if r["case"] == c and r["path"] == p]
                if m:
                    xs.append(j + i * w)
                    ys.append(m[0]["useful_tflops"])
            ax.bar(xs, ys, w, label=p)
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks([j + w * (len(paths) - 1) / 2 for j in range(len(cases))])
        ax.set_xticklabels(cases, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("useful TFLOP/s per GPU")
        ax.set_title(f"{title} — {mode}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")
