"""Quantized formats of the expert operands and their torch twins (one module per precision).

    fp8_block   E4M3 with fp32 scales per 1 x 128 (activations, gradients) and 128 x 128
                (weights) blocks: DeepSeek-V3's recipe, TransformerEngine's Float8BlockScaling
"""

from . import fp8_block

__all__ = ["fp8_block"]
