"""Train a tiny MoE language model in bf16 (and other precisions), evaluate it with NVFP4 experts.

The model is plain torch around `dm.routed_experts`: token embedding, `--layers` blocks of
[RMSNorm, causal self-attention, RMSNorm, top-k router, routed SwiGLU experts], a tied output
head. Experts are sharded over the ranks (expert parallel); everything else is replicated and
its gradients averaged. Data: sequences of a fixed random Markov chain over `--vocab` tokens
(each token has a few likely successors), so the loss has a floor the model can approach.

After training, the held-out loss is measured twice on the same batches: with bf16 experts
(an inference context) and with the experts' weights prepared once in NVFP4
(`dm.prepare_expert_weights(..., precision="nvfp4")`, x and h2 quantized to NVFP4 as well).
The script exits 1 when the NVFP4 loss is more than `--max-loss-increase` (default 2%) above
the bf16 one.

`--train-precisions bf16,fp8_block,mxfp8` also trains one model per precision from the same
weights on the same batches, and `--repeat-perturb EPS` `--repeats` more bf16 models from the
weights times (1 + EPS N(0, 1)), each its own draw: the run-to-run noise band. A precision is
"within the bf16 noise band" when the largest gap between its 10-step moving-average loss and
bf16's is no larger than the largest gap between two of the bf16 curves (the rule of
benchmarks/megatron_loss_noise.py); the script then also exits 1 for a precision outside it.
`--first-repeat N` trains repeats N+1 ... N+repeats only (with the unperturbed bf16 model):
benchmarks/lm_noise_band.py merges them into the seed's first run for a wider band sample.
`--csv` writes the per-step losses (and, with matplotlib, a plot of their moving averages next
to it).

    python examples/tiny_lm_nvfp4_eval.py                     # CPU: reference backend, 2 ranks
    torchrun --nproc-per-node=1 examples/tiny_lm_nvfp4_eval.py --device cuda --hidden 1024 \\
        --ffn 2048 --steps 600                                # one GPU: the CUDA backend
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as Fn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import megatron_dist_moe as dm  # noqa: E402
from megatron_dist_moe.testing import (moving_average, moving_average_gap,  # noqa: E402
                                       noise_band)

BF = torch.bfloat16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--nproc", type=int, default=2, help="CPU: ranks to spawn (gloo)")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256, help="expert intermediate size F")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-loss-increase", type=float, default=0.02,
                   help="fail when nvfp4 loss > bf16 loss x (1 + this)")
    p.add_argument("--train-precisions", default="bf16",
                   help="comma list; bf16 always trains (its model is the one evaluated)")
    p.add_argument("--repeat-perturb", type=float, default=0.0, metavar="EPS",
                   help="also train bf16 repeats from perturbed weights (the noise band)")
    p.add_argument("--repeats", type=int, default=2,
                   help="with --repeat-perturb: how many bf16 repeats (each its own draw)")
    p.add_argument("--first-repeat", type=int, default=0, metavar="N",
                   help="the first repeat's draw (repeats N+1 ... N+repeats): more repeats for a "
                        "seed's band without training its first ones again "
                        "(benchmarks/lm_noise_band.py merges the runs)")
    p.add_argument("--csv", default=None, help="per-step losses of every trained model")
    p.add_argument("--json", default=None, help="write the figures here (rank 0)")
    args = p.parse_args(argv)
    if args.hidden % 128 or args.ffn % 128:
        p.error("--hidden and --ffn must be multiples of 128 (NVFP4 and the kernels' tiles)")
    if args.hidden % args.heads:
        p.error("--hidden must be a multiple of --heads")
    args.train_precisions = list(dict.fromkeys(["bf16"] + args.train_precisions.split(",")))
    bad = [q for q in args.train_precisions if q not in ("bf16", "fp8_block", "mxfp8")]
    if bad:
        p.error(f"--train-precisions: {bad} do not train (bf16, fp8_block, mxfp8 do)")
    if not 0.0 <= args.repeat_perturb < 0.1:
        p.error(f"--repeat-perturb must be in [0, 0.1), got {args.repeat_perturb}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.first_repeat < 0:
        p.error(f"--first-repeat must be >= 0, got {args.first_repeat}")
    return args


class MarkovData:
    """Sequences of a random Markov chain: each token has 4 successors with fixed odds."""

    def __init__(self, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        succ = torch.randint(0, vocab, (vocab, 4), generator=g)
        probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
        self.table = torch.zeros(vocab, vocab)
        for v in range(vocab):
            self.table[v].index_add_(0, succ[v], probs)
        self.vocab = vocab
        # the loss floor: the chain's entropy rate (its stationary law ~ uniform here)
        p = self.table
        self.entropy = float(-(p * torch.log(p.clamp_min(1e-30))).sum(1).mean())

    def batch(self, n: int, seq: int, g: torch.Generator) -> torch.Tensor:
        out = torch.empty(n, seq + 1, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab, (n,), generator=g)
        for t in range(seq):
            out[:, t + 1] = torch.multinomial(self.table[out[:, t]], 1, generator=g)[:, 0]
        return out


class TinyMoELM(torch.nn.Module):
    def __init__(self, args, rank: int, world: int):
        super().__init__()
        D, F, E = args.hidden, args.ffn, args.experts
        self.args, self.E_local = args, E // world
        g = torch.Generator().manual_seed(args.seed)   # the same replicated weights everywhere

        def rnd(*shape, std=0.02):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * std)

        self.emb = rnd(args.vocab, D)
        self.blocks = torch.nn.ModuleList()
        for _ in range(args.layers):
            b = torch.nn.Module()
            b.qkv, b.proj = rnd(3 * D, D), rnd(D, D, std=0.02 / math.sqrt(2 * args.layers))
            b.router = rnd(E, D)
            w13 = torch.randn(E, 2 * F, D, generator=g) * D ** -0.5
            w2 = torch.randn(E, D, F, generator=g) * F ** -0.5 / math.sqrt(2 * args.layers)
            lo, hi = rank * self.E_local, (rank + 1) * self.E_local
            b.w13 = torch.nn.Parameter(w13[lo:hi].clone())     # this rank's experts
            b.w2 = torch.nn.Parameter(w2[lo:hi].clone())
            self.blocks.append(b)

    def expert_params(self):
        return [p for b in self.blocks for p in (b.w13, b.w2)]

    def forward(self, tokens, ctxs, prepared=None):
        """Mean next-token loss of tokens [B, L+1]; ctxs: one Context per layer; prepared:
        per-layer PreparedExperts (nvfp4 inference) or None (the bf16 weights)."""
        a = self.args
        x = self.emb[tokens[:, :-1]]
        B, L, D = x.shape
        for i, b in enumerate(self.blocks):
            h = Fn.rms_norm(x, (D,))
            q, k, v = (h @ b.qkv.T).view(B, L, 3, a.heads, D // a.heads).permute(2, 0, 3, 1, 4)
            att = Fn.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + att.transpose(1, 2).reshape(B, L, D) @ b.proj.T
            h = Fn.rms_norm(x, (D,)).reshape(B * L, D)
            probs = torch.softmax(h.float() @ b.router.T.float(), dim=-1)
            top, ids = probs.topk(a.topk, dim=-1)
            scores = top / top.sum(-1, keepdim=True)
            if prepared is None:
                w13, w2 = b.w13.to(BF), b.w2.to(BF)
            else:
                w13, w2 = prepared[i].w13, prepared[i].w2
            y = dm.routed_experts(h.to(BF), ids, scores, w13, w2, ctxs[i])
            x = x + y.to(x.dtype).view(B, L, D)
        logits = Fn.rms_norm(x, (D,)) @ self.emb.T
        return Fn.cross_entropy(logits.reshape(-1, a.vocab).float(), tokens[:, 1:].reshape(-1))


def make_contexts(args, device, world: int, **over):
    T = args.batch * args.seq
    cfg = dm.Config(num_local_input_tokens=T, hidden_dim=args.hidden, intermediate_dim=args.ffn,
                    top_k=args.topk, num_experts=args.experts, **over)
    return [dm.create_context(config=cfg, device=device) for _ in range(args.layers)]


def evaluate(model, ctxs, data, args, device, rank, prepared=None) -> float:
    g = torch.Generator().manual_seed(args.seed + 999 + rank)   # the same batches every call
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for _ in range(args.eval_batches):
            total += model(data.batch(args.batch, args.seq, g).to(device), ctxs, prepared)
    dist.all_reduce(total)
    return float(total) / (args.eval_batches * dist.get_world_size())


def train(args, rank, world, device, data, precision: str, perturb: float, say, draw=0):
    """One model trained from the seed's weights (times 1 + perturb N(0, 1), the draw's) on
    the seed's batches; returns (model, per-step mean losses over the ranks)."""
    model = TinyMoELM(args, rank, world).to(device)
    if perturb:
        gp = torch.Generator().manual_seed(args.seed + 77 + draw)   # every rank alike
        with torch.no_grad():
            for prm in model.parameters():
                noise = torch.randn(prm.shape, generator=gp).to(device)
                prm.mul_(1 + perturb * noise)
    experts = {id(p) for p in model.expert_params()}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    ctxs = make_contexts(args, device, world, precision=precision)
    args.backend = ctxs[0].backend.name
    g = torch.Generator().manual_seed(args.seed + rank)
    losses, t0 = [], time.perf_counter()
    name = precision + (f" (weights x (1 + {perturb:g} N))" if perturb else "")
    for step in range(1, args.steps + 1):
        loss = model(data.batch(args.batch, args.seq, g).to(device), ctxs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():   # replicated: mean over ranks; experts: their tokens
            if id(p) in experts:       # arrive from every rank, each rank's loss a mean
                p.grad.div_(world)
            else:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        opt.step()
        lv = loss.detach().clone()
        dist.all_reduce(lv)
        losses.append(float(lv) / world)
        if step % 50 == 0 or step == args.steps:
            say(f"[tiny-lm] {name:>10} step {step:4d}  train loss {losses[-1]:.4f}  "
                f"({time.perf_counter() - t0:.1f} s)", flush=True)
    for c in ctxs:
        c.close()
    return model, losses


def run(rank: int, world: int, args) -> dict:
    device = (torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda"
              else torch.device("cpu"))
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be a multiple of the {world} ranks")
    torch.manual_seed(args.seed + rank)
    data = MarkovData(args.vocab, args.seed)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"[tiny-lm] {world} rank(s), {args.layers} layers, D={args.hidden} F={args.ffn} "
        f"E={args.experts} K={args.topk}, {args.batch}x{args.seq} tokens per rank per step; "
        f"loss floor (the chain's entropy) {data.entropy:.3f}", flush=True)
    curves = {}
    model, curves["bf16"] = train(args, rank, world, device, data, "bf16", 0.0, say)
    for i in range(args.first_repeat,
                   args.first_repeat + (args.repeats if args.repeat_perturb else 0)):
        _, curves[f"bf16_repeat{i + 1}"] = train(args, rank, world, device, data, "bf16",
                                                 args.repeat_perturb, say, draw=i)
    for precision in args.train_precisions[1:]:
        _, curves[precision] = train(args, rank, world, device, data, precision, 0.0, say)
    bf16_curves = [v for k, v in curves.items() if k.startswith("bf16")]
    band = (noise_band(bf16_curves)
            if len(bf16_curves) > 1 else None)
    gaps = {q: moving_average_gap(curves[q], curves["bf16"]) for q in args.train_precisions[1:]}
    for q, gap in gaps.items():
        say(f"[tiny-lm] {q}: largest 10-step moving-average gap to bf16 {gap:.4f}"
            + (f" (largest gap between the bf16 curves: {band:.4f}; "
               f"{'within' if gap <= band else 'OUTSIDE'} the noise band)" if band is not None
               else ""), flush=True)
    bf16_ctxs = make_contexts(args, device, world, inference=True, num_activation_slots=0)
    loss_bf16 = evaluate(model, bf16_ctxs, data, args, device, rank)
    for c in bf16_ctxs:
        c.close()
    prepared = [dm.prepare_expert_weights(b.w13.detach().to(BF), b.w2.detach().to(BF),
                                          precision="nvfp4") for b in model.blocks]
    nv_ctxs = make_contexts(args, device, world, inference=True, num_activation_slots=0,
                            precision="nvfp4")
    loss_nvfp4 = evaluate(model, nv_ctxs, data, args, device, rank, prepared)
    for c in nv_ctxs:
        c.close()
    increase = loss_nvfp4 / loss_bf16 - 1.0
    say(f"[tiny-lm] held-out loss: bf16 experts {loss_bf16:.4f}, nvfp4 experts {loss_nvfp4:.4f} "
        f"({100 * increase:+.2f}%; bound +{100 * args.max_loss_increase:.1f}%), loss floor "
        f"{data.entropy:.3f}", flush=True)
    return dict(loss_bf16=loss_bf16, loss_nvfp4=loss_nvfp4, increase=increase,
                entropy=data.entropy, steps=args.steps, world=world, backend=args.backend,
                curves=curves, gaps=gaps, band=band)


