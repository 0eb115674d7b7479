"""The parts of scripts/benchmark.py and scripts/gpu_check.py: the synthetic data, the probes
that time and count a training run, the workers (one measurement each, in a fresh process), the
processes that run them, and the report."""
