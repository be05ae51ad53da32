//! Ferry's criterion benchmarks live in `benches/`; this library is empty.
