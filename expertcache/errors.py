"""Error types users see. Each message names the file, tensor, field or parameter at fault."""


class ExpertCacheError(Exception):
    """Base class of the project's own errors."""


class CheckpointError(ExpertCacheError, ValueError):
    """A model directory is missing a file or tensor, or a file is damaged."""


class ConfigError(ExpertCacheError, ValueError):
    """config.json (or an engine option) holds a value the engine does not implement."""


class BudgetError(ExpertCacheError, ValueError):
    """A memory budget cannot hold what the model needs (e.g. top_k experts per layer)."""
