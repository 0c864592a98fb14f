"""The planner behind ``DIST.STRATEGY auto`` and ``tools/plan.py``."""
