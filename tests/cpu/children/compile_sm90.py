"""Child of tests/cpu/test_kernels_compile_sm90.py: every kernel variant recorded from its
launcher and compiled for sm_90 (Triton's bundled ptxas). Prints one `RESULT <json>` each.

    python tests/cpu/children/compile_sm90.py [--ptx-dir DIR] [VARIANT ...]

--ptx-dir writes each variant's PTX to DIR/<variant>.ptx: a refactor of kernel code that
leaves the PTX unchanged (diff the two directories) needs no new GPU run."""
import json
import re
import time
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dataclasses import replace
from megatron_dist_moe.kernels import grouped_gemm as G
from megatron_dist_moe.kernels import checks as K_checks
from megatron_dist_moe.kernels import rows as K_rows
from megatron_dist_moe.kernels.grouped_gemm import mm as G_mm, wgrad as G_wgrad
from megatron_dist_moe.kernels import routing as KR
import megatron_dist_moe as dm
from megatron_dist_moe.kernels import bookkeeping as KB
from megatron_dist_moe.planner import PlannerState
from megatron_dist_moe.backends.cuda.bookkeeping import TritonBookkeeping
from megatron_dist_moe.backends.cuda.routing import RoutingTables

_TT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
       torch.float8_e4m3fn: "fp8e4nv",
       torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8", torch.bool: "i1"}


class Recorder:
    def __init__(self, jit):
        self.jit, self.calls = jit, []
    def __getitem__(self, grid):
        def record(*args, num_warps=4, num_stages=3, **kw):
            names = [p.name for p in self.jit.params]
            kw.update(dict(zip(names, args)))
            self.calls.append((kw, num_warps, num_stages))
        return record


def compile_call(jit, kw, num_warps, num_stages, **options):
    """Compile one recorded launch as Triton would on the GPU: the same constexprs, and the
    16-divisibility hints its launcher derives (16-byte aligned tensors, ints % 16 == 0)."""
    sig, const, attrs = {}, {}, {}
    div16 = [["tt.divisibility", 16]]
    for i, p in enumerate(jit.params):
        if p.name not in kw:           # a defaulted constexpr
            sig[p.name] = "constexpr"
            const[(i,)] = p.default
            continue
        v = kw[p.name]
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            const[(i,)] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TT[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = div16
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            if v == 1:               # Triton turns an int argument equal to 1 into a constexpr
                sig[p.name] = "constexpr"
                const[(i,)] = 1
                continue
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = div16
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{p.name}: {type(v)}")
    src = ASTSource(fn=jit, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **options))


def ptxas_stats(ptx):
    """(spill store bytes, registers, SASS instructions) of the kernel from Triton's bundled
    ptxas (sm_90a) and cuobjdump; -1 where they report none. The SASS count (without the NOP
    padding) of a loop-free kernel is what each thread issues: per value, the measure of an
    issue-bound kernel."""
    import os
    import subprocess
    import tempfile
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        open(path, "w").write(ptx)
        out = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", path, "-o",
                              cubin], capture_output=True, text=True)
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True).stdout if os.path.exists(cubin) else ""
    text = out.stdout + out.stderr
    spills = re.search(r"(\d+) bytes spill stores", text)
    regs = re.search(r"Used (\d+) registers", text)
    n_sass = sum(1 for line in sass.splitlines()
                 if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line) and not re.search(r"\bNOP\b", line))
    return (int(spills.group(1)) if spills else -1, int(regs.group(1)) if regs else -1,
            n_sass or -1)


def record(jit_name, module, fn):
    """Run fn with every Triton kernel of `module` recorded instead of launched."""
    jits = {k: v for k, v in vars(module).items() if isinstance(v, triton.runtime.JITFunction)}
    recs = {k: Recorder(v) for k, v in jits.items()}
    for k, rec in recs.items():
        setattr(module, k, rec)
    try:
        fn()
    finally:
        for k, v in jits.items():
            setattr(module, k, v)
    assert recs[jit_name].calls, f"{jit_name}: the launcher made no kernel call"
    return jits[jit_name], recs[jit_name].calls


