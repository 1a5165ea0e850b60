"""Tiny GPT pre-training on Megatron-Core with dist_moe MoE layers (synthetic "mock" data).

GPU (1 or 2 GPUs; EP = number of GPUs), bf16 with Megatron's Float16Module, DDP and optimizer:

    torchrun --nproc-per-node 2 examples/tiny_gpt_dist_moe.py --preset small --steps 300

Loss-curve and throughput comparison against Megatron's alltoall dispatcher. Both models start
from the same weights (dist_moe loads the alltoall checkpoint unchanged) and see the same batches;
the CSV gets one row per step with both losses and both throughputs:

    torchrun --nproc-per-node 2 examples/tiny_gpt_dist_moe.py --preset small --steps 300 \\
        --compare --csv out/dist_moe_vs_alltoall.csv

Two bf16 GPU runs of the same seed separate (non-deterministic reductions amplified by early loss
spikes), so agreement is judged against that noise: run twice and give both CSVs to
benchmarks/megatron_loss_noise.py. `--fp32 --dist-moe-backend reference` takes rounding out and
should track alltoall closely step by step.

FP8 experts (Megatron's --fp8-format e4m3 --fp8-recipe blockwise, or mxfp8): the dist_moe
model's experts run fp8_block (mxfp8), judged against the bf16 alltoall noise band, with a bf16
dist_moe model beside it for tokens/s (GPU only):

    torchrun --nproc-per-node 1 examples/tiny_gpt_dist_moe.py --preset small --steps 300 \\
        --compare --repeat-alltoall --repeat-perturb 1e-3 --fp8-recipe blockwise --te off \\
        --csv out/fp8_block.csv
    python benchmarks/megatron_loss_noise.py out/fp8_block.csv --out out

CPU smoke run (2 gloo ranks spawned here, reference backend, fp32; Megatron-Core's CUDA-only
calls are replaced by the test shims in tests/cpu/megatron_shims):

    python examples/tiny_gpt_dist_moe.py --device cpu --nproc 2 --steps 5

Data: each sequence is a random string of "phrases" drawn from a fixed codebook of 16-token
phrases (plus 5% random tokens), so the loss falls from ln(vocab) towards the phrase entropy and
the two dispatchers' curves can be compared meaningfully.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import sys
import tempfile
import time
import warnings
import zlib

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# megatron-core 0.19 warns about its own default (TransformerConfig.cuda_graph_modules="full")
# on every config it builds; nothing here sets it
warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)

PRESETS = {   # model shape and batch; any field can be overridden by its flag
    "tiny":  dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_experts=4,
                  moe_ffn_hidden_size=128, topk=2, seq_length=64, micro_batch_size=2,
                  vocab_size=512, num_microbatches=2),
    "small": dict(num_layers=8, hidden_size=1024, num_attention_heads=16, num_experts=16,
                  moe_ffn_hidden_size=1024, topk=4, seq_length=2048, micro_batch_size=2,
                  vocab_size=32768, num_microbatches=4),
}
PHRASE_LEN = 16


def plot_losses(rows, kinds, path):
    """Loss curves of the dispatchers side by side (PNG next to the CSV)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind in kinds:
        ax.plot([r["step"] for r in rows], [r[f"loss_{kind}"] for r in rows], label=kind)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    for name in PRESETS["tiny"]:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--dispatcher", choices=["dist_moe", "alltoall"], default="dist_moe")
    p.add_argument("--compare", action="store_true",
                   help="train alltoall and dist_moe side by side from the same weights")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=5, help="steps excluded from tokens/s")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--csv", default=None, help="write per-step losses / tokens per second here")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available()
                   else "cpu")
    p.add_argument("--nproc", type=int, default=2, help="CPU only: ranks to spawn")
    p.add_argument("--dist-moe-backend", choices=["auto", "reference", "cuda"], default="auto")
    p.add_argument("--repeat-alltoall", action="store_true",
                   help="with --compare: train a second alltoall model from the same weights "
                        "and batches (column loss_alltoall_repeat): the run-to-run noise band "
                        "that dist_moe's curve is judged against")
    p.add_argument("--repeat-dist-moe", action="store_true",
                   help="with --compare: also train a second dist_moe model (column "
                        "loss_dist_moe_repeat) from the alltoall weights, perturbed by "
                        "--repeat-perturb like the alltoall repeat: dist_moe's own spread, and "
                        "with --repeat-alltoall a second dispatcher pair from one start")
    p.add_argument("--repeat-perturb", type=float, default=0.0, metavar="EPS",
                   help="with --repeat-alltoall / --repeat-dist-moe: start the repeats from the "
                        "same weights times (1 + EPS * N(0, 1)), the same draw on every rank and "
                        "for every parameter name both models share (e.g. 1e-3, below one bf16 "
                        "ulp): the spread of a model that differs only by rounding-sized "
                        "changes, a noise band that does not rely on GPU non-determinism")
    p.add_argument("--fp32", action="store_true",
                   help="GPU: fp32 parameters and activations, no Float16Module (reference "
                        "backend only): separates Megatron's GPU plumbing from bf16 rounding "
                        "when comparing with alltoall")
    p.add_argument("--te", choices=["auto", "on", "off"], default="auto",
                   help="Transformer Engine modules (alltoall then uses TEGroupedMLP)")
    p.add_argument("--fp8-recipe", choices=["blockwise", "mxfp8"], default=None,
                   help="Megatron's --fp8-recipe on the dist_moe models' TransformerConfig (with "
                        "--fp8-format): their experts run dist_moe's fp8_block / mxfp8 through "
                        "the plugin's mapping; the alltoall models stay bf16, so --compare "
                        "--repeat-alltoall judges the fp8 curve against the bf16 noise band, "
                        "and a bf16 dist_moe model (columns *_dist_moe_bf16) gives the tokens/s "
                        "next to it. With Transformer Engine the dense layers run TE's fp8 too")
    p.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default="e4m3",
                   help="with --fp8-recipe (dist_moe's block-scaled recipes are E4M3)")
    args = p.parse_args(argv)
    if args.fp32 and args.device == "cuda" and args.dist_moe_backend != "reference":
        p.error("--fp32 needs --dist-moe-backend reference (the cuda backend runs bf16 experts)")
    if args.repeat_alltoall and not args.compare:
        p.error("--repeat-alltoall needs --compare")
    if args.repeat_dist_moe and not args.compare:
        p.error("--repeat-dist-moe needs --compare")
    if args.repeat_perturb and not (args.repeat_alltoall or args.repeat_dist_moe):
        p.error("--repeat-perturb needs --repeat-alltoall or --repeat-dist-moe")
    if not 0.0 <= args.repeat_perturb < 0.1:
        p.error(f"--repeat-perturb must be in [0, 0.1), got {args.repeat_perturb}")
    if args.fp32 and args.te == "on":
        p.error("--fp32 runs without Transformer Engine: use --te off")
    if args.fp8_recipe and (args.fp32 or args.device == "cpu"):
        p.error("--fp8-recipe quantizes bf16 experts: it runs on the GPU without --fp32 (the "
                "CPU run keeps fp32 weights)")
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# -- data ------------------------------------------------------------------------------------

