"""Benchmarks: measured figures printed against their limits, side by side in one run."""
