"""CUDA backend checks on 1 and 2 GPUs, launched through torchrun (the scripts also run alone).

    dist_check.py       forward + every gradient vs the fp64 oracle, graph replay, no host sync,
                        bitwise repeats, inference (eager, graph, after training), replay from
                        the minimum slot, VMM host-backed scratch
    packing_check.py    ten layers in one slot inside one CUDA graph: gradients, planner flags,
                        cursors, for three slot budgets
    inference_check.py  inference at the guide's expert shapes for T from 1 to 4096, eager and
                        in a CUDA graph, with guard bytes around the arena that must not change
    trap_check.py       device traps: each case ends every rank with the cause and the numbers
"""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(__file__)


def _torchrun(script, nproc, *args):
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)):
        pytest.skip("needs an sm_90+ GPU")
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
           os.path.join(HERE, script), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(r.stdout[-6000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


@pytest.mark.parametrize("nproc", [1, 2])
def test_cuda_backend_matches_oracle(nproc):
    _torchrun("dist_check.py", nproc)


@pytest.mark.parametrize("nproc", [1, 2])
def test_ten_layer_packing_in_one_graph(nproc):
    _torchrun("packing_check.py", nproc)


@pytest.mark.parametrize("nproc", [1, 2])
def test_inference_at_the_guide_shapes_stays_inside_its_arena(nproc):
    _torchrun("inference_check.py", nproc)


TRAPS = {   # case -> (ranks it needs, words every run must print: the trap text or host error)
    "unequal_T": (2, ["dist_moe TRAP: unequal token counts across EP ranks"]),
    "overflow": (1, ["dist_moe TRAP: scratch overflow: rows required, rows available"]),
    "bad_expert_id": (1, ["dist_moe TRAP: expert id out of range: flat route index, id"]),
    "layout_guard": (1, ["dist_moe TRAP: the per-call layout does not fit the arena"]),
    "peer_rejected": (2, ["dist_moe TRAP: a peer rank rejected its inputs", "w2"]),
}


@pytest.mark.parametrize("routing", ["torch", "triton"])
@pytest.mark.parametrize("case", sorted(TRAPS))
def test_device_traps_name_the_cause(case, routing):
    """A trap ends the job with its message instead of a hang or a wrong result."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)):
        pytest.skip("needs an sm_90+ GPU")
    nproc = max(TRAPS[case][0], min(2, torch.cuda.device_count()))
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
           os.path.join(HERE, "trap_check.py"), "--case", case]
    env = dict(os.environ, DIST_MOE_EXECUTION=f"routing={routing}")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    text = r.stdout + r.stderr
    assert r.returncode != 0, f"{case}: the job did not fail:\n{text[-3000:]}"
    assert "no trap" not in text, text[-3000:]
    for words in TRAPS[case][1]:
        assert words in text, f"{case}: {words!r} not in the output:\n{text[-4000:]}"
