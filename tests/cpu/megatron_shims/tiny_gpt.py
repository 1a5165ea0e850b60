"""A tiny Megatron-Core GPT with MoE layers, runnable on CPU ranks, for the plugin tests.

Used inside spawned ranks only (after cpu_cuda.apply()). Builds the same model twice, once with
Megatron's alltoall dispatcher (SequentialMLP experts) and once with dist_moe, loads identical
weights and runs both through Megatron's own pipeline schedules.
"""

from __future__ import annotations

import torch

VOCAB = 128
SEQ = 16
MBS = 2


def transformer_config(dispatcher: str, dtype: torch.dtype, *, num_layers: int = 2,
                       pp: int = 1, ep: int = 2, moe_layer_freq=1, shared_expert: bool = True,
                       **overrides):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=num_layers, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        moe_ffn_hidden_size=64, num_moe_experts=4, moe_router_topk=2,
        moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
        use_cpu_initialization=True, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", params_dtype=dtype,
        moe_router_dtype="fp64" if dtype == torch.float64 else "fp32",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_layer_freq=moe_layer_freq,
        moe_shared_expert_intermediate_size=64 if shared_expert else None,
        deallocate_pipeline_outputs=False, transformer_impl="local",
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(config, layer_spec, *, seed: int = 0, pre_process: bool = True,
              post_process: bool = True):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope",
                     pre_process=pre_process, post_process=post_process)
    return model.to(config.params_dtype)


def batches(num_microbatches: int, seed: int):
    """Per-microbatch dicts of tokens/labels/positions/mask (same on every rank of a DP rank)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_microbatches):
        out.append(dict(tokens=torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
                        labels=torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
                        position_ids=torch.arange(SEQ).expand(MBS, SEQ),
                        attention_mask=torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()))
    return out


def _loss_func(output_tensor):
    loss = output_tensor.float().sum()
    num_tokens = torch.tensor(output_tensor.numel(), dtype=torch.int)
    # clone: the schedule divides the returned loss in place
    return loss, num_tokens, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    return out, _loss_func


def train_step(model, num_microbatches: int, seed: int, main_grad: bool = False):
    """One forward/backward over `num_microbatches` through Megatron's schedule for this run's
    pipeline size; returns (per-microbatch losses on the last stage, {name: grad}).

    main_grad: give every parameter an fp32 `main_grad` and `grad_added_to_main_grad`, as
    Megatron's DDP does (its CUDA-only buffers are not built here). A parameter whose gradient
    went into main_grad (flag set) reports main_grad; the others report .grad."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for p in model.parameters():
        p.grad = None
        if main_grad:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            p.grad_added_to_main_grad = False
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches(num_microbatches, seed)),
        model=[model], num_microbatches=num_microbatches, seq_length=SEQ,
        micro_batch_size=MBS, forward_only=False)
    grads = {}
    for n, p in model.named_parameters():
        if main_grad and p.grad_added_to_main_grad:
            grads[n] = p.main_grad.detach().to(p.dtype).clone()
        elif p.grad is not None:
            grads[n] = p.grad.detach().clone()
    return [float(d["lm loss"]) for d in losses], grads


def max_rel_diff(a: dict, b: dict) -> float:
    """max over tensors of max|a - b| / max|a| (keys must match)."""
    assert set(a) == set(b), f"parameter sets differ: {sorted(set(a) ^ set(b))}"
    worst = 0.0
    for k in a:
        scale = a[k].abs().max().clamp_min(1e-30)
        worst = max(worst, float((a[k] - b[k]).abs().max() / scale))
    return worst

