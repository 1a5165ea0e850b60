"""The test harness's process spawner: failures carry their cause, signal deaths retry once."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from megatron_dist_moe import testing as tt


def _sum_ranks(rank, ws):
    import torch
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return float(t)


def _abort_once(rank, ws, marker):
    # Rank 0 aborts the first time (marker absent), as a gloo transport thread would.
    if rank == 0 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()
    return _sum_ranks(rank, ws)


def _always_abort(rank, ws):
    if rank == 1:
        os.write(2, b"gloo says: connection closed by peer\n")
        os.abort()
    dist.barrier()


def _raise_on_rank1(rank, ws):
    if rank == 1:
        raise ValueError("expert_ids: bad on rank 1")
    return rank


def test_results_come_back_per_rank():
    assert tt.spawn(_sum_ranks, 2) == [3.0, 3.0]


def test_signal_death_is_retried_once_with_a_warning(tmp_path):
    marker = str(tmp_path / "aborted_once")
    with pytest.warns(RuntimeWarning, match="died by a signal"):
        assert tt.spawn(_abort_once, 2, (marker,), timeout_s=30) == [3.0, 3.0]
    assert os.path.exists(marker)


def test_repeated_signal_death_raises_with_the_ranks_stderr():
    with pytest.warns(RuntimeWarning), pytest.raises(tt.SpawnedRankDied) as err:
        tt.spawn(_always_abort, 2, timeout_s=30)
    assert "SIGABRT" in str(err.value)
    assert "gloo says: connection closed by peer" in str(err.value)
    assert "Fatal Python error: Aborted" in str(err.value)


def test_python_errors_are_not_retried():
    import torch.multiprocessing as mp
    with pytest.raises(mp.ProcessRaisedException, match="expert_ids: bad on rank 1"):
        tt.spawn(_raise_on_rank1, 2, timeout_s=30)
