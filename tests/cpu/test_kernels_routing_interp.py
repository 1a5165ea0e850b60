"""Routing tables (kernels/routing.py: the one-launch tile and the two launches) under Triton's
CPU interpreter, against the torch version (backends/cuda/routing.py: build_routing_tables),
which they must match exactly.

"Peers" are CPU buffers laid out as routing regions (int32 T at byte 0, the int32 schedule word at
byte 4, int16 IDs [T, K] at byte 128); dispatch/combine bases are arbitrary numbers (the kernels
only compute addresses). Checks run in one child process with TRITON_INTERPRET=1; the
interpreter has no trap, so failed checks are read from the status word (trap=False), which the
GPU path turns into a trap.
"""

from __future__ import annotations

import pytest

from megatron_dist_moe import testing as tt

CHILD = r'''
import json, sys, torch
from megatron_dist_moe.kernels import routing as KR
from megatron_dist_moe.kernels import rows as K_rows
from megatron_dist_moe.backends.cuda.routing import build_routing_tables

HDR = 128


def regions(ids_EPTK, T_EP, T_max, S_EP=None):
    """One routing region per rank (kept alive by the caller) and their bases."""
    EP, _, K = ids_EPTK.shape
    bufs = []
    for r in range(EP):
        b = torch.zeros(HDR + T_max * K * 2, dtype=torch.uint8)
        b[:4].view(torch.int32)[0] = int(T_EP[r])
        b[4:8].view(torch.int32)[0] = -1 if S_EP is None else S_EP[r]
        b[HDR:].view(torch.int16).view(T_max, K).copy_(ids_EPTK[r])
        bufs.append(b)
    return bufs, torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)


def case(name, *, EP, T, K, E_local, rank, max_rows, T_max=None, seed=0, inactive=0.2,
         hot=None, T_EP=None, S_EP=None, bad=None, scores=None, expect=0, fanout=True):
    g = torch.Generator().manual_seed(seed)
    T_max = T_max or T
    E = EP * E_local
    ids = torch.randint(0, E, (EP, T_max, K), generator=g)
    if hot is not None:                      # skew: most routes to expert `hot`
        ids = torch.where(torch.rand(EP, T_max, K, generator=g) < 0.8, hot, ids)
    ids[torch.rand(EP, T_max, K, generator=g) < inactive] = -1
    if bad is not None:
        for (r, t, k), v in bad.items():
            ids[r, t, k] = v
    ids16 = ids.to(torch.int16)
    T_EP = torch.tensor(T_EP or [T] * EP, dtype=torch.int32)
    bufs, base = regions(ids16, T_EP, T_max, S_EP)
    disp_base = torch.tensor([(r + 1) << 40 for r in range(EP)], dtype=torch.int64)
    comb_base = torch.tensor([(r + 7) << 40 for r in range(EP)], dtype=torch.int64)
    row_bytes = 96 * 2
    sc = None
    if scores == "clean":
        sc = torch.where(ids[rank, :T] >= 0, torch.rand(T, K, generator=g), 0.0)
    elif isinstance(scores, dict):
        sc = torch.where(ids[rank, :T] >= 0, torch.rand(T, K, generator=g), 0.0)
        for (t, k), v in scores.items():
            sc[t, k] = v
    ws = KR.RouteWorkspace(EP, T_max, K, E_local, "cpu")
    got = KR.route_tables(ws, base, T, K, rank, E, max_rows, disp_base, comb_base, row_bytes,
                          own_scores_TK=sc, trap=False, fanout=fanout)
    offs, nrows, rows_EP, fwd, comb, disp, status = got[:7]
    code, a, b = status.tolist()
    out = {"name": name, "code": code, "a": a, "b": b, "launches": ws.launches(T, K)}
    if code != expect:
        out["error"] = f"status {(code, a, b)}, expected code {expect}"
        return out
    if expect in (1, 2, 5, 8):   # no table written: zero rows published
        if int(nrows) != 0 or bool(offs.any()) or bool(rows_EP.any()):
            out["error"] = f"failed check published rows: num_rows={nrows.tolist()}, " \
                           f"offsets={offs.tolist()}, rows_EP={rows_EP.tolist()}"
    if expect:
        return out
    # the torch oracle (its checks pass on this input)
    S_all = torch.tensor(S_EP or [-1] * EP, dtype=torch.int32)
    ref = build_routing_tables(ids16, T_EP, T, rank, E_local, E, max_rows, disp_base, comb_base,
                               row_bytes, own_scores_TK=sc, device_checks=False, fanout=fanout,
                               sched_all_EP=S_all)
    R = int(ref.num_rows)
    pairs = dict(expert_offsets=(offs, ref.expert_offsets), num_rows=(nrows, ref.num_rows),
                 rows_EP=(rows_EP, ref.rows_EP), fwd=(fwd, ref.fwd_gather_ptrs),
                 comb=(comb, ref.combine_ptrs), disp=(disp, ref.dispatch_route_ptrs))
    for k, (x, y) in pairs.items():
        if not torch.equal(x.cpu(), y.cpu()):
            diff = (x.cpu() != y.cpu()).nonzero().flatten()[:5].tolist()
            out["error"] = f"{k} differs at {diff} (R={R})"
            return out
    if fanout:
        # the fan-out table: equal to the torch one, and route (r, t, k) -> row i exactly where
        # row i's gather address is rank r's token t
        fan = got[7]
        if len(got) != 8 or not torch.equal(fan, ref.fanout.dest_rows):
            out["error"] = "fan-out table differs from the torch one"
            return out
        dest = fan.view(EP, T, K).to(torch.int64) if T else fan.view(EP, 0, K)
        seen = torch.zeros(max(R, 1), dtype=torch.int32)
        for r in range(EP):
            for t in range(T):
                for k in range(K):
                    i = int(dest[r, t, k])
                    mine = rank * E_local <= int(ids16[r, t, k]) < (rank + 1) * E_local
                    if (i >= 0) != mine or (i >= 0 and (i >= R or int(fwd[i]) !=
                                                       int(disp_base[r]) + t * row_bytes)):
                        out["error"] = f"fan-out row {i} for route {(r, t, k)} (R={R})"
                        return out
                    if i >= 0:
                        seen[i] += 1
        if R and not bool((seen == 1).all()):
            out["error"] = "fan-out table does not name every row exactly once"
            return out
    elif len(got) != 7:
        out["error"] = "route_tables(fanout=False) returned a fan-out table"
        return out
    out["R"] = R
    return out


CASES = [
    dict(name="ep2_guide_like", EP=2, T=300, K=6, E_local=6, rank=0, max_rows=4000, scores="clean"),
    dict(name="ep2_rank1", EP=2, T=300, K=6, E_local=6, rank=1, max_rows=4000, fanout=False,
         S_EP=[9, 9]),
    dict(name="multi_chunk", EP=2, T=1500, K=6, E_local=4, rank=1, max_rows=20000, seed=3),
    dict(name="ep4_k1_tmax", EP=4, T=50, T_max=64, K=1, E_local=3, rank=2, max_rows=300, seed=4),
    dict(name="ep1", EP=1, T=77, K=2, E_local=5, rank=0, max_rows=200, seed=5),
    dict(name="hot_expert", EP=2, T=400, K=4, E_local=8, rank=0, max_rows=4000, hot=3, seed=6),
    dict(name="all_inactive", EP=2, T=40, K=2, E_local=2, rank=0, max_rows=100, inactive=1.0),
    dict(name="zero_tokens", EP=2, T=0, T_max=8, K=2, E_local=2, rank=1, max_rows=64),
    dict(name="exact_fit", EP=2, T=64, K=2, E_local=1, rank=0, max_rows=256, inactive=0.0,
         hot=0),
    dict(name="unequal_T", EP=3, T=20, T_max=32, K=2, E_local=2, rank=0, max_rows=200,
         T_EP=[20, 20, 17], expect=1),
    dict(name="overflow", EP=2, T=100, K=4, E_local=2, rank=0, max_rows=50, inactive=0.0,
         expect=2),
    dict(name="peer_rejected", EP=3, T=20, T_max=32, K=2, E_local=2, rank=2, max_rows=200,
         T_EP=[20, -1, 20], expect=5),
    dict(name="bad_id", EP=2, T=30, K=3, E_local=2, rank=1, max_rows=400,
         bad={(1, 7, 2): 4, (1, 9, 0): -5, (0, 1, 1): 99}, expect=3),
    dict(name="inactive_score", EP=2, T=30, K=3, E_local=2, rank=0, max_rows=400,
         bad={(0, 5, 1): -1}, scores={(5, 1): 0.5}, expect=4),
    # another schedule word on a peer: rank 2 made no training forward (-1)
    dict(name="schedule", EP=3, T=20, T_max=32, K=2, E_local=2, rank=0, max_rows=200,
         S_EP=[13, 13, -1], expect=8),
    # the one-launch tile (decode) with a zero tail longer than one program's share
    dict(name="one_launch_long_tail", EP=1, T=8, K=6, E_local=6, rank=0, max_rows=9000,
         scores="clean", seed=8),
    dict(name="one_launch_ep2", EP=2, T=8, K=6, E_local=3, rank=1, max_rows=96, seed=9,
         scores="clean"),
    # the failed checks once more where the routes need the two launches (count, place)
    dict(name="unequal_T_two", EP=2, T=1100, K=2, E_local=2, rank=0, max_rows=5000,
         T_EP=[1100, 1099], expect=1),
    dict(name="overflow_two", EP=2, T=600, K=4, E_local=2, rank=1, max_rows=100,
         inactive=0.0, expect=2),
    dict(name="bad_id_two", EP=2, T=700, K=3, E_local=2, rank=1, max_rows=5000,
         bad={(1, 600, 2): 4, (1, 650, 0): -5, (0, 1, 1): 99}, expect=3),
    dict(name="inactive_score_two", EP=2, T=700, K=3, E_local=2, rank=0, max_rows=5000,
         bad={(0, 500, 1): -1}, scores={(500, 1): 0.5}, expect=4),
    dict(name="schedule_two", EP=2, T=1100, K=2, E_local=2, rank=1, max_rows=5000,
         S_EP=[5, 13], expect=8),
]

names = set(sys.argv[1:])
for c in CASES:
    if names and c["name"] not in names:
        continue
    try:
        res = case(**c)
    except Exception as ex:
        import traceback
        res = {"name": c["name"], "error": f"{type(ex).__name__}: {ex}",
               "trace": traceback.format_exc()[-2500:]}
    print("RESULT " + json.dumps(res), flush=True)
'''

