"""Persistent grouped GEMMs for routed experts (Triton, Hopper first).

Rows are sorted expert-major: rows of local expert e are [psum[e], psum[e+1]) where
`expert_offsets` (int32 [E+1], device) holds the cumulative row ends (psum[0] = 0, psum[E] = R).
R and every segment length are device values that the host never reads, so every launcher is
CUDA-graph capturable: the grid is a host bound (at most the SM count, fewer when a host
`max_rows` bound says there are fewer tiles), and each persistent program walks the tile list
that the device offsets define (tiles.py).

    grouped_mm_fwd    out[r, :] = a[r, :] @ w[e].T       w [E, N, Kd]  (FPROP, mm.py)
    grouped_mm_dgrad  out[r, :] = a[r, :] @ w[e]         w [E, Kd, N]  (DGRAD, mm.py)
    grouped_mm_wgrad  out[e]    = a_e.T @ b_e            a [R, M], b [R, N], out [E, M, N]
                                                                       (WGRAD, wgrad.py)

Modules: config.py (tile table and its choice), tiles.py (the device tile list), claim.py (the
staged pipeline's claimed row copies), mm.py (FPROP / DGRAD kernel, epilogues, launchers),
wgrad.py (WGRAD kernel, `ExpertOutTable`). Torch twins: `kernels/grouped_gemm_ref.py`.
"""

from ..common import device_ptr
from .claim import ClaimFlags
from .config import CONFIG_TABLE, INTERPRETER_CONFIG, GroupedGemmConfig, select_config
from .mm import ACTIVATIONS, EPILOGUES, grouped_mm_dgrad, grouped_mm_fwd, score_parts_count
from .wgrad import ExpertOutTable, grouped_mm_wgrad

__all__ = [
    "GroupedGemmConfig",
    "CONFIG_TABLE",
    "INTERPRETER_CONFIG",
    "select_config",
    "device_ptr",
    "grouped_mm_fwd",
    "grouped_mm_dgrad",
    "grouped_mm_wgrad",
    "score_parts_count",
    "ExpertOutTable",
    "ClaimFlags",
    "EPILOGUES",
    "ACTIVATIONS",
]
