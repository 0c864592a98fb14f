"""The benchmark's baselines and measurements (tools/benchmark.py)."""
