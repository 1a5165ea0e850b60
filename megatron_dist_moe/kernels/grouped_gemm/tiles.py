"""The device tile list of a persistent grouped GEMM, from device expert offsets.

Rows are sorted expert-major: rows of local expert e are [starts[e], ends[e]) (int32 device
offsets; with no padding ends[e] = starts[e+1]). Expert e owns cdiv(len_e, BLOCK_M) x num_n
tiles; the tile list is the concatenation over experts, each expert's tiles in group-M order.
The host never reads a row count: a persistent program walks tiles pid, pid + nprog, ... of a
list whose length only the device knows.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["swizzle", "tile_coords", "tile_bound", "expert_segments", "tile_list"]


def tile_bound(max_rows: int, block_m: int, num_experts: int, num_n: int) -> int:
    """Host bound on the tiles of a launch: sum_e cdiv(len_e, BM) <= cdiv(R, BM) + E - 1."""
    return (triton.cdiv(max_rows, block_m) + num_experts) * num_n


@triton.jit
def expert_segments(offsets_ptr, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(e_idx, starts, ends, m_tiles), [E_PAD] vectors: each expert's rows [starts, ends) and
    its m-tile count, from the device offsets (zeros past E)."""
    e_idx = tl.arange(0, E_PAD)
    starts = tl.load(offsets_ptr + e_idx, mask=e_idx < E, other=0)
    ends = tl.load(offsets_ptr + e_idx + 1, mask=e_idx < E, other=0)
    return e_idx, starts, ends, (ends - starts + BLOCK_M - 1) // BLOCK_M


@triton.jit
def tile_list(m_tiles, num_n):
    """(tiles, cum, total) of the list whose expert e owns m_tiles[e] x num_n tiles: expert e
    owns tiles [cum[e] - tiles[e], cum[e]) (`tile_coords`)."""
    tiles = m_tiles * num_n
    return tiles, tl.cumsum(tiles, 0), tl.sum(tiles, 0)


@triton.jit
def swizzle(local, num_m, num_n, GROUP_M: tl.constexpr):
    """Group-M order inside one expert: GROUP_M m-tiles share each weight n-tile in L2."""
    width = GROUP_M * num_n
    group = local // width
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (local % width) % group_size
    pid_n = (local % width) // group_size
    return pid_m, pid_n


@triton.jit
def tile_coords(t, e_idx, cum, tiles, starts, ends, m_tiles, num_n, GROUP_M: tl.constexpr):
    """(expert, its first row, its row end, first m-tile index of the expert, pid_m, pid_n) of
    tile t of the device tile list (expert e owns tiles [cum[e] - tiles[e], cum[e]))."""
    e = tl.sum((cum <= t).to(tl.int32), 0)
    sel = e_idx == e
    local = t - tl.sum(tl.where(sel, cum - tiles, 0), 0)
    row_start = tl.sum(tl.where(sel, starts, 0), 0)
    row_end = tl.sum(tl.where(sel, ends, 0), 0)
    num_m = tl.sum(tl.where(sel, m_tiles, 0), 0)
    m_first = tl.sum(tl.where(sel, tl.cumsum(m_tiles, 0) - m_tiles, 0), 0)
    pid_m, pid_n = swizzle(local, num_m, num_n, GROUP_M)
    return e, row_start, row_end, m_first, pid_m, pid_n
