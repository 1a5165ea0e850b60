"""benchmarks/ab_layer.py's host-side logic: setting parsing, the A/B round order and the paired
verdict (the GPU timing itself runs on the GPU machine)."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))
pytest.importorskip("triton")
import ab_layer as ab  # noqa: E402


def test_round_order_balances_who_goes_first():
    order = ab.round_order(4)
    assert order == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert order.count("A") == order.count("B") == 4


def test_paired_summary_verdicts():
    a = [9.30, 9.10, 9.25, 9.40, 9.20, 9.15]           # drifting by ±0.15 ms
    faster = ab.paired_summary(a, [t - 0.10 for t in a])
    assert faster["verdict"] == "B faster" and faster["diff_ms"] == pytest.approx(-0.10)
    slower = ab.paired_summary(a, [t + 0.05 for t in a])
    assert slower["verdict"] == "B slower"
    mixed = ab.paired_summary(a, [t + d for t, d in zip(a, (0.1, -0.1, 0.1, -0.1, 0.05, -0.05))])
    assert mixed["verdict"] == "no difference"
    with pytest.raises(ValueError, match=">= 4 paired rounds"):
        ab.paired_summary([1.0, 2.0], [1.0, 2.0])


def test_parse_config_overrides():
    assert ab.parse_config("save_route_outputs=0, pipeline=staged") == {
        "save_route_outputs": False, "pipeline": "staged"}
    assert ab.parse_config("device_scratch_capacity_factor=2.5 top_k=4") == {
        "device_scratch_capacity_factor": 2.5, "top_k": 4}
    with pytest.raises(ValueError, match="Config field"):
        ab.parse_config("not_a_field=1")
    with pytest.raises(ValueError, match="takes 0/1"):
        ab.parse_config("save_route_outputs=maybe")
