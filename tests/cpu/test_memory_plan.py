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
    # forward scratch 2R(D+3F), backward peak 2R(D+5F) (D <= F) at R = 16
    assert p.layer.forward_scratch(16) == 2 * 16 * (64 + 3 * 128) == 14336
    assert p.layer.backward_peak(16) == 2 * 16 * (64 + 5 * 128) == 22528
    assert p.device_scratch_bytes == 22528                      # training: the larger of both
    assert p.host_scratch_bytes == 0
    # slots: minimum = inputs, balanced = full state (factor 1), max useful = full state at 16
    assert p.slot_min_bytes == 512
    assert p.slot_balanced_bytes == 6144
    assert p.slot_max_useful_bytes == 16 * 64 * 2 + 16 * 256 * 2 + 1024 == 11264
    assert p.slot_bytes == 6144
    assert p.scratch_offset == 6144 and p.slot_ends() == [0, 6144 + 22528]
    assert p.activation_buffer_bytes == 6144 + 22528
    # symmetric: 128 B header + int16 IDs [T,K]; dispatch [T,K,D] (training); combine [T,K,D]
    assert p.routing_bytes == 128 + align128(4 * 2 * 2) == 256
    assert p.dispatch_bytes == 4 * 2 * 64 * 2 == 1024
    assert p.combine_bytes == 1024
    assert p.total_device_bytes == 6144 + 22528 + 256 + 1024 + 1024


def test_bf16_backward_peak_when_D_exceeds_F():
    # D=128 > F=64: gathered grad_h3 needs an extra 2R(D-F) beyond 2R(D+5F)
    c = cfg(num_local_input_tokens=4, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=2)
    lb = dm.plan_memory(c, ep_size=1).layer
    R = 16
    assert lb.backward_peak(R) == 2 * R * (128 + 5 * 64) + 2 * R * (128 - 64) == 16384
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
    assert p.device_scratch_bytes == 2 * 4 * (64 + 5 * 64)
    assert p.total_scratch_bytes == 2 * 8 * (64 + 5 * 64)
    assert p.host_scratch_bytes == p.total_scratch_bytes - p.device_scratch_bytes == 3072
    assert p.activation_buffer_bytes == p.slot_bytes + p.device_scratch_bytes
    low = dm.plan_memory(c.replace(device_scratch_capacity_factor=0.5,
                                   host_scratch_capacity_factor=None), ep_size=2)
    assert low.device_scratch_rows == 2 and any("overflow" in n for n in low.notes)


def test_inference_plan():
    c = cfg(num_local_input_tokens=4, hidden_dim=64, intermediate_dim=128, top_k=2, num_experts=4,
            inference=True, num_activation_slots=0)
    p = dm.plan_memory(c, ep_size=2)
    assert p.slot_bytes == p.slot_min_bytes == 0
    assert p.device_scratch_bytes == 2 * 16 * (64 + 3 * 128)     # forward scratch only
    assert p.dispatch_bytes == 4 * 64 * 2                         # x once, no route gradients
    assert p.activation_buffer_bytes == p.device_scratch_bytes
    assert "inference" in p.explain()


def test_fp8_block_by_hand():
    # T=4 D=F=128 K=2 E=4 EP=2 -> E_local=2; each expert segment pads to 128 rows:
    # worst case padded rows Rp = R + E_local*(128-1) = R + 254
    c = cfg(num_local_input_tokens=4, hidden_dim=128, intermediate_dim=128, top_k=2,
            num_experts=4, precision="fp8_block")
    p = dm.plan_memory(c, ep_size=2)
    lb = p.layer
    assert lb.padded_rows(8) == 262 and lb.padded_rows(0) == 0
    # column bundle of width 128 at R=8: E4M3 qdata Rp*128 B + fp32 scale per 128 rows per column
    col_D = align128(262 * 128) + align128(3 * 128 * 4)           # 33536 + 1536
    assert lb.col_bundle(8, 128) == col_D == 35072
    # row bundle of width 128 at R=16: qdata Rp*128 + one fp32 per 1x128 block per row
    row_16 = align128(270 * 128) + align128(270 * 1 * 4)           # 34560 + 1152
    assert lb.row_bundle(16, 128) == row_16 == 35712
    # full state keeps x and h2 column bundles, dense bf16 h1 and the h3 routes
    h1 = 8 * 256 * 2
    routes = 4 * 2 * 128 * 2
    assert lb.full_state(8) == col_D + h1 + col_D + routes == 76288
    assert p.balanced_full_state_bytes == 76288
    # forward scratch at R=16: bf16 x_g, h1, h2 plus the x and h2 row bundles
    assert lb.forward_scratch(16) == 2 * 16 * (128 + 3 * 128) + 2 * row_16 == 87808
    # backward peak at R=16: bf16 peak 2R(D+5F) + grad_h3 row/col + grad_h1 row/col + x/h2 cols
    col_16 = align128(270 * 128) + align128(3 * 128 * 4)          # 34560 + 1536 = 36096
    row_16_2F = align128(270 * 256) + align128(270 * 2 * 4)        # 69120 + 2176
    col_16_2F = align128(270 * 256) + align128(3 * 256 * 4)        # 69120 + 3072
    peak = 2 * 16 * (128 + 5 * 128) + row_16 + col_16 + row_16_2F + col_16_2F + 2 * col_16
    assert lb.backward_peak(16) == peak == 312064
    assert p.device_scratch_bytes == 312064
    assert p.input_bytes == 4 * 128 * 2


def test_mxfp8_bundles_by_hand():
    c = cfg(num_local_input_tokens=4, hidden_dim=128, intermediate_dim=128, top_k=2,
            num_experts=4, precision="mxfp8")
    lb = dm.plan_memory(c, ep_size=2).layer
    # row: qdata + one E8M0 byte per 32 values; column: one E8M0 per 32 rows per column
    assert lb.row_bundle(8, 128) == align128(262 * 128) + align128(262 * 4) == 33536 + 1152
    assert lb.col_bundle(8, 128) == align128(262 * 128) + align128(9 * 128) == 33536 + 1152


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