def plot_curves(res: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[tiny-lm] matplotlib missing: no plot")
        return
    fig, (ax, gx) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                 gridspec_kw=dict(height_ratios=[3, 2]))
    ma = {name: moving_average(v) for name, v in res["curves"].items()}
    steps = range(1, len(ma["bf16"]) + 1)
    for name, v in ma.items():
        thin = name.startswith("bf16_repeat")
        line, = ax.plot(steps, v, label=name, lw=0.8 if thin else 1.4)
        if name != "bf16":
            gx.plot(steps, [a - b for a, b in zip(v, ma["bf16"])], label=name,
                    color=line.get_color(), lw=0.8 if thin else 1.4, ls="--" if thin else "-")
    ax.axhline(res["entropy"], color="gray", ls=":", label="loss floor (entropy)")
    ax.set_yscale("log")
    ax.set_ylabel("train loss (10-step moving average)")
    ax.set_title(f"held-out loss: bf16 {res['loss_bf16']:.4f}, nvfp4 experts "
                 f"{res['loss_nvfp4']:.4f} ({100 * res['increase']:+.2f}%)", fontsize=9)
    ax.legend(fontsize=8)
    gx.axhline(0, color="gray", lw=0.5)
    gx.set_xlabel("step")
    gx.set_ylabel("minus bf16's")
    gx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[tiny-lm] wrote {path}")