NAMES = ["ep2_guide_like", "ep2_rank1", "multi_chunk", "ep4_k1_tmax", "ep1", "hot_expert",
         "all_inactive", "zero_tokens", "exact_fit", "unequal_T", "overflow", "peer_rejected",
         "bad_id", "inactive_score", "one_launch_long_tail", "one_launch_ep2", "unequal_T_two",
         "overflow_two", "bad_id_two", "inactive_score_two", "schedule", "schedule_two"]
# (code, a, b) that the failing cases must report: the numbers the trap message prints
EXPECT_NUMBERS = {
    "unequal_T": (1, 2, 17),                   # peer rank 2 has T=17
    "overflow": (2, None, 50),                 # R rows required, 50 available
    "peer_rejected": (5, 1, -1),               # rank 1 published T = -1 (its input was bad)
    "bad_id": (3, 7 * 3 + 2, 4),               # first bad flat route of rank 1: t=7, k=2, id 4
    "inactive_score": (4, 5 * 3 + 1, 0x3F000000),  # t=5, k=1, bits of 0.5
    "unequal_T_two": (1, 1, 1099),
    "overflow_two": (2, None, 100),
    "bad_id_two": (3, 600 * 3 + 2, 4),
    "inactive_score_two": (4, 500 * 3 + 1, 0x3F000000),
    "schedule": (8, 2, -1),                    # peer rank 2's word: no training forward
    "schedule_two": (8, 0, 5),                 # peer rank 0's word against this rank's 13
}