def make_batch(args, step: int, microbatch: int, dp_rank: int, device) -> dict:
    """Phrase-codebook sequences; identical for both dispatchers, different per DP rank."""
    V, S, B = args.vocab_size, args.seq_length, args.micro_batch_size
    book = torch.Generator().manual_seed(args.seed)
    codebook = torch.randint(0, V, (256, PHRASE_LEN), generator=book)
    g = torch.Generator().manual_seed(hash((args.seed, step, microbatch, dp_rank)) % 2**62)
    n_phrases = (S + 1 + PHRASE_LEN - 1) // PHRASE_LEN
    ids = torch.randint(0, codebook.shape[0], (B, n_phrases), generator=g)
    seq = codebook[ids].reshape(B, -1)[:, :S + 1]
    noise = torch.rand(B, S + 1, generator=g) < 0.05
    seq = torch.where(noise, torch.randint(0, V, (B, S + 1), generator=g), seq)
    return dict(tokens=seq[:, :-1].to(device), labels=seq[:, 1:].to(device),
                position_ids=torch.arange(S, device=device).expand(B, S),
                attention_mask=torch.triu(torch.ones(1, 1, S, S, device=device),
                                          diagonal=1).bool())


# -- model ------------------------------------------------------------------------------------

def use_te(args) -> bool:
    if args.device == "cpu" or args.te == "off" or args.fp32:
        return False
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if args.te == "on" and not HAVE_TE:
        raise SystemExit("--te on: Transformer Engine is not installed")
    return HAVE_TE


