"""The one cost model: hardware profiles (profiles.py) and what one expert use costs on them (model.py).

Used by the engine's per-miss choice (experts.manager via the step planner), `expertcache trace
simulate` (trace.simulate) and `expertcache plan` (plan.speed). A leaf package: it imports nothing
else of the project.
"""
