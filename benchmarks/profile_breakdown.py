"""Where the time goes: a graph-replay kernel profile folded into the parts BENCHMARKS.md reports.

    python benchmarks/profile_breakdown.py PROFILE.txt --iter-ms 9.28 [--replays 5] [--csv OUT.csv]

PROFILE.txt is what `bench_layer.py --profile` writes (torch.profiler's key_averages table over
N CUDA-graph replays, `common.profile_graph`). Each kernel name is put in one part (first match
in PARTS); a part's time is its kernels' CUDA time per iteration. "idle" is the iteration time
(from the benchmark) minus all kernel time: gaps between graph nodes and waits outside
kernels. Kernel times of concurrent streams add up, so idle can come out negative when side
streams overlap.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

# (part, pattern on the kernel name), first match wins
PARTS = [
    ("grouped GEMMs (FPROP, DGRAD)", r"^_grouped_mm_kernel"),
    ("grouped WGRAD", r"^_grouped_mm_wgrad_(persistent_)?kernel"),
    ("row gathers and scatters", r"^_(gather|scatter)_rows_kernel"),
    ("owner kernels (combine, grad routes, route reduction)",
     r"^_(combine_routes|publish_grad_routes|publish_grad_y|reduce_routes)_kernel"),
    ("SwiGLU row kernels", r"^_(swiglu_(fwd|bwd)|score_grad_rows)_kernel"),
    ("device barriers", r"barrier"),
    ("routing tables and bookkeeping (ours)", r"^_?(route_|plan_forward|plan_backward)"),
    ("row copies and checks (ours)", r"^_(copy_rows|device_check|check)"),
    ("torch ops, copies, memsets", r"at::|at_cuda_detail|Memcpy|Memset|elementwise|reduce_kernel"),
]
OTHER = "other kernels"
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


def breakdown(rows: list[tuple[str, float, int]], replays: int, iter_ms: float | None
              ) -> list[dict]:
    """[{part, ms, kernels, launches}] per iteration, in PARTS order, then other and idle."""
    if replays < 1:
        raise ValueError(f"replays={replays}: must be >= 1")
    acc: dict[str, list[float]] = {}
    for name, us, calls in rows:
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
        out.append(dict(part="idle (iteration - kernels)", ms=round(iter_ms - total, 3),
                        kernels=0, launches=0))
    return out


def format_table(parts: list[dict]) -> str:
    lines = ["| part | ms per iteration | launches per iteration |", "|---|---|---|"]
    lines += [f"| {r['part']} | {r['ms']:.3f} | {r['launches']:g} |" for r in parts]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--iter-ms", type=float, default=None,
                    help="the benchmark's iteration time, for the idle row")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
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