def _spawned(rank: int, world: int, args) -> dict:
    return run(rank, world, args)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        from megatron_dist_moe import testing as tt
        res = tt.spawn(_spawned, args.nproc, (args,), timeout_s=1800)[0]
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        res = run(dist.get_rank(), dist.get_world_size(), args)
        if dist.get_rank() != 0:
            dist.destroy_process_group()
            return 0
        dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in res.items() if k != "curves"}, f, indent=1)
    if args.csv:
        names = list(res["curves"])
        with open(args.csv, "w") as f:
            f.write(",".join(["step"] + [f"loss_{n}" for n in names]) + "\n")
            for i in range(args.steps):
                f.write(",".join([str(i + 1)] + [f"{res['curves'][n][i]:.6f}" for n in names])
                        + "\n")
        plot_curves(res, args.csv.rsplit(".", 1)[0] + ".png")
    ok = res["increase"] <= args.max_loss_increase
    print(f"[tiny-lm] {'PASS' if ok else 'FAIL'}: nvfp4 held-out loss "
          f"{100 * res['increase']:+.2f}% vs bf16 (bound +{100 * args.max_loss_increase:.1f}%)")
    if res["band"] is not None:
        outside = [q for q, gap in res["gaps"].items() if gap > res["band"]]
        print(f"[tiny-lm] {'FAIL' if outside else 'PASS'}: training precisions within the bf16 "
              f"noise band: {[q for q in res['gaps'] if q not in outside]}"
              + (f"; outside: {outside}" if outside else ""))
        ok = ok and not outside
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