def transformer_config(args, dispatcher: str, ep: int, fp8: bool = False):
    """fp8: the run's --fp8-format / --fp8-recipe (Megatron's fields; the dist_moe plugin maps
    them to its precision, Megatron's own modules use them only through Transformer Engine)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    cpu = args.device == "cpu"
    fp32 = cpu or args.fp32
    te = use_te(args)
    fp8_fields = (dict(fp8=args.fp8_format, fp8_recipe=args.fp8_recipe)
                  if fp8 and args.fp8_recipe else {})
    config = TransformerConfig(**(fp8_fields if te else {}),
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=2 * args.hidden_size,
        num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.topk, moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=ep, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32",
        moe_grouped_gemm=te and dispatcher == "alltoall",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, bf16=not fp32, params_dtype=torch.float32 if fp32 else torch.bfloat16,
        use_cpu_initialization=cpu, transformer_impl="transformer_engine" if te else "local",
    )
    if fp8_fields and not te:
        # Megatron-Core refuses fp8 on MoE models without Transformer Engine >= 1.7 when the
        # config is built (its own experts quantize through TE). dist_moe's experts quantize
        # themselves, and without TE Megatron's fp8 context is a no-op for every other module,
        # so the fields are set after the check: only the plugin reads them.
        for name, value in fp8_fields.items():
            setattr(config, name, value)
    return config


def build_model(args, dispatcher: str, ep: int, device, fp8: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = transformer_config(args, dispatcher, ep, fp8)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te(args),
                                      normalization="RMSNorm")
    torch.manual_seed(args.seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab_size,
                     max_sequence_length=args.seq_length, position_embedding_type="rope")
    return model.to(device), config


def perturb_weights(model, eps: float, seed: int) -> None:
    """w <- w * (1 + eps * N(0, 1)), elementwise, drawn on the CPU from (seed, parameter name)
    so that replicated parameters get the same draw on every rank."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            noise = torch.randn(p.shape, generator=g).to(p.device)
            p.copy_((p.float() * (1.0 + eps * noise)).to(p.dtype))


