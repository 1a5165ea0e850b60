"""benchmarks/profile_breakdown.py folds a graph-replay kernel profile into the parts that
BENCHMARKS.md reports; checked on the stored 2×H200 profile (its hand-made table: GEMMs 4.78 ms,
WGRAD 2.46, gathers ~0.66, owner kernels 0.29, SwiGLU 0.17, barriers 0.17 per iteration)."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import profile_breakdown as pb  # noqa: E402

# a 2xH200 graph-replay profile of 2026-11-30 kept as a test fixture
PROFILE = os.path.join(HERE, "data", "profile_guide_fwdbwd_graph_h200x2.txt")


def test_stored_profile_matches_the_hand_made_table(tmp_path):
    with open(PROFILE) as f:
        rows = pb.parse_profile_table(f.read())
    assert len(rows) == 45
    assert rows[0] == ("_grouped_mm_kernel", pytest.approx(23911.0), 30)
    parts = {r["part"]: r for r in pb.breakdown(rows, replays=5, iter_ms=9.6)}
    assert parts["grouped GEMMs (FPROP, DGRAD)"]["ms"] == pytest.approx(4.782, abs=1e-3)
    assert parts["grouped WGRAD"]["ms"] == pytest.approx(2.464, abs=1e-3)
    assert parts["owner kernels (combine, grad routes, route reduction)"]["ms"] == \
        pytest.approx(0.290, abs=2e-3)
    assert parts["SwiGLU row kernels"]["ms"] == pytest.approx(0.173, abs=1e-3)
    assert parts["device barriers"]["ms"] == pytest.approx(0.170, abs=1e-3)
    assert parts["device barriers"]["launches"] == 6
    total = parts["all kernels"]["ms"]
    assert total == pytest.approx(sum(r["ms"] for p, r in parts.items()
                                      if p not in ("all kernels", pb.TIMED_MINUS_KERNELS)),
                                  abs=2e-3)
    assert parts[pb.TIMED_MINUS_KERNELS]["ms"] == pytest.approx(9.6 - total, abs=1e-3)
    out = tmp_path / "parts.csv"
    assert pb.main([PROFILE, "--iter-ms", "9.6", "--csv", str(out)]) == 0
    assert "grouped WGRAD" in out.read_text()


@pytest.mark.parametrize("name, part", [
    ("_route_count_kernel", "routing tables and bookkeeping (ours)"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::Group...",
     "grouped GEMMs (FPROP, DGRAD)"),
    ("void dm_sm90::fill_group_args<dm_sm90::FpropGemm<cute::tuple<...", "grouped GEMMs (FPROP, DGRAD)"),
    # as the profiler names the CUTLASS FP8 units (call 1 of 2026-12-05d)
    ("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniv...", "grouped GEMMs (FPROP, DGRAD)"),
    ("plan_forward_kernel", "routing tables and bookkeeping (ours)"),
    ("_scatter_rows_kernel", "row gathers and scatters"),
    ("_device_check_kernel", "row copies and checks (ours)"),
    ("_publish_tokens_kernel", "row copies and checks (ours)"),
    ("_publish_quant_kernel", "activation quantization (fp8_block, mxfp8, nvfp4)"),
    ("_fanout_deq_kernel", "row gathers and scatters"),
    # the csrc/ NVFP4 GEMMs as the profiler names them (call 2 of 2026-12-02f)
    ("void dm_nvfp4::nvfp4_decode_mm_kernel<2, 64, 4>(dm_nvfp4::Args)",
     "grouped GEMMs (FPROP, DGRAD)"),
    ("void dm_nvfp4::wgmma_mm::nvfp4_wgmma_mm_kernel<128, ...", "grouped GEMMs (FPROP, DGRAD)"),
    ("dm_nvfp4::wgmma_mm::nvfp4_wgmma_mm_kernel", "grouped GEMMs (FPROP, DGRAD)"),
    ("void dm_sm90::fill_fp8_fprop_args<dm_sm90::Fp8Gemm<...", "grouped GEMMs (FPROP, DGRAD)"),
    ("void dm_fp8q::quant_rows_cols<true, true, true>(dm_f...",
     "activation quantization (fp8_block, mxfp8, nvfp4)"),
    ("void dm_fp8q::swiglu_bwd_quant<true, false>(dm_fp...",
     "activation quantization (fp8_block, mxfp8, nvfp4)"),
    ("_swiglu_bwd_rows_kernel", "SwiGLU row kernels"),
    ("c10d::symmetric_memory::barrier_kernel(unsigned int*...", "device barriers"),
    ("Memset (Device)", "torch ops, copies, memsets"),
    ("some_new_kernel", pb.OTHER),
])
def test_every_kernel_of_ours_has_a_part(name, part):
    assert pb.part_of(name) == part


def test_units_and_bad_input():
    assert pb._us("1.5ms") == 1500.0 and pb._us("2s") == 2e6 and pb._us("7.0us") == 7.0
    with pytest.raises(ValueError, match="not a profiler time"):
        pb._us("12")
    with pytest.raises(ValueError, match="replays=0"):
        pb.breakdown([("k", 1.0, 1)], replays=0, iter_ms=None)


def test_every_triton_kernel_in_the_package_has_a_part():
    import re

    kdir = os.path.join(REPO, "megatron_dist_moe", "kernels")
    names = []
    for root, _dirs, files in os.walk(kdir):
        for fn in sorted(files):
            if fn.endswith(".py"):
                with open(os.path.join(root, fn)) as f:
                    names += re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+)\(",
                                        f.read())
    names = [n for n in names if n.endswith("_kernel")]   # launched kernels, not helpers
    assert len(names) >= 14, names
    assert [n for n in names if pb.part_of(n) == pb.OTHER] == []


def _trace(events):
    """A Chrome trace as torch.profiler writes it: kernels are complete ('X') events."""
    return {"traceEvents": [{"ph": "X", "cat": cat, "name": n, "ts": ts, "dur": dur,
                             "args": {"stream": 7}} for cat, n, ts, dur in events]
            + [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5}]}


def test_idle_gaps_charges_each_gap_to_its_transition(tmp_path):
    # two replays of: GEMM 100 us, gap 20, gather 30 (a side-stream kernel runs inside the
    # GEMM), gap 5, barrier 10; then 50 us until the next replay
    one = [("kernel", "_grouped_mm_kernel", 0, 100), ("kernel", "_side_kernel", 40, 20),
           ("kernel", "_gather_rows_kernel", 120, 30),
           ("kernel", "void c10d::symmetric_memory::barrier_kernel<int>(unsigned int*)", 155, 10)]
    events = one + [(c, n, ts + 215, d) for c, n, ts, d in one]
    trace = _trace(events)
    ivs = pb.kernel_intervals(trace)
    assert len(ivs) == 8 and ivs[0] == ("_grouped_mm_kernel", 0.0, 100.0)
    g = pb.idle_gaps(ivs, replays=2)
    # span 215 + 165 = 380 us; busy 2 x 140; idle 2 x 25 + 50 between the replays
    assert g["span_ms"] == pytest.approx(0.190)
    assert g["busy_ms"] == pytest.approx(0.140)
    assert g["idle_ms"] == pytest.approx(0.050)
    assert g["overlap_ms"] == pytest.approx(0.020)
    t = {(r["after"], r["before"]): r for r in g["transitions"]}
    assert t[("_grouped_mm_kernel", "_gather_rows_kernel")]["ms"] == pytest.approx(0.020)
    assert t[("_grouped_mm_kernel", "_gather_rows_kernel")]["count"] == 1
    barrier = "c10d::symmetric_memory::barrier_kernel"
    assert t[(barrier, "_grouped_mm_kernel")]["ms"] == pytest.approx(0.025)  # 50 us, once
    assert t[("_gather_rows_kernel", barrier)]["mean_us"] == pytest.approx(5.0)
    assert g["transitions"][0]["after"] == barrier   # sorted by idle time
    path = tmp_path / "trace.json"
    path.write_text(__import__("json").dumps(trace))
    png = tmp_path / "timeline.png"
    assert pb.main(["--gaps", str(path), "--replays", "2", "--plot", str(png)]) == 0
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 1000
    with pytest.raises(ValueError, match="no kernel intervals"):
        pb.idle_gaps([], replays=1)


def test_the_alignment_barrier_is_left_out():
    """common.profile_graph aligns the ranks with an NCCL barrier inside the profiler: its kernel
    is neither a part nor the start of the device span."""
    nccl = "ncclDevKernel_AllReduce_Sum_u8_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    parts = {r["part"]: r for r in pb.breakdown(
        [(nccl, 5000.0, 1), ("_grouped_mm_kernel", 2000.0, 2)], replays=2, iter_ms=1.5)}
    assert pb.OTHER not in parts and parts["all kernels"]["ms"] == pytest.approx(1.0)
    ivs = pb.kernel_intervals(_trace([("kernel", nccl, 0, 3000),
                                      ("kernel", "_grouped_mm_kernel", 3500, 100)]))
    assert ivs == [("_grouped_mm_kernel", 3500.0, 3600.0)]
