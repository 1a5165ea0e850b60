"""Shared pytest set-up for tests/cpu (CI) and tests/gpu (the GPU machine).

- Tests marked `gpu` are skipped unless a CUDA GPU of compute capability 9.0 or newer is present.
- Each test process uses at most 2 intra-op threads: CI has 2 cores and the multi-rank tests
  spawn their own 1-thread ranks next to it.
- Helpers for tests live in megatron_dist_moe.testing (oracle, routing generators, spawn).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _capable_gpu() -> bool:
    try:
        import torch
    except ImportError:   # pragma: no cover - torch is a hard dependency
        return False
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (9, 0)


def pytest_configure(config):
    import torch

    torch.set_num_threads(min(torch.get_num_threads(), 2))


def pytest_collection_modifyitems(config, items):
    if _capable_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with compute capability >= 9.0")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def configs_dir() -> Path:
    return ROOT / "configs"