class Trainer:
    """One model + optimizer; `step()` runs Megatron's schedule over num_microbatches."""

    def __init__(self, args, dispatcher: str, ep: int, device, init_state=None, perturb=0.0,
                 fp8: bool = False):
        import megatron.core.parallel_state as ps

        self.args, self.dispatcher, self.device = args, dispatcher, device
        model, self.config = build_model(args, dispatcher, ep, device, fp8)
        if init_state is not None:
            model.load_state_dict(init_state)   # alltoall checkpoint -> dist_moe, unchanged
        if perturb:
            perturb_weights(model, perturb, args.seed)
        self.init_state = {k: v.clone() if isinstance(v, torch.Tensor) else v
                           for k, v in model.state_dict().items()}   # incl. TE _extra_state
        self.dp_group = ps.get_data_parallel_group()
        self.expert_dp_group = ps.get_expert_data_parallel_group()
        if args.device == "cuda":
            self._setup_megatron_optimizer(model)
        else:
            self.model = model
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1,
                                               betas=(0.9, 0.95))

    def precision(self) -> str:
        """The experts' precision: what the plugin maps this model's fp8 fields to (alltoall's
        experts follow Megatron's own modules: bf16 without Transformer Engine)."""
        from megatron_dist_moe.megatron.config_map import precision_from_transformer_config

        return precision_from_transformer_config(self.config)

    def _setup_megatron_optimizer(self, model):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        if not self.args.fp32:
            model = Float16Module(self.config, model)
        self.model = DistributedDataParallel(
            config=self.config, module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=self.args.lr, weight_decay=0.1, adam_beta1=0.9,
                            adam_beta2=0.95, bf16=not self.args.fp32,
                            params_dtype=torch.float32 if self.args.fp32 else torch.bfloat16,
                            clip_grad=1.0), [self.model])
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync
        self.config.grad_scale_func = self.optimizer.scale_loss

    def _sync_grads_cpu(self):
        for p in self.model.parameters():
            if p.grad is None:
                continue
            group = self.dp_group if getattr(p, "allreduce", True) else self.expert_dp_group
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
                p.grad /= dist.get_world_size(group)

    def step(self, step: int) -> tuple[float, float]:
        """(mean loss over microbatches and DP ranks, seconds) for one optimizer step."""
        import megatron.core.parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        args = self.args
        dp_rank = ps.get_data_parallel_rank()
        data = iter([make_batch(args, step, m, dp_rank, self.device)
                     for m in range(args.num_microbatches)])

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

            def loss_func(output_tensor):
                loss = output_tensor.float().mean()
                # clone: the schedule divides the returned loss in place by num_microbatches
                return loss, {"lm loss": loss.detach().clone()}

            return out, loss_func

        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if args.device == "cuda":
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=[self.model],
            num_microbatches=args.num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False)
        if args.device == "cuda":
            self.optimizer.step()
        else:
            self._sync_grads_cpu()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
        loss = torch.stack([d["lm loss"].float() for d in losses]).mean()
        dist.all_reduce(loss, group=self.dp_group)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return float(loss) / dist.get_world_size(self.dp_group), time.perf_counter() - t0


