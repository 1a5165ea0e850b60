"""Does a CUDA graph slow down when it is replayed back to back? Per-replay times from idle,
next to the SM clock and the board power.

    torchrun --nproc-per-node=2 benchmarks/bench_sustained.py --out OUT [--seconds 4] [--idle-s 3]

Why: at the guide load the timed fwd+bwd iteration (common.time_windows: 10 warm-ups, then
windows of 30 back-to-back replays) is ~1 ms longer than the device span of the same graph in
the profiler (5 replays after a synchronize), although inside the graph the GPU idles only
~0.02 ms per iteration (profile_breakdown.py --gaps). The hypothesis: under sustained load the
GPU lowers its SM clock (power or thermal limit), so the same kernels take longer in the timing
windows than in the short profiled burst. Prediction: the first replays after an idle pause run
at the profiled speed (fwd+bwd ~8.0 ms, SM clock near its maximum) and settle within well under
a second at the timed speed (~8.9 ms) at a lower clock; the dense bf16 GEMM (8192^3, the peak
the floor is computed from) slows down the same way.

For each workload (dense bf16 mm 8192^3 on every GPU; the guide-load layer forward and
forward+backward of our CUDA backend): check correctness (mm against fp32 on sampled rows; the
layer against the NCCL all-to-all baseline), capture one call into a CUDA graph, synchronize,
idle `--idle-s` seconds on every rank, then replay it back to back for `--seconds` with a CUDA
event between replays while `nvidia-smi` samples the SM clock, power, temperature and the
clock-event reasons every 20 ms. Per replay: the time of the slowest rank.

Writes to OUT:
    bench_sustained.csv         per workload: "burst" (median of the first 5 replays) and
                                "settled" (median of the last half) rows: ms, useful TFLOP/s,
                                ratio_to_baseline = our TFLOP/s over the dense mm's in the same
                                phase (the fraction of the peak); the note has clocks and power
    bench_sustained_replays.csv workload, replay, start ms, ms
    bench_sustained_clocks.csv  workload, rank, s from the first replay, SM MHz, W, C, reasons
    bench_sustained.png         per-replay ms and SM clock against time, one panel per workload
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import append_csv, capture_graph, dense_mm_setup, git_commit  # noqa: E402
from plotting import pyplot  # noqa: E402

SMI_FIELDS = ["timestamp", "clocks.sm", "power.draw", "temperature.gpu",
              "clocks_event_reasons.active"]
BURST = 5   # replays in the "burst" figure: what a short profiled run sees


def parse_smi_lines(lines: list[str], t0: float) -> list[dict]:
    """nvidia-smi `--format=csv,noheader,nounits` lines of SMI_FIELDS (the reasons column may be
    missing) -> [{t_s (host seconds after t0), sm_mhz, power_w, temp_c, reasons}]; lines that do
    not parse (headers, '[N/A]', errors) are skipped."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            ts = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rec = dict(t_s=round(ts - t0, 4), sm_mhz=float(parts[1]), power_w=float(parts[2]),
                       temp_c=float(parts[3]), reasons=parts[4] if len(parts) > 4 else "")
        except ValueError:
            continue
        out.append(rec)
    return out


def settle_stats(replay_ms: list[float], burst: int = BURST) -> dict:
    """burst = median of the first `burst` replays, settled = median of the last half, slowdown
    = settled / burst, settle_index = the first replay from which the 5-replay running median
    stays within 2% of settled (how fast the slowdown sets in)."""
    if len(replay_ms) < 2 * burst:
        raise ValueError(f"{len(replay_ms)} replays: need at least {2 * burst}")
    b = statistics.median(replay_ms[:burst])
    s = statistics.median(replay_ms[len(replay_ms) // 2:])
    run = [statistics.median(replay_ms[max(0, i - 4):i + 1]) for i in range(len(replay_ms))]
    settle = len(run) - 1
    while settle > 0 and abs(run[settle - 1] - s) <= 0.02 * s:
        settle -= 1
    return dict(burst_ms=b, settled_ms=s, slowdown=s / b, settle_index=settle)


class ClockSampler:
    """`nvidia-smi` in the background, sampling this rank's GPU every `period_ms`; falls back to
    the older field name (clocks_throttle_reasons) and then to no reasons column."""

    def __init__(self, gpu_index: int, period_ms: int = 20):
        self.proc = None
        for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active", None):
            fields = SMI_FIELDS[:4] + ([reasons] if reasons else [])
            cmd = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                   "-i", str(gpu_index)]
            try:
                ok = subprocess.run(cmd, capture_output=True, text=True, timeout=20).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                return   # no nvidia-smi: no clock samples, the timings still stand
            if ok:
                self.cmd = cmd + ["-lms", str(period_ms)]
                return

    def start(self):
        if getattr(self, "cmd", None):
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)

    def stop(self, t0: float) -> list[dict]:
        if self.proc is None:
            return []
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=20)
        self.proc = None
        return parse_smi_lines(out.splitlines(), t0)


