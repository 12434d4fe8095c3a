"""Memory accounting, precision stats, metrics sinks and the benchmarks."""