def run(rank: int, world: int, args) -> None:
    import megatron.core.parallel_state as ps

    import megatron_dist_moe.megatron as dmm

    if args.device == "cpu":
        sys.path.insert(0, os.path.join(REPO, "tests", "cpu"))
        from megatron_shims import cpu_cuda   # Megatron-Core's CUDA-only calls -> CPU no-ops

        cpu_cuda.apply()
        device = torch.device("cpu")
        args.dist_moe_backend = "reference"
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    ep = world if args.num_experts % world == 0 else 1
    ps.initialize_model_parallel(expert_model_parallel_size=ep)
    if args.device == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)
    from megatron_dist_moe.megatron.config_map import DistMoEOptions

    # Megatron-LM scripts take these from --dist-moe-* flags; here they are passed directly.
    dmm.install(options=DistMoEOptions(backend=args.dist_moe_backend))

    kinds = ["alltoall", "dist_moe"] if args.compare else [args.dispatcher]
    if args.repeat_alltoall:
        kinds.insert(1, "alltoall_repeat")
    if args.repeat_dist_moe:
        kinds.append("dist_moe_repeat")
    if args.fp8_recipe and args.compare:
        kinds.append("dist_moe_bf16")   # the fp8 run's tokens/s next to bf16's
    trainers = {}
    init_state = None
    for kind in kinds:
        dispatcher = kind.removesuffix("_repeat").removesuffix("_bf16")
        repeat = kind.endswith("_repeat")
        # --fp8-recipe: every dist_moe model but the bf16 one takes Megatron's fp8 fields
        fp8 = dispatcher == "dist_moe" and not kind.endswith("_bf16")
        trainers[kind] = Trainer(args, dispatcher, ep, device, init_state,
                                 perturb=args.repeat_perturb if repeat else 0.0, fp8=fp8)
        if init_state is None:   # every model starts from the first alltoall model's weights
            init_state = trainers[kind].init_state
    tokens_per_step = (args.seq_length * args.micro_batch_size * args.num_microbatches
                       * dist.get_world_size(ps.get_data_parallel_group()))
    if rank == 0:
        fp8_note = (f" fp8={args.fp8_format}/{args.fp8_recipe} (dist_moe precision "
                    f"{trainers['dist_moe' if args.compare else kinds[0]].precision()})"
                    if args.fp8_recipe else "")
        print(f"world={world} EP={ep} device={device} preset={args.preset} "
              f"te={use_te(args)} dispatchers={kinds} tokens/step={tokens_per_step}{fp8_note}",
              flush=True)

    rows, times = [], {k: [] for k in kinds}
    csv_file = writer = None
    if rank == 0 and args.csv:   # written row by row: a run cut short still leaves its data
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        csv_file = open(args.csv, "w", newline="")
    for step in range(args.steps):
        row = {"step": step}
        for kind, trainer in trainers.items():
            loss, seconds = trainer.step(step)
            row[f"loss_{kind}"] = loss
            row[f"tokens_per_s_{kind}"] = tokens_per_step / seconds
            if step >= args.warmup_steps:
                times[kind].append(seconds)
        rows.append(row)
        if csv_file is not None:
            if writer is None:
                writer = csv.DictWriter(csv_file, fieldnames=list(row))
                writer.writeheader()
            writer.writerow(row)
            csv_file.flush()
        if rank == 0 and (step % args.log_interval == 0 or step == args.steps - 1):
            print("step {:5d}  ".format(step) + "  ".join(
                f"{k}: loss {row[f'loss_{k}']:.4f} {row[f'tokens_per_s_{k}']:,.0f} tok/s"
                for k in kinds), flush=True)
    if rank == 0:
        for kind in kinds:
            if times[kind]:
                mean = sum(times[kind]) / len(times[kind])
                print(f"{kind}: mean {tokens_per_step / mean:,.0f} tokens/s over "
                      f"{len(times[kind])} steps (after {args.warmup_steps} warmup)", flush=True)
        if args.compare:
            diffs = [abs(r["loss_alltoall"] - r["loss_dist_moe"]) for r in rows]
            print(f"max |loss_alltoall - loss_dist_moe| = {max(diffs):.4g}; final losses "
                  f"{rows[-1]['loss_alltoall']:.4f} / {rows[-1]['loss_dist_moe']:.4f}")
            if args.repeat_alltoall:
                noise = [abs(r["loss_alltoall"] - r["loss_alltoall_repeat"]) for r in rows]
                how = (f"weights x (1 + {args.repeat_perturb:g} N(0,1))" if args.repeat_perturb
                       else "same weights")
                print(f"max |loss_alltoall - loss_alltoall_repeat| = {max(noise):.4g} "
                      f"({how} and batches: the noise band)")
            if args.repeat_dist_moe:
                noise = [abs(r["loss_dist_moe"] - r["loss_dist_moe_repeat"]) for r in rows]
                print(f"max |loss_dist_moe - loss_dist_moe_repeat| = {max(noise):.4g}")
        if csv_file is not None:
            csv_file.close()
            print(f"wrote {args.csv}")
            if args.compare:
                plot_losses(rows, kinds, os.path.splitext(args.csv)[0] + ".png")
        if not all(math.isfinite(r[f"loss_{k}"]) for r in rows for k in kinds):
            raise SystemExit("non-finite loss")
    dmm.uninstall()


def _cpu_entry(rank: int, world: int, store_path: str, args) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        run(rank, world, args)
        dist.barrier()   # no rank tears its gloo connections down while a peer still reads
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory(prefix="tiny_gpt_dist_moe_") as d:
            mp.spawn(_cpu_entry, args=(args.nproc, os.path.join(d, "store"), args),
                     nprocs=args.nproc, join=True)
        return
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    if "RANK" in os.environ:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:   # plain `python examples/tiny_gpt_dist_moe.py` on one GPU
        d = tempfile.mkdtemp(prefix="tiny_gpt_dist_moe_")
        dist.init_process_group("nccl", store=dist.FileStore(os.path.join(d, "store"), 1),
                                rank=0, world_size=1)
    try:
        run(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