def agreed_replays(seconds: float, est_ms: float) -> int:
    """Replays that fill ~`seconds` at `est_ms` each, the same on every rank (the largest): each
    rank's estimate differs a little, and the per-replay times are all-reduced element by element
    afterwards, which hangs when the counts differ (the first GPU run of this benchmark did)."""
    n = torch.tensor([max(2 * BURST, int(seconds * 1e3 / est_ms))], dtype=torch.int64)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            n = n.cuda()
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n.item())


def replay_back_to_back(g: torch.cuda.CUDAGraph, seconds: float, est_ms: float,
                        sampler: ClockSampler, idle_s: float) -> tuple[list[float], list[dict]]:
    """Idle, then replay `g` back to back for ~`seconds` with an event between replays: per-replay
    ms (max over ranks) and this rank's clock samples (t_s from the first launch)."""
    n = agreed_replays(seconds, est_ms)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    time.sleep(idle_s)
    sampler.start()
    time.sleep(0.2)   # a few samples of the idle state
    if dist.is_initialized():
        dist.barrier()
    t0 = time.time()
    ev[0].record()
    for i in range(n):
        g.replay()
        ev[i + 1].record()
    torch.cuda.synchronize()
    time.sleep(0.1)
    samples = sampler.stop(t0)
    ms = torch.tensor([ev[i].elapsed_time(ev[i + 1]) for i in range(n)], device="cuda")
    if dist.is_initialized():
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.tolist(), samples


