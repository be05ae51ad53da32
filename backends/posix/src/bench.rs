//! Benchmark.