# the cases that take the one-launch tile (the others the two launches)
ONE_LAUNCH = {"ep4_k1_tmax", "ep1", "all_inactive", "zero_tokens", "exact_fit", "unequal_T",
              "overflow", "peer_rejected", "bad_id", "inactive_score", "one_launch_long_tail",
              "one_launch_ep2", "schedule"}


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    return tt.run_child_checks(["-c", CHILD])[0]


@pytest.mark.parametrize("name", NAMES)
def test_routing_kernels_match_torch_tables(results, name):
    res = results.get(name)
    assert res is not None, f"{name}: no result"
    assert "error" not in res, f"{name}: {res['error']}\n{res.get('trace', '')}"
    assert res["launches"] == (1 if name in ONE_LAUNCH else 2), res["launches"]
    if name in EXPECT_NUMBERS:
        code, a, b = EXPECT_NUMBERS[name]
        assert res["code"] == code
        assert a is None or res["a"] == a, f"{name}: a={res['a']}, want {a}"
        assert res["b"] == b, f"{name}: b={res['b']}, want {b}"


@pytest.mark.parametrize("EP,T,K,E_local,launches", [
    (1, 8, 6, 6, 1), (8, 16, 8, 32, 1),      # decode shapes the GPU tests run in one launch
    (1, 256, 4, 1024, 2),                    # a [2048, 1024] one-hot would not compile
    (8, 32, 8, 32, 2), (64, 4, 8, 4, 2)])    # [2048, 32] and [2048, 64] one-hots: two launches
def test_one_launch_only_where_its_one_hot_tiles_stay_small(EP, T, K, E_local, launches):
    from megatron_dist_moe.kernels import routing as KR
    assert KR.RouteWorkspace(EP, T, K, E_local, "cpu").launches(T, K) == launches
