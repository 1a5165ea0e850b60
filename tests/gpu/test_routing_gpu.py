"""Triton routing tables on the GPU (the one-launch tile and the two launches), bit-equal to
the torch version.

"Peers" are routing regions in this GPU's memory (int32 T at byte 0, int16 IDs at byte 128);
dispatch/combine bases are arbitrary numbers (only addresses are computed). The failing-check
paths run with trap=False and report through the status word; the trap itself is exercised
end to end by tests/gpu/dist_check.py (the default routing).

    pytest -m gpu tests/gpu/test_routing_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from megatron_dist_moe.backends.cuda.routing import build_routing_tables  # noqa: E402
from megatron_dist_moe.kernels import routing as KR  # noqa: E402

DEV = torch.device("cuda")


def _regions(ids_EPTK, T_EP):
    EP, T_max, K = ids_EPTK.shape
    bufs = []
    for r in range(EP):
        b = torch.zeros(128 + T_max * K * 2, dtype=torch.uint8, device=DEV)
        b[:4].view(torch.int32).fill_(int(T_EP[r]))
        b[128:].view(torch.int16).view(T_max, K).copy_(ids_EPTK[r])
        bufs.append(b)
    return bufs, torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=DEV)


@pytest.mark.parametrize("EP,T,K,E_local,rank,hot,launches", [
    (2, 2048, 6, 6, 0, None, 2), (2, 2048, 6, 6, 1, 7, 2), (8, 4096, 8, 32, 5, None, 2),
    (4, 37, 1, 3, 3, None, 1), (1, 0, 2, 4, 0, None, 1), (2, 8192, 8, 8, 1, 2, 2),
    (1, 8, 6, 6, 0, None, 1), (1, 32, 6, 6, 0, None, 1), (2, 128, 6, 6, 1, 3, 1),
    (8, 16, 8, 32, 6, None, 1), (1, 512, 6, 6, 0, None, 2)])
def test_route_tables_match_torch(EP, T, K, E_local, rank, hot, launches):
    g = torch.Generator(device=DEV).manual_seed(EP * 1000 + T)
    E = EP * E_local
    ids = torch.randint(0, E, (EP, T, K), generator=g, device=DEV)
    if hot is not None:
        ids = torch.where(torch.rand(EP, T, K, generator=g, device=DEV) < 0.7, hot, ids)
    ids[torch.rand(EP, T, K, generator=g, device=DEV) < 0.1] = -1
    ids16 = ids.to(torch.int16)
    T_EP = torch.full((EP,), T, dtype=torch.int32, device=DEV)
    bufs, base = _regions(ids16, T_EP)
    disp = torch.tensor([(r + 1) << 40 for r in range(EP)], dtype=torch.int64, device=DEV)
    comb = torch.tensor([(r + 9) << 40 for r in range(EP)], dtype=torch.int64, device=DEV)
    max_rows = EP * T * min(K, E_local) + 100
    scores = torch.where(ids[rank] >= 0, torch.rand(T, K, generator=g, device=DEV), 0.0)
    ws = KR.RouteWorkspace(EP, T, K, E_local, DEV)
    assert ws.launches(T, K) == launches
    for _ in range(2):   # the workspace is reused across calls
        got = KR.route_tables(ws, base, T, K, rank, E, max_rows, disp, comb, 14336,
                              own_scores_TK=scores, trap=False)
    ref = build_routing_tables(ids16, T_EP, T, rank, E_local, E, max_rows, disp, comb, 14336,
                               own_scores_TK=scores, device_checks=False)
    names = ("expert_offsets", "num_rows", "rows_EP", "fwd_gather_ptrs", "combine_ptrs",
             "dispatch_route_ptrs")
    for name, x in zip(names, got[:6]):
        assert torch.equal(x, getattr(ref, name)), f"{name} differs"
    assert got[6].tolist() == [0, 0, 0], f"status {got[6].tolist()}"


@pytest.mark.parametrize("T", [512, 8])
def test_route_tables_in_cuda_graph(T):
    EP, K, E_local, rank = 2, 4, 4, 1
    E = EP * E_local
    ids = torch.randint(-1, E, (EP, T, K), device=DEV).to(torch.int16)
    bufs, base = _regions(ids, [T] * EP)
    bases = torch.arange(1, EP + 1, device=DEV, dtype=torch.int64) << 40
    ws = KR.RouteWorkspace(EP, T, K, E_local, DEV)
    KR.route_tables(ws, base, T, K, rank, E, 4096, bases, bases, 256, trap=True)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = KR.route_tables(ws, base, T, K, rank, E, 4096, bases, bases, 256, trap=True)
    for it in range(3):
        new = torch.randint(-1, E, (EP, T, K), device=DEV).to(torch.int16)
        for r in range(EP):
            bufs[r][128:].view(torch.int16).view(T, K).copy_(new[r])
        graph.replay()
        ref = build_routing_tables(new, torch.full((EP,), T, device=DEV), T, rank, E_local, E,
                                   4096, bases, bases, 256, device_checks=False)
        assert torch.equal(out[3], ref.fwd_gather_ptrs), f"replay {it}: tables differ"
        assert torch.equal(out[0], ref.expert_offsets), f"replay {it}: offsets differ"


@pytest.mark.parametrize("EP,T,K,E_local,rank", [(2, 2048, 6, 6, 0), (2, 2048, 8, 8, 1),
                                                 (4, 333, 3, 2, 2), (1, 8, 6, 6, 0)])
def test_fanout_gather_equals_the_row_gather(EP, T, K, E_local, rank):
    """Fan-out gathers: the fan-out table equals the torch one, and rows.fanout_rows
    (each token read once) writes exactly what gather_rows (one read per route) writes."""
    from megatron_dist_moe.kernels import rows as K_rows

    g = torch.Generator(device=DEV).manual_seed(T * K)
    E, D = EP * E_local, 7168
    ids = torch.randint(0, E, (EP, T, K), generator=g, device=DEV)
    ids[torch.rand(EP, T, K, generator=g, device=DEV) < 0.1] = -1
    ids16 = ids.to(torch.int16)
    T_EP = torch.full((EP,), T, dtype=torch.int32, device=DEV)
    bufs, base = _regions(ids16, T_EP)
    x = [torch.randn(T, D, generator=g, device=DEV).to(torch.bfloat16) for _ in range(EP)]
    disp = torch.tensor([t.data_ptr() for t in x], dtype=torch.int64, device=DEV)
    comb = disp + 0
    max_rows = EP * T * min(K, E_local)
    ws = KR.RouteWorkspace(EP, T, K, E_local, DEV)
    offs, nrows, _, fwd, _, _, status, fan = KR.route_tables(
        ws, base, T, K, rank, E, max_rows, disp, comb, D * 2, trap=False, fanout=True)
    ref = build_routing_tables(ids16, T_EP, T, rank, E_local, E, max_rows, disp, comb, D * 2,
                               device_checks=False, fanout=True)
    assert status.tolist() == [0, 0, 0] and torch.equal(fan, ref.fanout.dest_rows)
    a = torch.full((max_rows, D), float("nan"), device=DEV).to(torch.bfloat16)
    b = a.clone()
    K_rows.gather_rows(fwd, K_rows.device_ptr(a), nrows, D, torch.bfloat16, max_rows)
    K_rows.fanout_rows(disp, D * 2, fan, T, K, K_rows.device_ptr(b), nrows, D, torch.bfloat16)
    R = int(nrows)
    assert torch.equal(a[:R], b[:R]) and torch.isnan(b[R:].float()).all()
