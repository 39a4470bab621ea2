"""The one cost model: hardware profiles (profiles.py) and what one expert use costs on them (model.py).

Used by the engine's per-miss choice (experts.manager via the step planner), `expertcache trace
simulate` (trace.simulate) and `expertcache plan` (plan.speed). It imports only loader/ (the `this-cpu`
measurement reads with the engine's DiskReader).
"""
