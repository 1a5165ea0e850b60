"""Device traps of the CUDA backend, one case per process (a trap ends the CUDA context).

    torchrun --nproc-per-node N tests/gpu/trap_check.py --case CASE
    one rank or more: overflow, bad_expert_id, layout_guard
    two ranks or more: unequal_T, peer_rejected

Each case makes every rank exit non-zero with the trap's message (the cause and the numbers) in
its output instead of hanging or computing a wrong result; tests/gpu/test_cuda_backend.py runs
them and checks the words.
    overflow       every route to rank 0, whose scratch holds fewer rows than it receives
                   (one rank: a device scratch factor below 1; more: the balanced rows only)
    bad_expert_id  an ID >= num_experts with host value checks off (sync-debug mode, as in
                   graph capture): the device check names the flat route index and the ID
    layout_guard   the per-call layout does not fit the scratch (the bookkeeping is handed a
                   plan whose scratch holds 128 bytes: the defect class of a plan and a layout
                   that disagree): the guard traps before any expert kernel writes, naming the
                   bytes needed, the bytes available and the rows
    unequal_T      rank 1 passes one token fewer (no host sync checks T: the device does)
    peer_rejected  rank 1's input fails host validation: rank 1 raises its ValueError after
                   meeting rank 0 at the device barrier with T = -1; rank 0's routing traps,
                   naming rank 1, instead of waiting for ever
The routing twin can be chosen with DIST_MOE_EXECUTION=routing=torch (the development override).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch
import torch.distributed as dist

import megatron_dist_moe as dm

CASES = {"overflow": 1, "bad_expert_id": 1, "layout_guard": 1, "unequal_T": 2,
         "peer_rejected": 2}   # case -> ranks it needs at least


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    args = ap.parse_args()
    rank, EP = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert EP >= CASES[args.case], f"{args.case} needs {CASES[args.case]} ranks"
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    T, D, F, K, E_local = 64, 256, 256, 2, 2
    factor = float(EP)
    if args.case == "overflow":
        factor = 0.5 if EP == 1 else 1.0
    cfg = dm.Config(num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K,
                    num_experts=E_local * EP, backend="cuda",
                    device_scratch_capacity_factor=factor)
    g = torch.Generator(device="cuda").manual_seed(rank)
    dev = torch.device("cuda")
    x = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E_local * EP, device=dev, generator=g)[:K]
                       for _ in range(T)])
    scores = torch.rand(T, K, device=dev, generator=g)
    w13 = (torch.randn(E_local, 2, F, D, device=dev, generator=g) / 16).to(torch.bfloat16)
    w2 = (torch.randn(E_local, D, F, device=dev, generator=g) / 16).to(torch.bfloat16)
    if args.case == "unequal_T" and rank == 1:
        x, ids, scores = x[:-1], ids[:-1], scores[:-1]
    if args.case == "overflow":
        ids = torch.stack([torch.zeros(T, device=dev, dtype=torch.int64),
                           torch.ones(T, device=dev, dtype=torch.int64)], 1)   # rank 0's experts
    if args.case == "bad_expert_id":
        ids[5, 1] = E_local * EP + 3
        torch.cuda.set_sync_debug_mode("warn")      # host value checks off: the device checks
    if args.case == "peer_rejected" and rank == 1:
        w2 = w2[:, :, :-8].contiguous()              # wrong F: host validation names w2
    with dm.create_context(config=cfg) as ctx:
        if args.case == "layout_guard":
            bk = ctx.backend.bk
            bk.plan = dataclasses.replace(bk.plan, total_scratch_bytes=128)
        with torch.no_grad():
            y = dm.routed_experts(x, ids, scores, w13, w2, ctx)
        torch.cuda.synchronize()
        print(f"rank {rank}: no trap (y norm {float(y.float().norm()):.3f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
