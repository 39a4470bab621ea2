"""Leaf package of the types every layer shares: the normalised model config (model_config.py) and
a family's tensor names (weights.py). It imports nothing of the project but errors; models/, layers/,
experts/ and engine/ import it, so none of them needs another's package for a type."""
