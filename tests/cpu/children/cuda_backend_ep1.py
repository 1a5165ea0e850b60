"""Child of tests/cpu/test_cuda_backend_cpu_interp.py: CudaBackend on one rank in the Triton
interpreter, every variant against the fp64 oracle. Prints one `RESULT <json>` line per variant.

Three layers share one slot sized so that the first keeps its state and the later ones replay;
all run forward, then backward in reverse order, for each variant (each with its own inputs, so
memory freed by a previous variant cannot hold the right values).
"""

import json
import traceback

import torch

import cuda_cpu_harness as H
import megatron_dist_moe as dm
from megatron_dist_moe import testing as tt

H.install()
LAYERS = 3
SHAPE = dict(num_local_input_tokens=24, hidden_dim=128, intermediate_dim=128, top_k=2,
             num_experts=4, backend="reference", max_moe_layers_per_activation_slot=LAYERS)


def run(variant, seed):
    kw = variant.get("cfg", {})
    p_kw = dm.plan_memory(dm.Config(**SHAPE, **kw), ep_size=1)
    slot = 2 * p_kw.input_bytes + p_kw.layer.full_state(48)   # keep / replay / replay again
    cfg = dm.Config(**SHAPE, **kw, activation_slot_bytes=slot, pipeline=variant["pipeline"],
                    activation=variant.get("activation", "swiglu"))
    # new inputs per variant: memory a previous backend freed cannot hold this one's values
    problems = [tt.make_problem(cfg, 1, seed=seed + i, dtype=torch.bfloat16,
                                routing="random" if i != 1 else "hot_expert")
                for i in range(LAYERS)]
    oracles = [tt.oracle_results(p, cfg) for p in problems]
    be = H.make_backend(cfg, H.ThreadGroup(0, H.new_shared(1)), variant["overrides"])
    out = H.run_layers(be, problems, 0, wgrad_into=variant.get("wgrad_into", False),
                       offset_views=variant.get("offset_views", False))
    y_inf, none = be.forward(*H.rank_inputs(problems[0], 0), training=False)
    guard = be.bk.status.tolist() if hasattr(be.bk, "status") else [0, 0, 0]
    # the staged pipeline's claimed waits, the Mega forward's ready waits
    claim = getattr(be.experts, "claim", None) or getattr(be.experts, "flags", None)
    claim_status = claim.status.tolist() if claim is not None else [0, 0, 0, 0]
    be.close()
    errs = [tt.rank_errors(o, orc, p, 0) for o, orc, p in zip(out["results"], oracles, problems)]
    extra = {}
    if cfg.precision in ("fp8_block", "mxfp8"):
        # the same quantization emulated in plain torch: what the errors are judged by
        ems = [tt.block_quant_emulation(p, cfg) for p in problems]
        extra = dict(vs_emulation=[tt.rank_errors(o, em, p, 0)
                                   for o, em, p in zip(out["results"], ems, problems)],
                     emulation_errors=[{k: tt.relative_error(em[k], orc[k]) for k in em}
                                       for em, orc in zip(ems, oracles)],
                     inference_emulation_error=tt.relative_error(ems[0]["y"], oracles[0]["y"]))
    return dict(errors=errs, inference_error=tt.relative_error(y_inf, oracles[0]["y"]), **extra,
                saved_none=none is None, needs=out["needs"], cursors_back=out["cursors_back"],
                layout_guard=guard, claim_status=claim_status)


