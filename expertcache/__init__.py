"""expertcache: run Mixture-of-Experts models whose experts do not fit in fast memory."""

from .engine.params import RequestOutput, SamplingParams
from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
