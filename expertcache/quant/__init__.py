"""Quantized expert weights: numeric formats and per-format quant methods.

`method` holds the registry (QUANT_METHODS, make_quant_method) and the stored
layout legend; `methods` registers the formats; the other modules are the
vectorised format codecs.
"""

from . import ggml as _ggml  # noqa: F401  (the GGUF block formats)
from . import methods as _methods  # noqa: F401  (fills QUANT_METHODS)
from .method import QUANT_METHODS, QuantMethod, TensorSpec, make_quant_method

__all__ = ["QUANT_METHODS", "QuantMethod", "TensorSpec", "make_quant_method"]