def plot(series: dict, path: str, gpu: str) -> None:
    """series: {workload: (replay_ms, samples_by_rank {rank: [...]})} -> one panel per workload."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(len(series), 1, figsize=(9, 3 * len(series)), squeeze=False)
    for ax, (name, (ms, samples)) in zip(axes[:, 0], series.items()):
        t = [0.0]
        for m in ms[:-1]:
            t.append(t[-1] + m / 1e3)
        ax.plot(t, ms, ".", ms=2, color="tab:blue", label="ms per replay (max over ranks)")
        ax.set_ylabel("ms per replay", color="tab:blue")
        ax.set_title(f"{gpu}: {name}")
        ax2 = ax.twinx()
        for rank, recs in samples.items():
            ax2.plot([r["t_s"] for r in recs], [r["sm_mhz"] for r in recs], "-", lw=1,
                     label=f"SM clock rank {rank}", color=("tab:red", "tab:orange")[rank % 2])
        ax2.set_ylabel("SM MHz", color="tab:red")
        ax.set_xlabel("s from the first replay")
        ax.legend(loc="upper left", fontsize=7)
        ax2.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


# The guide's W13 FPROP (6 experts x 2048 rows, D=7168, 2F=6144) + SwiGLU, and its two WGRADs, on
# each GPU alone, by several GEMM implementations: which keeps more of its speed at the
# power-capped clock?
GEMM_WORKLOADS = {
    "w13_triton": "our Triton grouped GEMM with the fused SwiGLU epilogue",
    "w13_cutlass": "CUTLASS warp-specialized grouped GEMM (csrc/) + our SwiGLU row kernel",
    "w13_torch": "torch._grouped_mm alone (no SwiGLU)",
    # both WGRADs of the guide's load (W13: [2F, D], W2: [D, F] per expert, K = 2048 rows)
    "wgrad_triton": "our persistent Triton WGRAD, W13 then W2",
    "wgrad_cutlass_coop": "CUTLASS warp-specialized grouped WGRAD (csrc/), 128x256 tiles",
    "wgrad_torch": "torch._grouped_mm WGRADs (bf16 out)",
    # fp32 weight gradients (Config.wgrad_dtype's default): the epilogue stores twice the bytes
    "wgrad_triton_f32": "our persistent Triton WGRAD, fp32 out",
    "wgrad_cutlass_coop_f32": "CUTLASS grouped WGRAD (csrc/), 128x256 tiles, fp32 out",
    # the layer's six grouped GEMMs of one fwd+bwd, in its order, without any communication or
    # row kernel: the floor of the layer's fwd+bwd on this GPU (2048 rows per expert, so no
    # ragged tiles; ours includes the 151 MB h1 restore the fused SwiGLU backward needs)
    "gemms_triton": "the layer's six GEMM launches of one fwd+bwd, alone",
    "gemms_torch": "the same six GEMMs on torch._grouped_mm (no epilogue work)",
}
# the layer at the guide load: our standard pipeline, the Mega pipeline, fp8_block (weights
# quantized once, as bench_layer's _cached paths), forward or forward+backward
LAYER_WORKLOAD = r"dist_moe(_mega|_fp8)?_(fwd|fwdbwd)"
LAYER_GEMMS = ("fwd_swiglu", "fwd_w2_scatter", "dgrad_w2_swiglu_bwd", "wgrad_w2", "dgrad_w13",
               "wgrad_w13")


def gemm_workload(name: str, dev: torch.device):
    """(fn, useful flops, relative error against torch) of a GEMM_WORKLOADS entry."""
    from bench_grouped_gemm import Problem
    prob = Problem(6, 2048, 7168, 3072)
    if name == "w13_triton":
        return prob.ours("fwd_swiglu"), prob.flops("fwd_swiglu"), prob.check("fwd_swiglu")
    if name == "w13_cutlass":
        from megatron_dist_moe.kernels.grouped_gemm_sm90 import GroupedFpropSm90
        gemm = GroupedFpropSm90(6, dev, "coop")
        err = prob.check_cutlass("fwd_swiglu", gemm)
        return prob.cutlass_fns("fwd_swiglu", gemm)[0], prob.flops("fwd_swiglu"), err
    if name == "w13_torch":   # the reference itself
        return prob.torch_fns("fwd_swiglu")[1], prob.flops("fwd_swiglu"), 0.0
    if name.startswith("gemms_"):
        flops = sum(prob.flops(k) for k in LAYER_GEMMS)
        if name == "gemms_torch":
            fns = [prob.torch_fns(k)[1] for k in LAYER_GEMMS]
            err = 0.0
        else:
            fns = [prob.ours(k) for k in LAYER_GEMMS]
            err = max(prob.check(k) for k in LAYER_GEMMS)

        def all_six():
            for f in fns:
                f()
        return all_six, flops, err
    if name.startswith("wgrad_"):
        kernels = ("wgrad_w13", "wgrad_w2")
        flops = sum(prob.flops(k) for k in kernels)
        out_dtype = torch.bfloat16
        if name.endswith("_f32"):
            out_dtype, name = torch.float32, name[:-4]
            prob.dw13, prob.dw2 = prob.dw13.float(), prob.dw2.float()
        if name == "wgrad_torch":
            fns = [prob.torch_fns(k)[1] for k in kernels]
            return (lambda: [f() for f in fns]), flops, 0.0
        if name == "wgrad_triton":
            fns = [prob.ours(k) for k in kernels]
            err = max(prob.check(k) for k in kernels)
        else:
            from megatron_dist_moe.kernels.grouped_gemm_sm90 import GroupedWgradSm90
            gemm = GroupedWgradSm90(6, dev, name.rsplit("_", 1)[1], out_dtype)
            fns = [prob.cutlass_fns(k, gemm)[1] for k in kernels]
            err = max(prob.check_cutlass(k, gemm) for k in kernels)

        def both():
            for f in fns:
                f()
        return both, flops, err
    raise ValueError(f"unknown workload {name!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--seconds", type=float, default=4.0, help="back-to-back replay time")
    ap.add_argument("--idle-s", type=float, default=3.0, help="idle pause before each workload")
    ap.add_argument("--workloads", default="dense_mm,dist_moe_fwd,dist_moe_fwdbwd",
                    help="comma list of dense_mm, dist_moe[_mega|_fp8]_{fwd,fwdbwd} (the Mega "
                         "pipeline; fp8_block with its weights quantized once) and the one-GPU "
                         f"grouped GEMMs {','.join(GEMM_WORKLOADS)}")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    EP = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    os.makedirs(args.out, exist_ok=True)
    gpu, commit = torch.cuda.get_device_name(), git_commit()
    sampler = ClockSampler(local)
    series, rows, failed = {}, [], False

    from bench_layer import (CASES, FP8_CHECK, check_against_reference, dist_moe_fns,
                             layer_config, make_layer_inputs, useful_flops)
    from baselines import a2a_grouped_mm_experts

    import megatron_dist_moe as dm

    unknown = [n for n in args.workloads.split(",")
               if n != "dense_mm" and n not in GEMM_WORKLOADS and not re.fullmatch(LAYER_WORKLOAD, n)]
    if unknown:   # before anything runs
        raise SystemExit(f"--workloads: unknown workload(s) {unknown}")
    for name in args.workloads.split(","):
        ctx = None
        if name == "dense_mm":
            fn, flops, err = dense_mm_setup(dev)
            ok = err < 1e-2
            shape = "8192^3"
        elif name in GEMM_WORKLOADS:
            fn, flops, err = gemm_workload(name, dev)
            ok = err < 1e-2
            shape = "E=6 rows=12288 D=7168 F=3072 (one GPU)"
        else:
            m = re.fullmatch(LAYER_WORKLOAD, name)
            c = CASES["guide"]
            inp = make_layer_inputs(c, rank, EP, dev)
            y = a2a_grouped_mm_experts(inp["x"], inp["ids"], inp["s"], inp["w13"], inp["w2"])
            ref_gx, = torch.autograd.grad(y, (inp["x"],), inp["gy"])
            cfg = layer_config(c, EP, inp["scratch_factor"],
                               "mega" if m.group(1) == "_mega" else "standard")
            fp8 = m.group(1) == "_fp8"
            if fp8:   # weights quantized on the first call only (bench_layer's _cached paths)
                cfg = cfg.replace(precision="fp8_block")
            ctx = dm.create_context(config=cfg, device=dev)
            y2 = dm.routed_experts(inp["x"], inp["ids"], inp["s"], inp["w13"], inp["w2"], ctx,
                                   is_first_microbatch=True if fp8 else None)
            gx, = torch.autograd.grad(y2, (inp["x"],), inp["gy"])
            ok = check_against_reference(name, y2.detach(), gx, y.detach(), ref_gx, rank,
                                         FP8_CHECK if fp8 else (0.0, 2e-2))
            err = None
            fwd, fwdbwd = dist_moe_fns(ctx, inp, False if fp8 else None)
            fn = fwdbwd if name.endswith("fwdbwd") else fwd
            mode = "fwdbwd" if name.endswith("fwdbwd") else "fwd"
            flops = useful_flops(c["T"], c["K"], c["D"], c["F"], mode)
            shape = f"T={c['T']} D={c['D']} F={c['F']} K={c['K']} E_local={c['E_local']}"
            del y, y2, gx, ref_gx
        if rank == 0:
            print(f"[{name}] check {'OK' if ok else 'MISMATCH'}"
                  + (f" (rel err {err:.1e})" if err is not None else ""), flush=True)
        if not ok:
            failed = True
            if ctx is not None:
                ctx.close()
            continue
        g = capture_graph(fn)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        est_ms = (time.perf_counter() - t) * 1e3
        ms, samples = replay_back_to_back(g, args.seconds, est_ms, sampler, args.idle_s)
        gathered = [None] * EP
        dist.all_gather_object(gathered, samples)
        st = settle_stats(ms)
        series[name] = (ms, dict(enumerate(gathered)))
        if rank == 0:
            with open(os.path.join(args.out, "bench_sustained_replays.csv"), "a", newline="") as f:
                w = csv.writer(f)
                start = 0.0
                for i, m in enumerate(ms):
                    w.writerow([name, i, round(start, 4), round(m, 4)])
                    start += m
            with open(os.path.join(args.out, "bench_sustained_clocks.csv"), "a", newline="") as f:
                w = csv.writer(f)
                for r, recs in enumerate(gathered):
                    for s in recs:
                        w.writerow([name, r, s["t_s"], s["sm_mhz"], s["power_w"], s["temp_c"],
                                    s["reasons"]])
            busy = [s for s in gathered[0] if s["t_s"] >= 0]
            early = [s for s in busy if s["t_s"] < 0.1]
            late = busy[len(busy) // 2:]
            def clk(rs, k):
                return statistics.median([s[k] for s in rs]) if rs else float("nan")
            note = (f"{len(ms)} replays; settled from replay {st['settle_index']}; rank 0 SM "
                    f"{clk(early, 'sm_mhz'):.0f} MHz in the first 0.1 s, {clk(late, 'sm_mhz'):.0f} "
                    f"MHz settled, {clk(late, 'power_w'):.0f} W, "
                    f"reasons {late[-1]['reasons'] if late else '?'}")
            print(f"  burst {st['burst_ms']:.3f} ms  settled {st['settled_ms']:.3f} ms  "
                  f"slowdown {st['slowdown']:.3f}  {note}", flush=True)
            for phase, m in (("burst", st["burst_ms"]), ("settled", st["settled_ms"])):
                rows.append(dict(commit=commit, gpu=gpu, ep=EP, case=shape, path=name, mode=phase,
                                 ms=round(m, 4), useful_tflops=round(flops / (m * 1e-3) / 1e12, 1),
                                 ratio_to_baseline="", note=note))
        del g
        if ctx is not None:
            ctx.close()
    if rank == 0 and rows:
        peak = {r["mode"]: r["useful_tflops"] for r in rows if r["path"] == "dense_mm"}
        for r in rows:
            if r["mode"] in peak:
                r["ratio_to_baseline"] = round(r["useful_tflops"] / peak[r["mode"]], 3)
        append_csv(os.path.join(args.out, "bench_sustained.csv"), rows)
        plot(series, os.path.join(args.out, "bench_sustained.png"), f"{EP}x {gpu}")
        print(f"\n{'workload':<18} {'phase':<8} {'ms':>8} {'TFLOP/s':>8} {'of mm':>6}")
        for r in rows:
            print(f"{r['path']:<18} {r['mode']:<8} {r['ms']:8.3f} {r['useful_tflops']:8.1f} "
                  f"{r['ratio_to_baseline']!s:>6}")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
