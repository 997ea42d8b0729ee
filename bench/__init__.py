"""Cachet's benchmarks (`make bench`): ratios against baselines run in the same process."""
