"""`expertcache plan`: will a model run under these budgets, and how fast, from headers alone.

cli.py (the subcommand), model.py (sizes and the engine's memory plan), speed.py (predicted
decode tok/s band, priced by cost/), picture.py (the --png bars).
"""

from .cli import add_plan_subcommand

__all__ = ["add_plan_subcommand"]
