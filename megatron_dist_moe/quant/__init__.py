"""Quantized formats of the expert operands and their torch twins (one module per precision).

    fp8_block   E4M3 with fp32 scales per 1 x 128 (activations, gradients) and 128 x 128
                (weights) blocks: DeepSeek-V3's recipe, TransformerEngine's Float8BlockScaling
    mxfp8       E4M3 with E8M0 scales per 32 values (weights: per 32 x 32 tile): OCP MX as
                TransformerEngine's MXFP8BlockScaling computes it

`format_of(config)` gives a precision's format object (rows / cols / weight quantizers and
their dequantizers), shared by the reference backend and testing's emulation.
"""

from . import fp8_block, mxfp8, nvfp4

__all__ = ["fp8_block", "mxfp8", "nvfp4", "format_of", "QUANTIZED"]

QUANTIZED = ("fp8_block", "mxfp8")


def format_of(config):
    """The format of config.precision (a quantized one)."""
    if config.precision == "fp8_block":
        return fp8_block.Fp8BlockFormat(fp8_block.BlockScaling.of(config))
    if config.precision == "mxfp8":
        return mxfp8.Mxfp8Format()
    raise ValueError(f"precision {config.precision!r} is not a quantized format; "
                     f"expected one of {QUANTIZED}")
