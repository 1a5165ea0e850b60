"""plan_memory byte counts against values computed by hand from the guide's formulas (§03-§04).

Every number below is written out as arithmetic on the shape so a reader can re-derive it.
"""

from __future__ import annotations

import pytest

import megatron_dist_moe as dm
from megatron_dist_moe.memory_plan import align128


def cfg(**kw):
    """The by-hand numbers below use the design guide's layout (route outputs saved) unless a
    test asks for the default, save_route_outputs=False."""
    kw.setdefault("save_route_outputs", True)
    return dm.Config(**kw)


def test_align128():
    assert [align128(n) for n in (0, 1, 127, 128, 129, 1000)] == [0, 128, 128, 128, 256, 1024]


def test_bf16_small_shape_by_hand():
    # T=4 D=64 F=128 K=2 E=4 on EP=2: E_local=2, balanced R = T*K = 8
    c = cfg(num_local_input_tokens=4, hidden_dim=64, intermediate_dim=128, top_k=2,
            num_experts=4, activation_slot_capacity_factor=1.0)
    p = dm.plan_memory(c, ep_size=2)
    assert p.num_local_experts == 2
    assert p.balanced_rows == 8
    assert p.topology_max_rows == 4 * 2 * min(2, 2) == 16
    assert p.device_scratch_rows == min(2 * 8, 16) == 16      # factor 2, topology cap 16
    assert p.total_scratch_rows == 16
    assert p.input_bytes == 4 * 64 * 2 == 512
    # full state: x_g [R,D] + h1 [R,2F] + h3 routes [T,K,D], bf16
    assert p.layer.full_state(8) == 8 * 64 * 2 + 8 * 256 * 2 + 4 * 2 * 64 * 2 == 6144
    assert p.balanced_full_state_bytes == 6144
    # per-call layouts at R = 16 (layout.py): forward x_g + h1 + h2 = 2R(D+3F); backward replay
    # x_g + h1 + h2 + g3 = 2R(2D+3F)
    assert p.layer.forward_scratch(16) == 2 * 16 * (64 + 3 * 128) == 14336
    assert p.layer.backward_peak(16) == 2 * 16 * (2 * 64 + 3 * 128) == 16384
    # a training context runs inference forwards too (no_grad): that layout is x_g + h2 (no
    # h1) with GEMM_A_TAIL_ROWS = 128 rows past R at each, 2 (R + 128) (D + F) bytes, which at
    # this tiny shape outweighs the backward peak
    inference = 2 * (16 + 128) * (64 + 128)
    assert inference == 55296
    assert p.device_scratch_bytes == max(16384, inference) == 55296  # the largest layout
    assert p.host_scratch_bytes == 0
    # slots: minimum = inputs, balanced = full state (factor 1), max useful = full state at 16
    assert p.slot_min_bytes == 512
    assert p.slot_balanced_bytes == 6144
    assert p.slot_max_useful_bytes == 16 * 64 * 2 + 16 * 256 * 2 + 1024 == 11264
    assert p.slot_bytes == 6144
    assert p.scratch_offset == 6144 and p.slot_ends() == [0, 6144 + 55296]
    assert p.activation_buffer_bytes == 6144 + 55296
    # symmetric: 128 B header + int16 IDs [T,K]; dispatch [T,K,D] (training); combine [T,K,D]
    assert p.routing_bytes == 128 + align128(4 * 2 * 2) == 256
    assert p.dispatch_bytes == 4 * 2 * 64 * 2 == 1024
    assert p.combine_bytes == 1024
    assert p.total_device_bytes == 6144 + 55296 + 256 + 1024 + 1024


def test_bf16_layouts_when_D_exceeds_F():
    # D=128 > F=64, R=16: replay x_g 4096 + h1 4096 + h2 2048 + g3 4096
    c = cfg(num_local_input_tokens=4, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=2)
    lb = dm.plan_memory(c, ep_size=1).layer
    R = 16
    assert lb.backward_peak(R) == 2 * R * (2 * 128 + 3 * 64) == 14336
    assert lb.forward_scratch(R) == 2 * R * (128 + 3 * 64)


