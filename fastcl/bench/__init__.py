"""Benchmark support shared by ``benchmarks/`` and the memory tests: cases and meters."""
