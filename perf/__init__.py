"""Benchmarks: ``python -m perf.<name>``; numbers are taken on the GPU only."""
