"""Benchmark helpers: workloads built from real text, and the statistics they report."""
