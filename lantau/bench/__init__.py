"""Benchmarks: standard workloads, the offline runner, peers and ceilings."""
