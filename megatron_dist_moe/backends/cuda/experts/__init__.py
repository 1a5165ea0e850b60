"""The expert MLP on received rows: gather -> W13 -> SwiGLU -> W2 -> scatter, and its backward.

x_g and h1 are written to (forward) and read from (backward) device-chosen addresses: the
activation slot when the planner keeps full state, the shared scratch otherwise. Every other
intermediate lives in the scratch region at the addresses of the one per-call layout
(layout.py; the bookkeeping computes them on the device).

Two layers, one module per precision (bf16.py, fp8_block.py, mxfp8.py, nvfp4.py; common.py
holds what they share):
    Bf16Kernels     the kernels of one precision, one method per step, at device addresses
                    (a precision adds such a class, not branches)
    a pipeline      the order of the steps (Execution.pipeline and gemm_engine):
        StandardPipeline  gather kernel, W13 (+SwiGLU), W2 (+scatter to the owners); backward:
                          gather, W2 DGRAD (+SwiGLU backward, + score-gradient parts), W2
                          WGRAD, W13 DGRAD (+scatter to the owners), W13 WGRAD
        StagedPipeline    the same, but W13 and the W2 DGRAD gather their own A rows (claim
                          mode: the programs that reach an m-tile copy it once, in slices)
        TorchPipeline     torch._grouped_mm with separate gather / SwiGLU / scatter kernels:
                          the GEMM oracle and a baseline
        MegaPipeline      the forward's W13 + SwiGLU and W2 + scatter in one persistent launch
                          after the gather (kernels/grouped_gemm/mega.py); backward as standard
        Fp8BlockPipeline  fp8_block: quantization kernels and the FP8 block-scaled GEMMs
        Mxfp8Pipeline     mxfp8: quantization kernels around StandardPipeline's bf16 GEMMs,
                          which read bf16 copies of the MXFP8 operands (exact)
        Nvfp4Pipeline     nvfp4 inference on prepared weights: the source rank publishes NVFP4
                          rows, NVFP4 GEMMs decode both operands to bf16 in registers
Device predicates (replay or not) zero the expert offsets and row counts, so the launch sequence
is the same either way.
"""

from __future__ import annotations

import torch

from ....config import Config
from ....execution import Execution
from .bf16 import Bf16Kernels, MegaPipeline, StagedPipeline, StandardPipeline, TorchPipeline
from .common import wgrad_output, wgrad_store_dtype
from .fp8_block import Fp8BlockKernels, Fp8BlockPipeline
from .mxfp8 import Mxfp8Kernels, Mxfp8Pipeline
from .nvfp4 import Nvfp4Pipeline

__all__ = ["Bf16Kernels", "Fp8BlockKernels", "Mxfp8Kernels", "StandardPipeline",
           "StagedPipeline", "MegaPipeline", "TorchPipeline", "Fp8BlockPipeline", "Mxfp8Pipeline",
           "Nvfp4Pipeline", "make_expert_pipeline", "wgrad_output", "wgrad_store_dtype"]


def make_expert_pipeline(cfg: Config, execution: Execution, num_local_experts: int,
                         max_rows: int, device: torch.device, rank: int):
    if execution.precision == "fp8_block":
        cls = Fp8BlockPipeline
    elif execution.precision == "mxfp8":
        cls = Mxfp8Pipeline
    elif execution.precision == "nvfp4":
        cls = Nvfp4Pipeline
    elif execution.gemm_engine == "torch":
        cls = TorchPipeline
    elif execution.pipeline == "mega":
        cls = MegaPipeline
    else:
        cls = StagedPipeline if execution.pipeline == "staged" else StandardPipeline
    return cls(cfg, execution, num_local_experts, max_rows, device, rank)