def test_slot_policies():
    base = dict(num_local_input_tokens=4, hidden_dim=64, intermediate_dim=128, top_k=2,
                num_experts=4, max_moe_layers_per_activation_slot=3)
    mn = dm.plan_memory(cfg(**base), ep_size=2)
    assert mn.slot_bytes == mn.slot_min_bytes == 3 * 512
    assert "minimum" in mn.slot_policy
    half = dm.plan_memory(cfg(**base, activation_slot_capacity_factor=0.5), ep_size=2)
    # min + 0.5 x (balanced - min) = 1536 + 0.5 x (3*6144 - 1536) = 9984, align128 -> 9984
    assert half.slot_bytes == align128(1536 + (3 * 6144 - 1536) // 2) == 9984
    exact = dm.plan_memory(cfg(**base, activation_slot_bytes=5000), ep_size=2)
    assert exact.slot_bytes == align128(5000) == 5120
    big = dm.plan_memory(cfg(**base, activation_slot_bytes=10**6), ep_size=2)
    assert any("maximum useful" in n for n in big.notes)
    with pytest.raises(dm.ConfigError, match="Config.activation_slot_bytes.*minimum"):
        dm.plan_memory(cfg(**base, activation_slot_bytes=1000), ep_size=2)
    two = dm.plan_memory(cfg(**base, num_activation_slots=2, activation_slot_bytes=5000), ep_size=2)
    assert two.slot_ends() == [0, 5120, 2 * 5120 + two.device_scratch_bytes]


def test_host_overflow_scratch():
    # device factor 1 -> 4 rows; total factor 4 -> 16 rows capped by topology T*EP*min(K,E_l)=8
    c = cfg(num_local_input_tokens=2, hidden_dim=64, intermediate_dim=64, top_k=2, num_experts=4,
            device_scratch_capacity_factor=1.0, host_scratch_capacity_factor=4.0)
    p = dm.plan_memory(c, ep_size=2)
    assert (p.device_scratch_rows, p.total_scratch_rows) == (4, 8)
    # the largest layout: replay 2R(2D + 3F), or inference x_g + h2 with their tails of 128 rows,
    # 2 (R + 128) (D + F) (a training context runs inference forwards too)
    def largest(R):
        return max(2 * R * (2 * 64 + 3 * 64), 2 * (R + 128) * (64 + 64))
    assert p.device_scratch_bytes == largest(4) == 33792
    assert p.total_scratch_bytes == largest(8) == 34816
    assert p.host_scratch_bytes == p.total_scratch_bytes - p.device_scratch_bytes == 1024
    assert p.activation_buffer_bytes == p.slot_bytes + p.device_scratch_bytes
    low = dm.plan_memory(c.replace(device_scratch_capacity_factor=0.5,
                                   host_scratch_capacity_factor=None), ep_size=2)
    assert low.device_scratch_rows == 2 and any("overflow" in n for n in low.notes)


def test_inference_plan():
    c = cfg(num_local_input_tokens=4, hidden_dim=64, intermediate_dim=128, top_k=2, num_experts=4,
            inference=True, num_activation_slots=0)
    p = dm.plan_memory(c, ep_size=2)
    assert p.slot_bytes == p.slot_min_bytes == 0
    # forward scratch only: x_g and h2 (no h1), each with a tail of 128 rows
    assert p.device_scratch_bytes == 2 * (16 + 128) * (64 + 128)
    assert p.dispatch_bytes == 4 * 64 * 2                         # x once, no route gradients
    assert p.activation_buffer_bytes == p.device_scratch_bytes
    assert "inference" in p.explain()


def test_explain_mentions_every_allocation():
    c = dm.load_config(__import__("pathlib").Path(__file__).resolve().parents[2]
                       / "configs" / "deepseek_v3.yaml")
    text = dm.plan_memory(c, ep_size=64).explain()
    for key in ("T=4096", "E_local=4", "balanced R", "saved input", "full state",
                "forward scratch", "backward peak", "minimum", "maximum useful", "chosen",
                "device scratch", "host overflow scratch", "dispatch", "combine", "total device"):
        assert key in text, key


def test_plan_rejects_bad_arguments():
    c = cfg(num_local_input_tokens=4, hidden_dim=64, intermediate_dim=64, top_k=2, num_experts=4)
    with pytest.raises(dm.ConfigError, match="Config.num_experts"):
        dm.plan_memory(c, ep_size=3)
    with pytest.raises(TypeError):
        dm.plan_memory({"hidden_dim": 64}, ep_size=1)


def test_weight_cache_entry_bytes():
    """MemoryPlan.weight_cache_bytes_per_layer (routed_experts(is_first_microbatch=...)): E4M3
    W13 and W2 plus fp32 128 x 128 scales, both orientations in training, one in inference;
    mxfp8 the bf16 copies; nothing for bf16. At the guide's experts (E_local=6)."""
    import megatron_dist_moe as dm
    base = dict(num_local_input_tokens=2048, hidden_dim=7168, intermediate_dim=3072, top_k=6,
                num_experts=6)
    elems = 6 * (2 * 3072 * 7168 + 7168 * 3072)
    scales = 6 * ((2 * 3072 // 128) * (7168 // 128) + (7168 // 128) * (3072 // 128)) * 4
    fp8 = dm.plan_memory(dm.Config(**base, precision="fp8_block"), ep_size=1)
    assert fp8.weight_cache_bytes_per_layer == 2 * (elems + scales)
    assert "weight cache entry" in fp8.explain()
    inf = dm.plan_memory(dm.Config(**base, precision="fp8_block", inference=True,
                                   num_activation_slots=0), ep_size=1)
    assert inf.weight_cache_bytes_per_layer == elems + scales
    mx = dm.plan_memory(dm.Config(**base, precision="mxfp8"), ep_size=1)
    assert mx.weight_cache_bytes_per_layer == 2 * elems
    bf = dm.plan_memory(dm.Config(**base), ep_size=1)
    assert bf.weight_cache_bytes_per_layer == 0 and "weight cache" not in bf.explain()


def test_nvfp4_decoded_weight_scratch_bytes():
    """MemoryPlan.weight_scratch_bytes: nvfp4 inference from 768 rows per local expert decodes
    the weights per call into fp16, as many experts at a time as fit 256 MiB: at the guide's
    experts 3 of W13's 6144 x 7168 (W2's 7168 x 3072 fit 6, the same bytes); none below the
    threshold or in another precision."""
    base = dict(hidden_dim=7168, intermediate_dim=3072, top_k=6, num_experts=6,
                precision="nvfp4", inference=True, num_activation_slots=0)
    big = dm.plan_memory(dm.Config(num_local_input_tokens=2048, **base), ep_size=1)
    assert big.total_scratch_rows // 6 >= 768
    assert big.weight_scratch_bytes == max(2 * 3 * 6144 * 7168, 2 * 6 * 7168 * 3072)
    assert "decoded-weight scratch" in big.explain()
    at = dm.plan_memory(dm.Config(num_local_input_tokens=768, **base), ep_size=1)
    assert at.total_scratch_rows == 768 * 6 and at.weight_scratch_bytes > 0
    small = dm.plan_memory(dm.Config(num_local_input_tokens=767, **base), ep_size=1)
    assert small.weight_scratch_bytes == 0 and "decoded-weight" not in small.explain()
    bf = dm.plan_memory(dm.Config(num_local_input_tokens=2048, **{**base, "precision": "bf16"}),
                        ep_size=1)
    assert bf.weight_scratch_bytes == 0


def test_plans_past_int64_offsets_or_device_memory_are_refused():
    from megatron_dist_moe.memory_plan import MAX_PLAN_BYTES, check_plan_fits
    base = dict(num_local_input_tokens=4, hidden_dim=64, intermediate_dim=128, top_k=2,
                num_experts=4)
    with pytest.raises(dm.ConfigError, match="Config.activation_slot_bytes.*int64") as info:
        dm.plan_memory(cfg(**base, activation_slot_bytes=MAX_PLAN_BYTES), ep_size=2)
    assert info.value.field == "activation_slot_bytes"
    with pytest.raises(dm.ConfigError, match="Config.activation_slot_capacity_factor.*int64"):
        dm.plan_memory(cfg(**base, activation_slot_capacity_factor=1e30), ep_size=2)
    # the scratch is capped at the rows the topology can send, whatever its factor
    dm.plan_memory(cfg(**base, device_scratch_capacity_factor=1e30), ep_size=2)
    plan = dm.plan_memory(cfg(**base, activation_slot_bytes=2 ** 40), ep_size=2)
    check_plan_fits(plan, [None, 2 ** 41])            # a CPU rank, and a device that holds it
    with pytest.raises(dm.ConfigError, match=r"Config.activation_slot_bytes: the plan needs "
                       r"1,024.00 GiB on each device \(activation slots 1 x 1,024.00 GiB, scratch "
                       r".*\); rank 1's device has 80.00 GiB in all"):
        check_plan_fits(plan, [2 ** 41, 80 * 2 ** 30])