def run_nvfp4(seed):
    """nvfp4 inference on prepared weights: the source rank's quantization into the dispatch
    buffer, the byte-row fan-out, both NVFP4 GEMMs and the SwiGLU + h2 quantization; "dense":
    the same with the weights decoded once per call (nvfp4_dense.py: its row threshold lowered
    so that this shape takes it, its scratch bound to one expert so the experts run in groups)."""
    from megatron_dist_moe import memory_plan as MP
    out = {}
    for act in ("swiglu", "swiglu_clamped", "dense"):
        dense = act == "dense"
        saved = MP.NVFP4_DENSE_MIN_ROWS_PER_EXPERT, MP.NVFP4_WEIGHT_SCRATCH_BYTES
        if dense:
            act = "swiglu"
            MP.NVFP4_DENSE_MIN_ROWS_PER_EXPERT, MP.NVFP4_WEIGHT_SCRATCH_BYTES = 1, 2 * 512 * 128
        cfg = dm.Config(num_local_input_tokens=24, hidden_dim=128, intermediate_dim=256, top_k=2,
                        num_experts=4, backend="reference", precision="nvfp4", inference=True,
                        num_activation_slots=0, activation=act, swiglu_limit=1.5)
        p = tt.make_problem(cfg, 1, seed=seed, dtype=torch.bfloat16, routing="hot_expert")
        be = H.make_backend(cfg, H.ThreadGroup(0, H.new_shared(1)), {})
        x, ids, s, w13, w2 = H.rank_inputs(p, 0)
        prepared = dm.prepare_expert_weights(w13, w2)
        y, none = be.forward(x, ids, s, prepared.w13, prepared.w2, training=False)
        y2, _ = be.forward(x, ids, s, prepared.w13, prepared.w2, training=False)
        guard = be.bk.status.tolist() if hasattr(be.bk, "status") else [0, 0, 0]
        used_dense = be.experts.dense
        MP.NVFP4_DENSE_MIN_ROWS_PER_EXPERT, MP.NVFP4_WEIGHT_SCRATCH_BYTES = saved
        be.close()
        em, orc = tt.nvfp4_emulation(p, cfg), tt.nvfp4_oracle_y(p, cfg)
        out["dense" if dense else act] = dict(
                        used_dense=used_dense, err=tt.relative_error(y, orc),
                        emul=tt.relative_error(em, orc), vs_emulation=tt.relative_error(y, em), saved_none=none is None,
                        repeat_equal=bool(torch.equal(y, y2)), layout_guard=guard)
    return out


TORCH = {"gemm_engine": "torch"}
TRITON = {"gemm_engine": "triton"}
# The defaults are Triton routing tables and bookkeeping; their torch twins stay covered here.
TORCH_TABLES = {"routing": "torch", "bookkeeping": "torch"}
def run_weight_cache(seed):
    """CudaBackend.forward(weight_cache=...) for fp8_block and mxfp8 training (one layer,
    forward + backward): True gives the bits of a call that quantizes its own weights, False
    reuses them, also after the weights changed in place, until the next True."""
    out = {}
    for precision in ("fp8_block", "mxfp8"):
        cfg = dm.Config(**{**SHAPE, "max_moe_layers_per_activation_slot": 1},
                        precision=precision, pipeline="standard")
        p = tt.make_problem(cfg, 1, seed=seed, dtype=torch.bfloat16)
        be = H.make_backend(cfg, H.ThreadGroup(0, H.new_shared(1)), {})
        x, ids, s, w13, w2 = H.rank_inputs(p, 0)
        gy = p.grad_y[p.tokens(0)].contiguous()

        def step(mode):
            be.ctx.planner.select(0, 1)
            y, saved = be.forward(x, ids, s, w13, w2, training=True, weight_cache=mode)
            return [y] + list(be.backward(gy, saved))

        def same(a, b):
            return all(torch.equal(u, v) for u, v in zip(a, b))
        own0, first, again = step(None), step(True), step(False)
        w13.add_(0.05 * torch.randn_like(w13))
        w2.mul_(1.1)
        stale, own1, fresh = step(False), step(None), step(True)
        be.close()
        out[precision] = dict(first_eq_own=same(first, own0), reuse_eq_first=same(again, first),
                              stale_eq_old=same(stale, own0), new_differs=not same(own1, own0),
                              refresh_eq_new=same(fresh, own1))
    return out