bf = torch.bfloat16
E, R, D, F = 6, 1024, 7168, 3072
BIG = G.CONFIG_TABLE[("fwd", "large")]
offs = torch.zeros(E + 1, dtype=torch.int32)
rows_tab = torch.zeros(R, dtype=torch.int64)
p = torch.zeros(1, dtype=torch.int64)
w13, w2 = torch.empty(E, 2 * F, D, dtype=bf), torch.empty(E, D, F, dtype=bf)
flags = G.ClaimFlags(R, None, E, "cpu")
SLICED = replace(BIG, claim_slice_k=512)

VARIANTS = {
    "fwd_swiglu_tma": lambda: G.grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=R, a=p,
        epilogue="swiglu", h1=p, h2=p, config=BIG),
    "fwd_swiglu_decode": lambda: G.grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=48, a=p,
        epilogue="swiglu", h1=p, h2=p, config=G.CONFIG_TABLE[("fwd", "decode")]),
    "fwd_w2_scatter_decode": lambda: G.grouped_mm_fwd(w=w2, expert_offsets=offs, max_rows=48,
        a=p, epilogue="scatter", out_row_ptrs=rows_tab, config=G.CONFIG_TABLE[("fwd", "decode")]),
    "fwd_swiglu_claim_sliced": lambda: G.grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=R,
        a_row_ptrs=rows_tab, a_copy_out=p, claim_flags=flags, epilogue="swiglu", h1=p, h2=p,
        config=SLICED),
    "fwd_w2_scatter_clamped": lambda: G.grouped_mm_fwd(w=w2, expert_offsets=offs, max_rows=R,
        a=p, epilogue="scatter", out_row_ptrs=rows_tab, config=BIG),
    "dgrad_w2_claim_sliced": lambda: G.grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=R,
        a_row_ptrs=rows_tab, a_copy_out=p, claim_flags=flags, out=p, config=SLICED),
    "dgrad_w2_swiglu_bwd_tma": lambda: G.grouped_mm_dgrad(w=w2, expert_offsets=offs,
        max_rows=R, a=p, epilogue="swiglu_bwd", h1=p, activation="swiglu_clamped", config=BIG),
    "dgrad_w2_swiglu_bwd_claim_sliced": lambda: G.grouped_mm_dgrad(w=w2, expert_offsets=offs,
        max_rows=R, a_row_ptrs=rows_tab, a_copy_out=p, claim_flags=flags, epilogue="swiglu_bwd",
        h1=p, h2=p, config=SLICED),
    "dgrad_w2_swiglu_bwd_score_grads": lambda: G.grouped_mm_dgrad(w=w2, expert_offsets=offs,
        max_rows=R, a=p, epilogue="swiglu_bwd", h1=p, h2=p, config=BIG, score_ptrs=rows_tab,
        score_grad_delta=49152, part_stride=49152),
    "dgrad_w13_tma": lambda: G.grouped_mm_dgrad(w=w13, expert_offsets=offs, max_rows=R, a=p,
        out=p, config=BIG),
    "wgrad_tma_fp32": lambda: G.grouped_mm_wgrad(p, p, offs, torch.empty(E, 2 * F, D),
        dtype=bf, config=G.CONFIG_TABLE[("wgrad", "large")], num_programs=132),
    "wgrad_plain_bf16": lambda: G.grouped_mm_wgrad(p, p, offs, torch.empty(E, D, F, dtype=bf),
        dtype=bf, config=replace(G.CONFIG_TABLE[("wgrad", "large")], tma=False),
        num_programs=132),
    "wgrad_tma_bf16": lambda: G.grouped_mm_wgrad(p, p, offs,
        torch.empty(E, 2 * F, D, dtype=bf), dtype=bf, config=G.CONFIG_TABLE[("wgrad", "large")],
        num_programs=132),
    # routed_experts(wgrad_into=...): fp32 accumulate into per-expert matrices (main_grad)
    "wgrad_table_fp32": lambda: G.grouped_mm_wgrad(p, p, offs,
        G.ExpertOutTable(torch.zeros(E, dtype=torch.int64), 2 * F, D, torch.float32),
        accumulate=True, dtype=bf, config=G.CONFIG_TABLE[("wgrad", "large")], num_programs=132),
}
ws = KR.RouteWorkspace(2, 2048, 6, 6, "cpu")
route = lambda: KR.route_tables(ws, p.repeat(2), 2048, 6, 0, 12, 8192, p.repeat(2), p.repeat(2),
                                14336, own_scores_TK=torch.empty(2048, 6), trap=True)
