"""Experiments: training, optimizer comparison, memory planner, benchmarks, data."""