VARIANTS = {
    "torch_gemm": dict(overrides=dict(TORCH), pipeline="standard"),
    "torch_gemm,torch_routing,torch_bookkeeping,saved_routes": dict(
        overrides={**TORCH, **TORCH_TABLES}, pipeline="standard",
        cfg=dict(save_route_outputs=True)),
    "triton_gemm,standard": dict(overrides=dict(TRITON), pipeline="standard"),
    "triton_gemm,standard,clamped,saved_routes": dict(
        overrides=dict(TRITON), pipeline="standard", activation="swiglu_clamped",
        cfg=dict(save_route_outputs=True)),
    "triton_gemm,staged,torch_tables,saved_routes": dict(
        overrides={**TRITON, **TORCH_TABLES}, pipeline="staged",
        cfg=dict(save_route_outputs=True)),
    # Config.save_route_outputs=False (the default; "saved_routes" above is True): score
    # gradients on the expert side (the fused epilogue's parts, and the torch GEMM engine's row
    # kernel)
    "expert_score_grads,triton_gemm,staged": dict(
        overrides=dict(TRITON), pipeline="staged", cfg=dict(save_route_outputs=False)),
    "expert_score_grads,triton_gemm,standard,clamped": dict(
        overrides=dict(TRITON), pipeline="standard", activation="swiglu_clamped",
        cfg=dict(save_route_outputs=False)),
    "expert_score_grads,torch_gemm": dict(overrides=dict(TORCH), pipeline="standard",
                                          cfg=dict(save_route_outputs=False)),
    # weight gradients added into fp32 per-expert accumulators (routed_experts(wgrad_into=...))
    "wgrad_into,triton_gemm,standard": dict(overrides=dict(TRITON), pipeline="standard",
                                            wgrad_into=True),
    "wgrad_into,torch_gemm": dict(overrides=dict(TORCH), pipeline="standard", wgrad_into=True),
    # fp8_block: FP8 block-scaled kernels (quantization, GEMMs, fused SwiGLU backward)
    "fp8_block,standard": dict(overrides={}, pipeline="standard",
                               cfg=dict(precision="fp8_block")),
    "fp8_block,clamped,saved_routes,torch_tables": dict(
        overrides=dict(TORCH_TABLES), pipeline="standard", activation="swiglu_clamped",
        cfg=dict(precision="fp8_block", save_route_outputs=True)),
    # (the fan-out copy then the quantizer, as at EP > 1, with the pulling combine and the
    # torch routing tables' route -> row map; the others read rows in the quantizer)
    "fp8_block,wgrad_into,fp32_scales,fanout,torch_tables": dict(
        overrides=dict(TORCH_TABLES, fp8_gather="fanout"), pipeline="standard", wgrad_into=True,
        cfg=dict(precision="fp8_block", fp8_power_2_scales=False)),
    # mxfp8: quantization kernels around the bf16 GEMMs (exact on the MXFP8 values)
    "mxfp8,standard": dict(overrides={}, pipeline="standard", cfg=dict(precision="mxfp8")),
    "mxfp8,clamped,saved_routes,torch_tables": dict(
        overrides=dict(TORCH_TABLES), pipeline="standard", activation="swiglu_clamped",
        cfg=dict(precision="mxfp8", save_route_outputs=True)),
    "mxfp8,wgrad_into,fanout": dict(overrides=dict(fp8_gather="fanout"), pipeline="standard",
                                    wgrad_into=True, cfg=dict(precision="mxfp8")),
    # the Mega forward (one persistent launch for W13 + SwiGLU and W2 + scatter; standard
    # backward)
    "mega,expert_score_grads": dict(overrides=dict(TRITON), pipeline="mega",
                                    cfg=dict(save_route_outputs=False)),
    "mega,wgrad_into": dict(overrides=dict(TRITON), pipeline="mega", wgrad_into=True),
    "mega,clamped,saved_routes": dict(overrides=dict(TRITON), pipeline="mega",
                                      activation="swiglu_clamped",
                                      cfg=dict(save_route_outputs=True)),
    # weights as views at a storage offset (the Megatron plugin's packed weights)
    "offset_weight_views,triton_gemm,staged": dict(overrides=dict(TRITON), pipeline="staged",
                                                   offset_views=True),
}

if __name__ == "__main__":
    try:
        print("RESULT " + json.dumps(dict(name="nvfp4_inference", ok=True, **run_nvfp4(7))),
              flush=True)
    except Exception as ex:
        print("RESULT " + json.dumps(dict(name="nvfp4_inference", ok=False,
                                          error=f"{type(ex).__name__}: {ex}",
                                          trace=traceback.format_exc()[-3000:])), flush=True)
    try:
        print("RESULT " + json.dumps(dict(name="weight_cache", ok=True,
                                          **run_weight_cache(11))), flush=True)
    except Exception as ex:
        print("RESULT " + json.dumps(dict(name="weight_cache", ok=False,
                                          error=f"{type(ex).__name__}: {ex}",
                                          trace=traceback.format_exc()[-3000:])), flush=True)
    for v, (name, variant) in enumerate(VARIANTS.items()):
        try:
            out = dict(name=name, ok=True, **run(variant, 50 + 10 * v))
        except Exception as ex:
            out = dict(name=name, ok=False, error=f"{type(ex).__name__}: {ex}",
                       trace=traceback.format_exc()[-3000:])
        print("RESULT " + json.dumps(out), flush=True)