VARIANTS["routing_count"] = route
VARIANTS["routing_place"] = route
VARIANTS["routing_place_fanout"] = lambda: KR.route_tables(
    ws, p.repeat(2), 2048, 6, 0, 12, 8192, p.repeat(2), p.repeat(2), 14336,
    own_scores_TK=torch.empty(2048, 6), trap=True, fanout=True)
ws1 = KR.RouteWorkspace(2, 8, 6, 6, "cpu")
VARIANTS["routing_one"] = lambda: KR.route_tables(
    ws1, p.repeat(2), 8, 6, 0, 12, 8192, p.repeat(2), p.repeat(2), 14336,
    own_scores_TK=torch.empty(8, 6), trap=True, fanout=True)
# the routing header with a training forward's schedule word (the planner's selection)
_hdr, _sel = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
VARIANTS["rows_publish_tokens"] = lambda: K_rows.publish_tokens(
    torch.empty(2048, 7168, dtype=bf), torch.empty(2048, 6, dtype=torch.int64), _hdr,
    torch.empty(2048, 6, dtype=torch.int16), torch.empty(2048 * 7168, dtype=bf), sched=(_sel, 3))
_i64 = torch.zeros(4, dtype=torch.int64)
VARIANTS["rows_device_check"] = lambda: K_checks.device_check(_i64, _i64, _i64)
VARIANTS["rows_fanout"] = lambda: K_rows.fanout_rows(
    p.repeat(2), 14336, torch.full((2 * 2048 * 6,), -1, dtype=torch.int32), 2048, 6, p,
    offs[-1:], 7168, bf)
VARIANTS["rows_swiglu_bwd"] = lambda: K_rows.swiglu_bwd(p, p, p, offs[-1:], 3072, R, True,
                                                        1.702, 7.0, h2_addr=p)
_f32 = torch.empty(2048, 6)
VARIANTS["rows_publish_grad_y"] = lambda: K_rows.publish_grad_y(
    torch.empty(2048, 7168, dtype=bf), _f32, torch.empty(2048, 7168, dtype=bf), _f32)
VARIANTS["rows_route_score_ptrs"] = lambda: K_rows.route_score_ptrs(
    rows_tab, offs[-1:], p.repeat(2), 1 << 28, p.repeat(2), 24704, 14336, 6, rows_tab, rows_tab)
VARIANTS["rows_score_grad_rows"] = lambda: K_rows.score_grad_rows(p, p, rows_tab, offs[-1:],
                                                                  3072, 49152, R)
VARIANTS["rows_sum_score_parts"] = lambda: K_rows.sum_score_parts(
    torch.empty(96, 2048 * 6), 12, torch.empty(2048, 6, dtype=torch.int16), torch.empty(2048, 6))
_cfg = dm.Config(num_local_input_tokens=2048, hidden_dim=7168, intermediate_dim=3072, top_k=6,
                 num_experts=12, backend="reference")
_plan = dm.plan_memory(_cfg, ep_size=2)
_bk = TritonBookkeeping(_plan, PlannerState.create(_plan, "cpu"), 0, p, p, p, num_local_experts=6)
_bk._trap = True          # as on the GPU: the layout guard traps
_tabs = RoutingTables(expert_offsets=offs, num_rows=torch.zeros(1, dtype=torch.int32),
                      rows_EP=torch.zeros(2, dtype=torch.int64), fwd_gather_ptrs=rows_tab,
                      combine_ptrs=rows_tab, dispatch_route_ptrs=rows_tab, max_rows=R)
