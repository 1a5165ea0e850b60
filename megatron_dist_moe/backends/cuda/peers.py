"""Can the EP group's GPUs reach each other's memory? Checked once, when a context is created.

The CUDA backend reads and writes peers' HBM directly (symmetric memory over NVLink), so every
rank of an EP group must sit on the same node, with peer access between every pair of GPUs.
`describe_rank` says where a rank runs; `reachability_problems` (pure, so CPU-tested) turns every
rank's description into the list of pairs that cannot reach each other; `check_peer_access` is
the collective that raises before any symmetric allocation.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

__all__ = ["describe_rank", "reachability_problems", "check_peer_access"]


def describe_rank(device: torch.device) -> dict:
    """Host name, this rank's GPU (index and UUID) and, for every GPU visible here, its UUID and
    whether this rank's GPU has peer access to it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = torch.cuda.device_count()
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]
    reach = {uuids[j]: (j == index or torch.cuda.can_device_access_peer(index, j))
             for j in range(n)}
    return dict(host=socket.gethostname(), device=index, uuid=uuids[index], reach=reach)


def reachability_problems(infos: list[dict]) -> list[str]:
    """Pairs of ranks that cannot reach each other's memory, as sentences (empty: all good)."""
    problems = []
    hosts = {}
    for r, info in enumerate(infos):
        hosts.setdefault(info["host"], []).append(r)
    if len(hosts) > 1:
        where = "; ".join(f"ranks {v} on {h}" for h, v in hosts.items())
        problems.append(f"the EP group spans {len(hosts)} nodes ({where}): peer memory does not "
                        "reach across nodes")
        return problems
    for a, ia in enumerate(infos):
        for b, ib in enumerate(infos):
            if b <= a:
                continue
            if ia["uuid"] == ib["uuid"]:
                problems.append(f"ranks {a} and {b} share one GPU ({ia['uuid']})")
                continue
            ab, ba = ia["reach"].get(ib["uuid"]), ib["reach"].get(ia["uuid"])
            if ab is False or ba is False:
                problems.append(f"ranks {a} (GPU {ia['device']}) and {b} (GPU {ib['device']}) on "
                                f"{ia['host']} have no peer access to each other")
    return problems


def check_peer_access(group, device: torch.device) -> None:
    """Collective: raise RuntimeError on every rank naming the ranks that cannot reach each
    other's memory (different nodes, no peer access, a shared GPU)."""
    infos: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(infos, describe_rank(device), group=group)
    problems = reachability_problems(infos)
    if problems:
        raise RuntimeError(
            "backend='cuda' needs every rank of the EP group to reach the others' GPU memory "
            "(symmetric memory over NVLink): " + "; ".join(problems) + ". Keep expert "
            "parallelism inside one NVLink domain (one node; scripts/slurm/ places the EP group "
            "so), or use backend='reference' (all-to-all over torch.distributed)")
