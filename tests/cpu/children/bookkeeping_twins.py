"""Child of tests/cpu/test_kernels_bookkeeping_interp.py: the Triton bookkeeping kernels against
the torch bookkeeping, call by call, in the interpreter. Prints one `RESULT <json>` per case."""
import json
import torch
import megatron_dist_moe as dm
from megatron_dist_moe.planner import PlannerState
from megatron_dist_moe.backends.cuda.bookkeeping import TorchBookkeeping, TritonBookkeeping
from megatron_dist_moe.backends.cuda.routing import RoutingTables


def run(ep, rank, factor, seed, layers, slots, precision="bf16"):
    cfg = dm.Config(num_local_input_tokens=32, hidden_dim=128, intermediate_dim=256, top_k=2,
                    num_experts=4 * ep, backend="reference", num_activation_slots=slots,
                    max_moe_layers_per_activation_slot=layers,
                    activation_slot_capacity_factor=factor, precision=precision)
    plan = dm.plan_memory(cfg, ep_size=ep)
    E_local = cfg.num_local_experts(ep)
    g = torch.Generator().manual_seed(seed)
    act_base = torch.tensor([1 << 40], dtype=torch.int64)
    arena_end = act_base + plan.activation_buffer_bytes
    combine = torch.tensor([7 << 40], dtype=torch.int64)
    st = {n: PlannerState.create(plan, "cpu") for n in ("torch", "triton")}
    bk = {"torch": TorchBookkeeping(plan, st["torch"], rank, act_base, arena_end, combine),
          "triton": TritonBookkeeping(plan, st["triton"], rank, act_base, arena_end, combine,
                                      num_local_experts=E_local)}
    start = st["torch"].buffer_offsets.clone()
    max_rows = plan.total_scratch_rows   # what routing lets through (it traps above)

    def tables():
        rows_EP = torch.randint(0, max_rows + 1, (ep,), generator=g)
        cuts = torch.randint(0, int(rows_EP[rank]) + 1, (E_local - 1,), generator=g).sort().values
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, rows_EP[rank:rank + 1]])
        z = torch.zeros(1, dtype=torch.int64)
        return RoutingTables(expert_offsets=offs.to(torch.int32),
                             num_rows=rows_EP[rank:rank + 1].to(torch.int32), rows_EP=rows_EP,
                             fwd_gather_ptrs=z, combine_ptrs=z, dispatch_route_ptrs=z,
                             max_rows=max_rows)

    def same(tag, a, b):
        if isinstance(a, torch.Tensor):
            if not torch.equal(a.reshape(-1).to(torch.int64), b.reshape(-1).to(torch.int64)):
                raise AssertionError(f"{tag}: torch {a.tolist()} != triton {b.tolist()}")
        elif a is None or b is None:
            assert a is None and b is None, f"{tag}: one is None"
        elif isinstance(a, dict):
            assert list(a) == list(b), f"{tag}: regions {list(a)} != {list(b)}"
            for k in a:
                same(f"{tag}[{k}]", a[k], b[k])
        else:
            for f in vars(a):
                if f != "rec_vec":
                    same(f"{tag}.{f}", getattr(a, f), getattr(b, f))

    def states(tag):
        for f in ("buffer_offsets", "saved_bytes", "layer_position", "selected"):
            same(f"{tag} state.{f}", getattr(st["torch"], f), getattr(st["triton"], f))

    saved, needs = [], []
    T = 32
    for s in range(slots):
        for n in st.values():
            n.select(s, layers)
        for layer in range(layers):
            tabs = tables()
            out = {n: bk[n].forward(tabs, T, True) for n in bk}
            same(f"slot {s} layer {layer} fwd", out["torch"], out["triton"])
            states(f"slot {s} layer {layer} fwd")
            needs.append(bool(out["torch"].record.need_recompute))
            saved.append((tabs, out))
    t_inf = tables()
    inf = {n: bk[n].forward(t_inf, T, False) for n in bk}
    same("inference fwd", inf["torch"], inf["triton"])
    states("inference fwd")
    for i, (tabs, out) in reversed(list(enumerate(saved))):
        b = {n: bk[n].backward(out[n].record, out[n].rec_vec, tabs, T) for n in bk}
        same(f"call {i} bwd", b["torch"], b["triton"])
        states(f"call {i} bwd")
    assert torch.equal(st["triton"].buffer_offsets, start), "cursors did not return"
    assert bk["triton"].status.tolist() == [0, 0, 0], f"layout guard: {bk['triton'].status}"
    return needs


if __name__ == "__main__":
    out = {}
    for name, kw in {"ep2_rank0_tight": dict(ep=2, rank=0, factor=1.0, seed=1, layers=4, slots=2),
                     "ep2_rank1_tight": dict(ep=2, rank=1, factor=1.0, seed=2, layers=4, slots=2),
                     "ep4_roomy": dict(ep=4, rank=3, factor=2.5, seed=3, layers=3, slots=1),
                     "ep1_tight": dict(ep=1, rank=0, factor=1.0, seed=4, layers=5, slots=2),
                     "fp8_block_ep2_tight": dict(ep=2, rank=1, factor=1.0, seed=5, layers=4,
                                                 slots=2, precision="fp8_block"),
                     "fp8_block_ep1_roomy": dict(ep=1, rank=0, factor=2.0, seed=6, layers=3,
                                                 slots=1, precision="fp8_block")}.items():
        try:
            needs = run(**kw)
            out = {"name": name, "ok": True, "needs": needs}
        except Exception as ex:
            import traceback
            out = {"name": name, "ok": False, "error": f"{type(ex).__name__}: {ex}",
                   "trace": traceback.format_exc()[-2500:]}
        print("RESULT " + json.dumps(out), flush=True)
