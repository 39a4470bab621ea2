"""Quantized expert weights: numeric formats and per-format quant methods.

`method` holds the registry (QUANT_METHODS, make_quant_method) and the stored
layout legend; the other modules are the vectorised format codecs.
"""

from .method import QUANT_METHODS, QuantMethod, TensorSpec, make_quant_method

__all__ = ["QUANT_METHODS", "QuantMethod", "TensorSpec", "make_quant_method"]
