"""Weight compression: group-wise low-bit quantization (RTN, HQQ) and code packing."""

from lab.compress.quant import QTensor, fake_quantize, pack, quantize, unpack

__all__ = ["QTensor", "fake_quantize", "pack", "quantize", "unpack"]
