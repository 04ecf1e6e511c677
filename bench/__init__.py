"""Micro-benchmarks of execd's hot paths (run each as ``python -m bench.<name>``)."""
