"""Deterministic workloads of the application benchmarks (text built offline from bundled sources)."""