_rec = torch.zeros(KB.REC_FIXED + 2, dtype=torch.int64)
VARIANTS["bookkeeping_fwd"] = lambda: _bk.forward(_tabs, 2048, True)
VARIANTS["bookkeeping_fwd_inference"] = lambda: _bk.forward(_tabs, 2048, False)
VARIANTS["bookkeeping_bwd"] = lambda: _bk.backward(None, _rec, _tabs, 2048)
# fp8_block: the launchers pick the interpreter's settings on CPU tensors; the GPU's are set below
from megatron_dist_moe.kernels import quant_fp8 as KQ  # noqa: E402
from megatron_dist_moe.kernels.grouped_gemm import fp8 as G8  # noqa: E402
from megatron_dist_moe.quant import fp8_block as Q8  # noqa: E402
f8 = torch.float8_e4m3fn
W8 = Q8.Fp8Weights(torch.empty(E, 2 * F, D, dtype=f8), torch.empty(E, 2 * F // 128, D // 128),
                   torch.empty(E, D, 2 * F, dtype=f8), torch.empty(E, D // 128, 2 * F // 128),
                   torch.empty(E, D, F, dtype=f8), torch.empty(E, D // 128, F // 128),
                   torch.empty(E, F, D, dtype=f8), torch.empty(E, F // 128, D // 128))
G8_BIG = G8.FP8_CONFIG
VARIANTS["fp8_mm_store"] = lambda: G8.fp8_grouped_mm(a=(p, p), w=W8.w13, w_scales=W8.w13_s,
    expert_offsets=offs, max_rows=R, epilogue="store", out=p, config=G8_BIG)
VARIANTS["fp8_mm_scatter"] = lambda: G8.fp8_grouped_mm(a=(p, p), w=W8.w13_t, w_scales=W8.w13_t_s,
    expert_offsets=offs, max_rows=R, epilogue="scatter", out_row_ptrs=rows_tab, config=G8_BIG)
VARIANTS["fp8_mm_swiglu_bwd_scored"] = lambda: G8.fp8_grouped_mm(a=(p, p), w=W8.w2_t,
    w_scales=W8.w2_t_s, expert_offsets=offs, max_rows=R, epilogue="swiglu_bwd", out=p,
    h1q=(p, p), h2=p, score_ptrs=rows_tab, score_grad_delta=49152, part_stride=49152,
    config=G8_BIG)
VARIANTS["fp8_mm_swiglu_bwd_clamped"] = lambda: G8.fp8_grouped_mm(a=(p, p), w=W8.w2_t,
    w_scales=W8.w2_t_s, expert_offsets=offs, max_rows=R, epilogue="swiglu_bwd", out=p,
    h1q=(p, p), h2=p, activation="swiglu_clamped", config=G8_BIG)
VARIANTS["fp8_wgrad_bf16"] = lambda: G8.fp8_grouped_wgrad((p, p), (p, p), offs,
    torch.empty(E, 2 * F, D, dtype=bf), config=G8_BIG, num_programs=132)
VARIANTS["fp8_wgrad_table"] = lambda: G8.fp8_grouped_wgrad((p, p), (p, p), offs,
    G.ExpertOutTable(torch.zeros(E, dtype=torch.int64), D, F, torch.float32), accumulate=True,
    config=G8_BIG, num_programs=132)
VARIANTS["fp8_quant_rows_cols"] = lambda: KQ.quantize_rows_cols(p, offs, R, D, rows=(p, p),
                                                                  cols=(p, p))
# the unrolled column-chunk walk (the launcher's 32 x 2 tile above loops over four chunks)
VARIANTS["fp8_quant_rows_cols_unrolled"] = lambda: KQ.quantize_rows_cols(
    p, offs, R, D, rows=(p, p), cols=(p, p), tile=(64, 4))
VARIANTS["fp8_swiglu_quant"] = lambda: KQ.swiglu_quant(p, offs[-1:], R, F, h2q=(p, p),
                                                       h1q=(p, p))
VARIANTS["fp8_quant_weight"] = lambda: KQ.quantize_weight(torch.empty(E, 2 * F, D, dtype=bf))
VARIANTS["rows_scatter"] = lambda: K_rows.scatter_rows(p, rows_tab, offs[-1:], D, bf, R)
VARIANTS["fp8_swiglu_bwd_rows"] = lambda: KQ.swiglu_bwd_rows(p, (p, p), p, offs[-1:], R, F,
    score_ptrs=rows_tab, score_grad_delta=4, part_stride=4)
# mxfp8: quantization kernels around the bf16 GEMMs
from megatron_dist_moe.kernels import quant_mxfp8 as KM  # noqa: E402
VARIANTS["mxfp8_quantize_all"] = lambda: KM.quantize(p, offs, R, D, rows_fake=p, cols=(p, p),
                                                     cols_fake=p)
# the combinations the pipeline launches: x_g (rows in place + column bundle), g3 and grad_h1
# (rows in place + fake columns), h2 (fake columns)
VARIANTS["mxfp8_quantize_x"] = lambda: KM.quantize(p, offs, R, D, rows_fake=p, cols=(p, p))
VARIANTS["mxfp8_quantize_grad"] = lambda: KM.quantize(p, offs, R, D, rows_fake=p, cols_fake=p)
VARIANTS["mxfp8_quantize_cols_fake"] = lambda: KM.quantize(p, offs, R, F, cols_fake=p)
VARIANTS["mxfp8_swiglu_quant"] = lambda: KM.swiglu_quant(p, offs[-1:], R, F, h2_fake=p,
                                                         h1q=(p, p))
VARIANTS["mxfp8_dequantize_rows"] = lambda: KM.dequantize_rows(p, p, offs[-1:], R, 2 * F, out=p)
VARIANTS["mxfp8_dequantize_cols"] = lambda: KM.dequantize_cols(p, p, offs, R, D, out=p)
VARIANTS["mxfp8_fake_weight"] = lambda: KM.fake_weight(torch.empty(E, 2 * F, D, dtype=bf))
VARIANTS["claim_status_check"] = lambda: K_checks.check_status(torch.zeros(4, dtype=torch.int64))
# nvfp4: the source rank's row quantization and the SwiGLU + h2 quantization
from megatron_dist_moe.kernels import quant_nvfp4 as KN  # noqa: E402
VARIANTS["nvfp4_quantize_rows"] = lambda: KN.quantize_rows(p, offs[-1:], R, D, out=p)
VARIANTS["nvfp4_swiglu_quant"] = lambda: KN.swiglu_quant(p, offs[-1:], R, F, out=p,
                                                         activation="swiglu_clamped")
from megatron_dist_moe.kernels.grouped_gemm import nvfp4 as GN  # noqa: E402
from megatron_dist_moe.prepared import PreparedWeight  # noqa: E402
_W4 = PreparedWeight(torch.empty(E, 2 * F, D // 2, dtype=torch.uint8),
                     torch.empty(E, 2 * F // 16, D // 16, dtype=torch.float8_e4m3fn),
                     torch.ones(E), (E, 2 * F, D))
# with the GPU's tiles and decode (the launcher picks the interpreter's on CPU tensors)
VARIANTS["nvfp4_mm_store"] = lambda: GN.nvfp4_grouped_mm(a=p, weight=_W4, expert_offsets=offs,
    max_rows=R, epilogue="store", out=p, tiles=GN.LARGE_TILES, decode="f16_asm")
VARIANTS["nvfp4_mm_store_medium"] = lambda: GN.nvfp4_grouped_mm(a=p, weight=_W4,
    expert_offsets=offs, max_rows=R, epilogue="store", out=p, tiles=GN.MEDIUM_TILES,
    decode="f16_asm")
VARIANTS["nvfp4_mm_scatter_decode"] = lambda: GN.nvfp4_grouped_mm(
    a=p, weight=_W4, expert_offsets=offs, max_rows=48, epilogue="scatter", out_row_ptrs=rows_tab,
    a16=p, tiles=GN.DECODE_TILES, decode="f16_asm")
VARIANTS["nvfp4_dequantize_rows"] = lambda: KN.dequantize_rows(p, offs[-1:], R, D, out=p)
# the dense form's fp16 GEMMs with the NVFP4 global scales in their epilogues (nvfp4_dense.py)
_W16_13, _W16_2 = (torch.empty(E, 2 * F, D, dtype=torch.float16),
                   torch.empty(E, D, F, dtype=torch.float16))
VARIANTS["nvfp4_dense_swiglu"] = lambda: G.grouped_mm_fwd(w=_W16_13, expert_offsets=offs,
    max_rows=R, a=p, epilogue="swiglu", h2=p, activation="swiglu_clamped",
    nvfp4_scales=(p, 4096, torch.ones(E)), config=BIG)
VARIANTS["nvfp4_dense_scatter"] = lambda: G.grouped_mm_fwd(w=_W16_2, expert_offsets=offs,
    max_rows=R, a=p, epilogue="scatter", out_row_ptrs=rows_tab,
    nvfp4_scales=(p, 2048, torch.ones(E)), config=BIG)
# the passes that also decode into a16 (the wgmma GEMM's fragment order), as the pipeline
# runs them: only each byte row's S_dec stored
VARIANTS["nvfp4_swiglu_quant_a16"] = lambda: KN.swiglu_quant(p, offs[-1:], R, F, out=p, a16=p,
                                                             a16_order="fragment", s_dec_only=True)
VARIANTS["nvfp4_quantize_rows_a16"] = lambda: KN.quantize_rows(p, offs[-1:], R, F, out=p, a16=p,
                                                               a16_order="fragment",
                                                               s_dec_only=True)
VARIANTS["nvfp4_fanout_dequantize"] = lambda: KN.fanout_dequantize(
    torch.zeros(2, dtype=torch.int64), 2 * D, torch.zeros(2 * 8 * 6, dtype=torch.int32), 8, 6,
    p, offs[-1:], D, a16=p, order="fragment", s_dec_only=True)
# the Mega forward, with the GPU's tile config
from megatron_dist_moe.kernels.grouped_gemm import mega as GM  # noqa: E402
_MEGA_CFG = G.CONFIG_TABLE[("fwd", "large")]
VARIANTS["mega_fwd"] = lambda: GM.mega_fwd(xg=p, w13=w13, w2=w2, expert_offsets=offs,
    max_rows=R, h2=p, h1=p, out_row_ptrs=rows_tab, flags=GM.MegaFlags(R, E, "cpu"),
    activation="swiglu_clamped", config=_MEGA_CFG, num_programs=132)
JIT = {"rows_device_check": (K_checks, "_device_check_kernel"),
       "mega_fwd": (GM, "_mega_fwd_kernel"),
       "nvfp4_mm_store": (GN, "_nvfp4_mm_kernel"),
       "nvfp4_mm_store_medium": (GN, "_nvfp4_mm_kernel"),
       "nvfp4_mm_scatter_decode": (GN, "_nvfp4_mm_kernel"),
       "nvfp4_quantize_rows": (KN, "_quant_rows_kernel"),
       "nvfp4_dequantize_rows": (KN, "_deq_rows_kernel"),
       "nvfp4_swiglu_quant": (KN, "_quant_rows_kernel"),
       "nvfp4_swiglu_quant_a16": (KN, "_quant_rows_kernel"),
       "nvfp4_quantize_rows_a16": (KN, "_quant_rows_kernel"),
       "nvfp4_fanout_dequantize": (KN, "_fanout_deq_kernel"),
       "claim_status_check": (K_checks, "_check_status_kernel"),
       "mxfp8_quantize_all": (KM, "_quant_kernel"),
       "mxfp8_quantize_x": (KM, "_quant_kernel"),
       "mxfp8_quantize_grad": (KM, "_quant_kernel"),
       "mxfp8_quantize_cols_fake": (KM, "_quant_kernel"),
       "mxfp8_swiglu_quant": (KM, "_swiglu_quant_kernel"),
       "mxfp8_dequantize_rows": (KM, "_deq_rows_kernel"),
       "mxfp8_dequantize_cols": (KM, "_deq_cols_kernel"),
       "mxfp8_fake_weight": (KM, "_fake_weight_kernel"),
       "fp8_mm": (G8, "_fp8_mm_kernel"), "fp8_wgrad": (G8, "_fp8_wgrad_kernel"),
       "fp8_quant_rows_cols": (KQ, "_quant_rows_cols_kernel"),
       "fp8_quant_rows_cols_unrolled": (KQ, "_quant_rows_cols_kernel"),
       "fp8_swiglu_quant": (KQ, "_swiglu_quant_kernel"),
       "fp8_quant_weight": (KQ, "_quant_weight_kernel"),
       "fp8_swiglu_bwd_rows": (KQ, "_swiglu_bwd_rows_kernel"),
       "rows_sum_score_parts": (K_rows, "_sum_score_parts_kernel"),
       "rows_fanout": (K_rows, "_fanout_rows_kernel"),
       "rows_scatter": (K_rows, "_scatter_rows_kernel"),
       "rows_swiglu_bwd": (K_rows, "_swiglu_bwd_kernel"),
       "rows_publish_grad_y": (K_rows, "_publish_grad_y_kernel"),
       "rows_route_score_ptrs": (K_rows, "_route_score_ptrs_kernel"),
       "rows_score_grad_rows": (K_rows, "_score_grad_rows_kernel"),
       "bookkeeping_fwd": (KB, "plan_forward_kernel"),
       "bookkeeping_fwd_inference": (KB, "plan_forward_kernel"),
       "bookkeeping_bwd": (KB, "plan_backward_kernel"),
       "wgrad": (G_wgrad, "_grouped_mm_wgrad_kernel"),
       "routing_count": (KR, "_route_count_kernel"),
       "routing_place": (KR, "_route_place_kernel"),
       "routing_place_fanout": (KR, "_route_place_kernel"),
       "routing_one": (KR, "_route_one_kernel"),
       "rows_publish_tokens": (K_rows, "_publish_tokens_kernel")}

# mxfp8 quantize's other tiles (quant_mxfp8.QUANT_TILES; the default's variants are above)
for _t in ((32, 64, 1), (32, 32, 1), (64, 32, 2), (32, 128, 4)):
    VARIANTS["mxfp8_quantize_x_%dx%dx%d" % _t] = (
        lambda t=_t: KM.quantize(p, offs, R, D, rows_fake=p, cols=(p, p), tile=t))
    JIT["mxfp8_quantize_x_%dx%dx%d" % _t] = (KM, "_quant_kernel")

import argparse  # noqa: E402
ap = argparse.ArgumentParser(description="compile kernel variants for sm_90")
ap.add_argument("--ptx-dir", default=None, help="write each variant's PTX here")
ap.add_argument("names", nargs="*", help="variants (default: all)")
cli = ap.parse_args()
ptx_dir = cli.ptx_dir
if ptx_dir is not None:
    import os
    os.makedirs(ptx_dir, exist_ok=True)
names = cli.names or list(VARIANTS)
for name in names:
    t0 = time.time()
    res = {"name": name}
    try:
        key = "_".join(name.split("_")[:2]) if name.startswith("fp8_") else name.split("_")[0]
        module, jit_name = JIT.get(name, JIT.get(key, (G_mm, "_grouped_mm_kernel")))
        jit, calls = record(jit_name, module, VARIANTS[name])
        kw, nw, ns = calls[-1]
        if jit_name == "_grouped_mm_kernel":   # as on the GPU: sleeping, trapping waits, fences
            kw = dict(kw, ON_GPU=True,
                      PROXY_FENCE=bool(kw.get("A_CLAIM")) and bool(kw.get("USE_TMA")))
        if module is GM:   # as on the GPU: tensor cores, sleeping bounded waits, TMA loads
            kw = dict(kw, IEEE=False, SLEEP=True, USE_TMA=True)
        if module in (G8, KQ, KM, KN, GN):   # as on the GPU: TMA, fp8 tensor cores, hardware conversions
            kw = dict(kw, HW=True)
            if "IEEE" in kw:
                kw.update(IEEE=False, USE_TMA=True)
        kernel = compile_call(jit, kw, nw, ns)
        ptx = kernel.asm["ptx"]
        if ptx_dir is not None:
            with open(f"{ptx_dir}/{name}.ptx", "w") as f:
                f.write(ptx)
        res["ok"] = True
        res["spill_bytes"], res["registers"], res["sass_instructions"] = ptxas_stats(ptx)
        res["shared_bytes"] = kernel.metadata.shared
        res["bar_sync"] = len(re.findall(r"\bbar\.sync\b", ptx))
        res["ptx"] = {k: len(re.findall(pat, ptx)) for k, pat in {
            "wgmma": r"wgmma\.mma_async", "wgmma_e4m3": r"wgmma\.mma_async[.\w]*\.e4m3",
            "tma_load": r"cp\.async\.bulk\.tensor",
            "ld_acquire": r"ld\.global[.\w]*\.acquire", "atom_release": r"atom\.global[.\w]*\.release",
            "atom_max": r"atom\.global[.\w]*\.max\.s64", "cas": r"atom\.global[.\w]*\.acq_rel[.\w]*\.cas",
            "proxy_fence": r"fence\.proxy\.async\.global", "trap": r"\btrap;",
            "printf": r"vprintf", "nanosleep": r"nanosleep\.u32",
            "st_v4": r"st\.global(\.\w+)*\.v4"}.items()}
    except Exception as ex:
        import traceback
        res.update(ok=False, error=f"{type(ex).__name__}: {str(ex)[:2000]}",
                   trace=traceback.format_exc()[-3000:])
    res["seconds"] = round(time.time() - t0, 1)
    print("RESULT " + json.dumps(res), flush=True)
