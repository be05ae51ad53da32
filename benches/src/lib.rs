//! Ferry criterion benchmarks.
