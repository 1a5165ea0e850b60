"""benchmarks/bench_sustained.py's pure parts: nvidia-smi parsing, the burst/settled statistics,
the plot (the GPU run itself is on the GPU machine: gpu_session.sh sustained)."""

import os
import sys
from datetime import datetime

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_sustained as bs  # noqa: E402


def test_parse_smi_lines_times_from_t0_and_skips_junk():
    t0 = datetime(2026, 11, 30, 19, 22, 13).timestamp()
    lines = ["2026/11/30 19:22:13.250, 1980, 310.5, 41, 0x0000000000000000",
             "[N/A], [N/A], [N/A], [N/A], [N/A]",
             "garbage",
             "2026/11/30 19:22:14.000, 1755, 699.8, 55, 0x0000000000000004",
             "2026/11/30 19:22:14.020, 1740, 700.1, 55"]            # no reasons column
    recs = bs.parse_smi_lines(lines, t0)
    assert [r["t_s"] for r in recs] == pytest.approx([0.25, 1.0, 1.02])
    assert [r["sm_mhz"] for r in recs] == [1980, 1755, 1740]
    assert recs[1]["power_w"] == pytest.approx(699.8) and recs[1]["temp_c"] == 55
    assert recs[1]["reasons"] == "0x0000000000000004" and recs[2]["reasons"] == ""


def test_settle_stats_finds_the_slowdown_and_where_it_sets_in():
    ms = [8.0] * 20 + [8.0 + 0.1 * i for i in range(1, 10)] + [9.0] * 100
    st = bs.settle_stats(ms)
    assert st["burst_ms"] == 8.0 and st["settled_ms"] == 9.0
    assert st["slowdown"] == pytest.approx(9.0 / 8.0)
    # running medians of 5: replay 29 (8.6..9.0) gives 8.8 < 8.82 (2% under 9.0), replay 30 8.9
    assert st["settle_index"] == 30
    flat = bs.settle_stats([5.0] * 40)
    assert flat["slowdown"] == 1.0 and flat["settle_index"] == 0
    with pytest.raises(ValueError, match="replays"):
        bs.settle_stats([1.0] * 9)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    ms = [8.0] * 10 + [9.0] * 30
    samples = {0: [dict(t_s=0.01 * i, sm_mhz=1980 - 5 * i, power_w=600, temp_c=50, reasons="")
                   for i in range(40)],
               1: [dict(t_s=0.01 * i, sm_mhz=1970 - 5 * i, power_w=600, temp_c=50, reasons="")
                   for i in range(40)]}
    path = tmp_path / "s.png"
    bs.plot({"dense_mm": (ms, samples), "dist_moe_fwdbwd": (ms, samples)}, str(path), "2x H200")
    assert path.stat().st_size > 10_000


def _agreed_replays_rank(rank, tmp):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    # rank 0 estimates 1.40 ms per replay, rank 1 1.41 ms: 2857 vs 2836 replays for 4 s
    n = bs.agreed_replays(4.0, 1.40 + 0.01 * rank)
    with open(f"{tmp}/rank{rank}.txt", "w") as f:
        f.write(str(n))
    dist.destroy_process_group()


def test_agreed_replays_is_the_same_on_every_rank(tmp_path):
    """Every rank replays the same count (their all-reduce of per-replay times needs equal
    lengths): the largest of the ranks' own estimates."""
    import torch.multiprocessing as mp
    mp.spawn(_agreed_replays_rank, args=(str(tmp_path),), nprocs=2)
    assert [int((tmp_path / f"rank{r}.txt").read_text()) for r in (0, 1)] == [2857, 2857]
    assert bs.agreed_replays(4.0, 1e9) == 2 * bs.BURST   # never fewer than the statistics need
