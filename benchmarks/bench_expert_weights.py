"""What the Megatron plugin's expert-weight plumbing costs per layer, next to the layer itself.

    python benchmarks/bench_expert_weights.py --out OUT [--cases guide,dsv3]

DistMoELayer keeps SequentialMLP's per-expert parameters (checkpoint layout) and takes them as
w13 [E, 2F, D] and w2 [E, D, F] on every forward (`stack_expert_weights`): a view when they are
packed in one storage (DistMoEExperts packs them; Megatron's distributed optimizer moves them
into its own buffer, and then each forward copies them). In backward each
expert's slice of the stacked bf16 gradient goes to its parameter: into the fp32 `main_grad`
with Megatron's gradient_accumulation_fusion (`_StackExpertWeights.backward`), else as `.grad`,
which Megatron's DDP hook adds into `main_grad` the same way. Rows, one GPU, bf16 weights:
    stack                  the forward's two stacks of unpacked weights (a copy: reads and
                           writes the weights once)
    stack_packed           the same on packed weights (views; the baseline is `stack`)
    main_grad_add          the fused backward: main_grad += g (g bf16, upcast inside the add)
    main_grad_add_upcast   the same through an fp32 temporary, main_grad += g.to(fp32) (the
                           plugin's code before 2026-12-01; the baseline of main_grad_add)
    copy_floor             a plain copy of the stack's bytes (the HBM floor of `stack`)
    wgrad_into_main_grad   both WGRAD GEMMs (2048 rows per expert) adding their fp32 sums
                           straight into the experts' main_grad (routed_experts(wgrad_into=...),
                           what the plugin does under DDP since 2026-12-01)
    wgrad_bf16_then_add    the same two WGRADs storing a stacked bf16 gradient, then
                           main_grad_add (the plugin before; the baseline of the row above)
Correctness first: the stack equals torch.stack (the packed one is a view), both adds give the
same main_grad bits, and both WGRAD paths match an fp32 torch reference (the fused one to fp32
rounding).
Timing: the guide's method (10 warm-ups, 5 windows x 30 calls, median window), eager launches.
CSV rows (commit, GPU, shape, ms, GB/s in the note, ratio to the baseline) and a plot go to OUT.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import append_csv, git_commit, time_windows  # noqa: E402
from plotting import pyplot  # noqa: E402

CASES = {   # per-GPU expert shapes of bench_layer's cases
    "guide": dict(E=6, D=7168, F=3072),
    "dsv3": dict(E=8, D=7168, F=2048),
    "tiny": dict(E=3, D=64, F=32),      # for the CPU test of the checks
}


def make_experts(E: int, D: int, F: int, dev) -> tuple[list, list]:
    """Per-expert bf16 parameters (fc1 [2F, D], fc2 [D, F]) with fp32 main_grad, as DDP sets."""
    def param(*shape):
        p = torch.nn.Parameter(torch.randn(*shape, device=dev).to(torch.bfloat16))
        p.main_grad = torch.zeros(*shape, dtype=torch.float32, device=dev)
        p.grad_added_to_main_grad = False
        return p
    return [param(2 * F, D) for _ in range(E)], [param(D, F) for _ in range(E)]


def add_fused(params, grads_E) -> None:
    for p, g in zip(params, grads_E.unbind(0)):
        p.main_grad.add_(g)


def add_upcast(params, grads_E) -> None:
    for p, g in zip(params, grads_E.unbind(0)):
        p.main_grad.add_(g.to(p.main_grad.dtype))


def check_case(name: str, dev):
    """Correctness first: (fc1, fc2, g13, g2) after checking the stack and both adds."""
    from megatron_dist_moe.megatron.layer import stack_expert_weights
    c = CASES[name]
    E, D, F = c["E"], c["D"], c["F"]
    fc1, fc2 = make_experts(E, D, F, dev)
    g13 = torch.randn(E, 2 * F, D, device=dev).to(torch.bfloat16)
    g2 = torch.randn(E, D, F, device=dev).to(torch.bfloat16)
    w13, w2 = stack_expert_weights(fc1, True), stack_expert_weights(fc2, True)
    if not (torch.equal(w13, torch.stack([p.detach() for p in fc1]))
            and torch.equal(w2, torch.stack([p.detach() for p in fc2]))):
        raise SystemExit(f"{name}: stack_expert_weights differs from torch.stack")
    (w13.float() * g13.float()).sum().backward(retain_graph=False)   # the plugin's fused path
    if not all(torch.equal(p.main_grad, g.float()) for p, g in zip(fc1, g13.unbind(0))):
        raise SystemExit(f"{name}: the fused backward did not add the gradient into main_grad")
    for p in fc1 + fc2:
        p.main_grad.zero_()
    add_fused(fc1, g13)
    fused_bits = [p.main_grad.clone() for p in fc1]
    for p in fc1:
        p.main_grad.zero_()
    add_upcast(fc1, g13)
    if not all(torch.equal(p.main_grad, b) for p, b in zip(fc1, fused_bits)):
        raise SystemExit(f"{name}: main_grad += g and main_grad += g.to(fp32) differ")
    for p in fc1 + fc2:
        p.main_grad.zero_()
    packed = packed_experts(fc1 + fc2, E)
    v13 = stack_expert_weights(packed[:E], True)
    if not (v13.data_ptr() == packed[0].data_ptr() and torch.equal(v13, w13.detach())):
        raise SystemExit(f"{name}: the stack of packed weights is not a view of them")
    print(f"[{name}] checks OK (stack == torch.stack, a view when packed; both adds give the "
          "same main_grad bits)", flush=True)
    return fc1, fc2, g13, g2


def packed_experts(params: list, E: int) -> list:
    """Copies of fc1 (first E) and fc2 (last E) parameters packed as DistMoEExperts packs them."""
    from megatron_dist_moe.megatron.layer import pack_expert_weights
    out = [torch.nn.Parameter(p.detach().clone()) for p in params]
    if not (pack_expert_weights(out[:E]) and pack_expert_weights(out[E:])):
        raise SystemExit("pack_expert_weights refused same-shaped weights")
    return out


def run_case(name: str, dev, commit: str, gpu: str) -> list[dict]:
    from megatron_dist_moe.megatron.layer import stack_expert_weights
    fc1, fc2, g13, g2 = check_case(name, dev)
    E, D, F = CASES[name]["E"], CASES[name]["D"], CASES[name]["F"]
    n_elems = E * 3 * F * D                      # both weights' elements
    src = torch.empty(n_elems, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    packed = packed_experts(fc1 + fc2, E)
    fns = {
        "stack": (lambda: (stack_expert_weights(fc1, True), stack_expert_weights(fc2, True)),
                  4 * n_elems),                   # read bf16 + write bf16
        "stack_packed": (lambda packed=packed: (stack_expert_weights(packed[:E], True),
                                                stack_expert_weights(packed[E:], True)), 0),
        "main_grad_add": (lambda: (add_fused(fc1, g13), add_fused(fc2, g2)),
                          10 * n_elems),          # read bf16 + read fp32 + write fp32
        "main_grad_add_upcast": (lambda: (add_upcast(fc1, g13), add_upcast(fc2, g2)),
                                 18 * n_elems),   # + write and read an fp32 temporary
        "copy_floor": (lambda: dst.copy_(src), 4 * n_elems),
    }
    times = {}
    for path, (fn, nbytes) in fns.items():
        with torch.no_grad() if not path.startswith("stack") else torch.enable_grad():
            t = time_windows(fn, graph=False)
        times[path] = (t, nbytes)
        print(f"  {name:6s} {path:22s} {t.median_ms:7.3f} ms [{t.min_ms:.3f}-{t.max_ms:.3f}]  "
              f"{nbytes / t.median_ms / 1e6:7.0f} GB/s", flush=True)
    del packed
    flops = {}
    if dev.type == "cuda":
        wgrad_fns, wgrad_flops = wgrad_paths(fc1, fc2, E, D, F, dev)
        for path, fn in wgrad_fns.items():
            with torch.no_grad():
                t = time_windows(fn, graph=False)
            times[path] = (t, 0)
            flops[path] = wgrad_flops
            print(f"  {name:6s} {path:22s} {t.median_ms:7.3f} ms [{t.min_ms:.3f}-{t.max_ms:.3f}]  "
                  f"{wgrad_flops / t.median_ms / 1e9:7.1f} TFLOP/s", flush=True)
    base = {"stack": "copy_floor", "stack_packed": "stack",
            "main_grad_add": "main_grad_add_upcast",
            "wgrad_into_main_grad": "wgrad_bf16_then_add"}
    rows = []
    for path, (t, nbytes) in times.items():
        ref = times[base.get(path, path)][0].median_ms
        note = (f"{nbytes / 1e9:.2f} GB moved, {nbytes / t.median_ms / 1e6:.0f} GB/s" if nbytes
                else "views, no bytes moved" if path == "stack_packed"
                else "both WGRAD GEMMs, 2048 rows per expert")
        rows.append(dict(commit=commit, gpu=gpu, ep=1, case=name, T="", D=D, F=F, K="",
                         E_local=E, imbalance="", path=path, mode="weights",
                         ms=round(t.median_ms, 4), ms_min=round(t.min_ms, 4),
                         ms_max=round(t.max_ms, 4),
                         useful_tflops=round(flops.get(path, 0) / t.median_ms / 1e9, 1),
                         ratio_to_baseline=round(ref / t.median_ms, 4),
                         note=note + (f"; baseline {base[path]}" if path in base else "")))
    return rows


def wgrad_paths(fc1, fc2, E: int, D: int, F: int, dev, rows_per_expert: int = 2048):
    """({path: fn}, useful flops) of the two WGRAD paths into main_grad, after checking both
    against an fp32 torch reference (GPU: the Triton kernels)."""
    from megatron_dist_moe.kernels.grouped_gemm import ExpertOutTable, grouped_mm_wgrad
    R = E * rows_per_expert
    offs = (torch.arange(E + 1, dtype=torch.int32, device=dev) * rows_per_expert).contiguous()
    gen = torch.Generator(device=dev).manual_seed(5)
    def rnd(*shape):
        return (torch.randn(*shape, device=dev, generator=gen) * 0.1).to(torch.bfloat16)
    gh1, xg, g3, h2 = rnd(R, 2 * F), rnd(R, D), rnd(R, D), rnd(R, F)
    out13 = torch.empty(E, 2 * F, D, dtype=torch.bfloat16, device=dev)
    out2 = torch.empty(E, D, F, dtype=torch.bfloat16, device=dev)
    t13 = ExpertOutTable.of([p.main_grad for p in fc1])
    t2 = ExpertOutTable.of([p.main_grad for p in fc2])

    def fused():
        grouped_mm_wgrad(g3, h2, offs, t2, accumulate=True)
        grouped_mm_wgrad(gh1, xg, offs, t13, accumulate=True)

    def stacked():
        grouped_mm_wgrad(g3, h2, offs, out2)
        grouped_mm_wgrad(gh1, xg, offs, out13)
        add_fused(fc2, out2)
        add_fused(fc1, out13)

    def ref(e):
        s = slice(e * rows_per_expert, (e + 1) * rows_per_expert)
        return gh1[s].float().T @ xg[s].float(), g3[s].float().T @ h2[s].float()

    for path, fn, tol in (("wgrad_into_main_grad", fused, 1e-4), ("wgrad_bf16_then_add", stacked, 8e-3)):
        for p in fc1 + fc2:
            p.main_grad.zero_()
        fn()
        for e in range(E):
            for got, want in zip((fc1[e].main_grad, fc2[e].main_grad), ref(e)):
                err = float((got - want).norm() / want.norm())
                if not err <= tol:
                    raise SystemExit(f"{path}: expert {e} main_grad rel err {err:.3g} > {tol}")
    print("  WGRAD paths checked against fp32 torch (fused <= 1e-4, bf16 store <= 8e-3)",
          flush=True)
    return ({"wgrad_into_main_grad": fused, "wgrad_bf16_then_add": stacked},
            2 * R * (2 * F * D + D * F))


def plot(rows: list[dict], path: str, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    cases = list(dict.fromkeys(r["case"] for r in rows))
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / len(paths)
    for i, p in enumerate(paths):
        ys = [next(r["ms"] for r in rows if r["case"] == c and r["path"] == p) for c in cases]
        xs = [j + i * w for j in range(len(cases))]
        ax.bar(xs, ys, w, label=p)
        for x, y in zip(xs, ys):
            ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([j + w * (len(paths) - 1) / 2 for j in range(len(cases))])
    ax.set_xticklabels(cases)
    ax.set_ylabel("ms per layer call")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--cases", default="guide,dsv3")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; choose from {sorted(CASES)}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    dev = torch.device("cuda", 0)
    commit, gpu = git_commit(), torch.cuda.get_device_name(dev)
    rows = []
    for name in args.cases.split(","):
        rows += run_case(name, dev, commit, gpu)
    os.makedirs(args.out, exist_ok=True)
    append_csv(os.path.join(args.out, "bench_expert_weights.csv"), rows)
    plot(rows, os.path.join(args.out, "bench_expert_weights.png"),
         f"Megatron plugin weight plumbing per layer call, bf16 weights, fp32 main_grad ({commit}, {gpu})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
