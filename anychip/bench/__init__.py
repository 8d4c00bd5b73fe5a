"""Benchmarks: they measure and never change what they measure (kernels, latency, serve)."""
