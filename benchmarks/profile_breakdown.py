"""Where the time goes: a graph-replay kernel profile folded into the parts BENCHMARKS.md reports.

    python benchmarks/profile_breakdown.py PROFILE.txt --iter-ms 9.28 [--replays 5] [--csv OUT.csv]
    python benchmarks/profile_breakdown.py --gaps TRACE.json [--replays 5] [--plot OUT.png]

PROFILE.txt is what `bench_layer.py --profile` writes (torch.profiler's key_averages table over
N CUDA-graph replays, `common.profile_graph`). Each kernel name is put in one part (first match
in PARTS); a part's time is its kernels' CUDA time per iteration. The last row, "timed iteration
- profiled kernels", is the benchmark's iteration time minus all kernel time of the profiled
replays: the gaps between graph nodes (which `--gaps` measures on the device), plus any
difference between the timed windows and the profiled replays themselves (a GPU under sustained
load runs at lower clocks: bench_sustained.py). Kernel times of concurrent streams add up, so
the row can come out negative when side streams overlap.

`--gaps` reads the Chrome trace that `bench_layer.py --profile` also writes (kernel start and end
times on the device) and attributes the idle time: every stretch where no kernel runs on the GPU
is charged to the transition (kernel that ended last -> kernel that starts next), and the
transitions are listed by idle time per iteration.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

from plotting import pyplot

# (part, pattern on the kernel name), first match wins. The CUTLASS units (fp8_block's FPROP,
# DGRAD and WGRAD) are one kernel template: the profiler shows it demangled or, when the name is
# too long, mangled (_ZN7cutlass13device_kernel...), and truncated either way, so their WGRADs
# fall into the first part too
PARTS = [
    ("grouped GEMMs (FPROP, DGRAD)",
     r"^_grouped_mm_kernel|^_fp8_mm_kernel|^_nvfp4_mm_kernel|^_mega_fwd_kernel"
     r"|^(void\s+)?cutlass::device_kernel|^_ZN7cutlass13device_kernel|fill_\w*args"
     r"|^(void\s+)?dm_nvfp4::(\w+::)?nvfp4_(decode|wgmma)_mm_kernel"),
    ("grouped WGRAD", r"^_grouped_mm_wgrad_(persistent_)?kernel|^_fp8_wgrad_kernel"),
    ("weight quantization (every forward)", r"^_(quant_weight|fake_weight)_kernel"),
    ("weight decode (nvfp4, every forward)", r"^_decode_weights(_bg)?_kernel"),
    ("activation quantization (fp8_block, mxfp8, nvfp4)",
     r"^_(quant_rows_cols|quant_rows|swiglu_quant|quant|deq_rows|deq_cols|publish_quant)_kernel"
     r"|^(void\s+)?dm_fp8q::(quant_rows_cols|swiglu_bwd_quant)"),
    ("row gathers and scatters", r"^_(gather|scatter|fanout)_rows_kernel|^_fanout_deq_kernel"),
    ("owner kernels (combine, grad routes, route reduction)",
     r"^_(combine_routes|publish_grad_routes|publish_grad_y|reduce_routes|sum_score_parts)_kernel"),
    ("SwiGLU row kernels", r"^_(swiglu_(fwd|bwd)(_rows)?|score_grad_rows)_kernel"),
    ("device barriers", r"barrier"),
    ("routing tables and bookkeeping (ours)",
     r"^_?(route_|plan_forward|plan_backward|layout_kernel)"),
    ("row copies and checks (ours)", r"^_(copy_rows|publish_tokens|device_check|check)"),
    ("torch ops, copies, memsets", r"at::|at_cuda_detail|Memcpy|Memset|elementwise|reduce_kernel"),
]
OTHER = "other kernels"
# The ranks' alignment barrier that common.profile_graph runs inside the profiler before the
# profiled replays (NCCL); not part of the layer, which launches no NCCL kernel.
ALIGNMENT = re.compile(r"^(void\s+)?nccl")
_ROW = re.compile(r"^\s*(?P<name>.+?)\s{2,}(?P<cols>(?:\S+\s+){9}\S+)\s*$")


def _us(text: str) -> float:
    """'23.911ms' / '851.846us' / '1.2s' -> microseconds."""
    m = re.fullmatch(r"([\d.]+)(ms|us|s)", text.strip())
    if not m:
        raise ValueError(f"not a profiler time: {text!r}")
    return float(m.group(1)) * {"us": 1.0, "ms": 1e3, "s": 1e6}[m.group(2)]


def parse_profile_table(text: str) -> list[tuple[str, float, int]]:
    """(kernel name, total CUDA microseconds, calls) per row of a key_averages table."""
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith(("-", "Name", "per-kernel")):
            continue
        m = _ROW.match(line)
        if not m:
            continue
        cols = m.group("cols").split()
        # Self CPU %, Self CPU, CPU total %, CPU total, CPU avg, Self CUDA, Self CUDA %,
        # CUDA total, CUDA avg, calls
        try:
            rows.append((m.group("name").strip(), _us(cols[7]), int(cols[9])))
        except ValueError:
            continue
    return rows


def part_of(name: str) -> str:
    for part, pattern in PARTS:
        if re.search(pattern, name):
            return part
    return OTHER


TIMED_MINUS_KERNELS = "timed iteration - profiled kernels"


def breakdown(rows: list[tuple[str, float, int]], replays: int, iter_ms: float | None
              ) -> list[dict]:
    """[{part, ms, kernels, launches}] per iteration, in PARTS order, then other and idle."""
    if replays < 1:
        raise ValueError(f"replays={replays}: must be >= 1")
    acc: dict[str, list[float]] = {}
    for name, us, calls in rows:
        if ALIGNMENT.match(name):
            continue
        a = acc.setdefault(part_of(name), [0.0, 0, 0])
        a[0] += us / 1e3 / replays
        a[1] += 1
        a[2] += calls / replays
    out = [dict(part=p, ms=round(acc[p][0], 3), kernels=acc[p][1], launches=round(acc[p][2], 1))
           for p in [p for p, _ in PARTS] + [OTHER] if p in acc]
    total = sum(r["ms"] for r in out)
    out.append(dict(part="all kernels", ms=round(total, 3), kernels=sum(r["kernels"] for r in out),
                    launches=round(sum(r["launches"] for r in out), 1)))
    if iter_ms is not None:
        out.append(dict(part=TIMED_MINUS_KERNELS, ms=round(iter_ms - total, 3),
                        kernels=0, launches=0))
    return out


def format_table(parts: list[dict]) -> str:
    lines = ["| part | ms per iteration | launches per iteration |", "|---|---|---|"]
    lines += [f"| {r['part']} | {r['ms']:.3f} | {r['launches']:g} |" for r in parts]
    return "\n".join(lines)


def kernel_intervals(trace) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel / memcpy / memset in a Chrome trace (a dict with
    traceEvents, or the event list), sorted by start; the NCCL alignment barrier left out."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    out = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
           for e in events
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and not ALIGNMENT.match(e["name"])]
    return sorted(out, key=lambda iv: (iv[1], iv[2]))


def short_name(name: str, width: int = 48) -> str:
    """Kernel names for a table: templates and argument lists dropped, cut to `width`."""
    n = re.sub(r"^void\s+", "", name)
    n = re.sub(r"<.*$", "", n)
    n = re.sub(r"\(.*$", "", n)
    return n if len(n) <= width else n[:width - 1] + "~"


def idle_gaps(intervals: list[tuple[str, float, float]], replays: int) -> dict:
    """Busy/idle time of the device and idle time per transition, per iteration.

    Returns {span_ms, busy_ms, idle_ms, overlap_ms, transitions: [{after, before, ms, count,
    mean_us}] by ms descending}; *_ms per iteration (divided by replays); overlap is kernel time
    that ran concurrently with other kernels (side streams)."""
    if replays < 1:
        raise ValueError(f"replays={replays}: must be >= 1")
    if not intervals:
        raise ValueError("no kernel intervals in the trace")
    ivs = sorted(intervals, key=lambda iv: (iv[1], iv[2]))
    busy_end, last = ivs[0][2], ivs[0][0]
    busy, total = ivs[0][2] - ivs[0][1], ivs[0][2] - ivs[0][1]
    trans: dict[tuple[str, str], list[float]] = {}
    for name, start, end in ivs[1:]:
        total += end - start
        if start > busy_end:
            t = trans.setdefault((short_name(last), short_name(name)), [0.0, 0])
            t[0] += start - busy_end
            t[1] += 1
            busy += end - start
            busy_end, last = end, name
        elif end > busy_end:
            busy += end - busy_end
            busy_end, last = end, name
    span = busy_end - ivs[0][1]   # busy_end: the latest end of any kernel
    rows = [dict(after=a, before=b, ms=round(us / 1e3 / replays, 4),
                 count=round(n / replays, 2), mean_us=round(us / n, 2))
            for (a, b), (us, n) in trans.items()]
    rows.sort(key=lambda r: -r["ms"])
    return dict(span_ms=round(span / 1e3 / replays, 4), busy_ms=round(busy / 1e3 / replays, 4),
                idle_ms=round((span - busy) / 1e3 / replays, 4),
                overlap_ms=round((total - busy) / 1e3 / replays, 4), transitions=rows)


def format_gaps(g: dict, top: int = 15) -> str:
    lines = [f"device span {g['span_ms']:.3f} ms per iteration: busy {g['busy_ms']:.3f}, idle "
             f"{g['idle_ms']:.3f}, concurrent kernel time {g['overlap_ms']:.3f}",
             "| idle after | before | ms per iteration | gaps per iteration | mean gap us |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['after']} | {r['before']} | {r['ms']:.4f} | {r['count']:g} | {r['mean_us']:.1f} |"
              for r in g["transitions"][:top]]
    return "\n".join(lines)


def plot_timeline(intervals: list[tuple[str, float, float]], replays: int, path: str) -> bool:
    """One iteration's kernels as bars on a time axis (the middle replay of the trace), colored
    by part, with the idle stretches shaded: where the gaps are, at a glance. False without
    matplotlib."""
    plt = pyplot(quiet=True)
    if plt is None:
        return False
    ivs = sorted(intervals, key=lambda iv: iv[1])
    per = max(1, len(ivs) // max(replays, 1))
    k0 = per * (replays // 2) if len(ivs) >= per * replays else 0
    one = ivs[k0:k0 + per]
    t0 = one[0][1]
    parts = [p for p, _ in PARTS] + [OTHER]
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(14, 3.2))
    busy_end = t0
    for name, start, end in one:
        if start > busy_end:
            ax.axvspan((busy_end - t0) / 1e3, (start - t0) / 1e3, color="red", alpha=0.15, lw=0)
        busy_end = max(busy_end, end)
        k = parts.index(part_of(name))
        ax.barh(k, (end - start) / 1e3, left=(start - t0) / 1e3, color=colors(k % 10))
    ax.set_yticks(range(len(parts)))
    ax.set_yticklabels(parts, fontsize=7)
    ax.set_xlabel("ms from the iteration's first kernel (idle shaded red)")
    ax.set_title(f"one iteration, {len(one)} kernels")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile", nargs="?")
    ap.add_argument("--gaps", metavar="TRACE.json", help="attribute idle time from a Chrome trace")
    ap.add_argument("--plot", metavar="OUT.png", help="with --gaps: one iteration's timeline")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--iter-ms", type=float, default=None,
                    help="the benchmark's iteration time, for the timed-minus-kernels row")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    if args.gaps:
        import json

        with open(args.gaps) as f:
            intervals = kernel_intervals(json.load(f))
        print(format_gaps(idle_gaps(intervals, args.replays)))
        if args.plot and plot_timeline(intervals, args.replays, args.plot):
            print(f"wrote {args.plot}")
        return 0
    if not args.profile:
        ap.error("give PROFILE.txt or --gaps TRACE.json")
    with open(args.profile) as f:
        text = f.read()
    m = re.search(r"over (\d+) graph replays", text)
    replays = int(m.group(1)) if m else args.replays
    rows = parse_profile_table(text)
    if not rows:
        print(f"{args.profile}: no profiler rows found", file=sys.stderr)
        return 1
    parts = breakdown(rows, replays, args.iter_ms)
    print(format_table(parts))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(parts[0]))
            w.writeheader()
            w.writerows(parts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
