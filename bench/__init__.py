"""Reproducible benchmarks: RULER-style retrieval, fidelity to FullKV, attention-drift diagnostics, speed."""
