"""An EP group the peer memory cannot span is refused when the context is created, naming the
ranks (backends/cuda/peers.py; the collective itself runs on the GPU machine)."""

from __future__ import annotations

from megatron_dist_moe.backends.cuda.peers import reachability_problems


def _rank(host, device, uuid, reach):
    return dict(host=host, device=device, uuid=uuid, reach=reach)


def test_one_node_with_peer_access_is_fine():
    reach = {"G0": True, "G1": True}
    assert reachability_problems([_rank("n1", 0, "G0", reach), _rank("n1", 1, "G1", reach)]) == []


def test_ranks_on_two_nodes_are_named():
    infos = [_rank("n1", 0, "G0", {"G0": True}), _rank("n1", 1, "G1", {"G1": True}),
             _rank("n2", 0, "G2", {"G2": True})]
    (msg,) = reachability_problems(infos)
    assert "spans 2 nodes" in msg and "ranks [0, 1] on n1" in msg and "ranks [2] on n2" in msg


def test_gpus_without_peer_access_are_named():
    infos = [_rank("n1", 0, "G0", {"G0": True, "G1": False, "G2": True}),
             _rank("n1", 1, "G1", {"G0": False, "G1": True, "G2": True}),
             _rank("n1", 2, "G2", {"G0": True, "G1": True, "G2": True})]
    (msg,) = reachability_problems(infos)
    assert "ranks 0 (GPU 0) and 1 (GPU 1) on n1 have no peer access" in msg


def test_two_ranks_on_one_gpu_are_named():
    reach = {"G0": True}
    (msg,) = reachability_problems([_rank("n1", 0, "G0", reach), _rank("n1", 0, "G0", reach)])
    assert "ranks 0 and 1 share one GPU" in msg


def test_a_peer_gpu_this_rank_cannot_see_is_not_held_against_it():
    """With one visible GPU per process (CUDA_VISIBLE_DEVICES per rank) the peer's GPU is not in
    this rank's table: unknown is not a failure (symmetric memory maps it through IPC)."""
    infos = [_rank("n1", 0, "G0", {"G0": True}), _rank("n1", 0, "G1", {"G1": True})]
    assert reachability_problems(infos) == []
