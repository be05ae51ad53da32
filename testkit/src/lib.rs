//! What Ferry's tests and benches share, written once: a deterministic random number
//! generator ([`Rng`]), a counting global allocator ([`alloc`]), per-thread CPU time
//! from `/proc` in real clock ticks ([`cpu`]), the "are we in CI" probe and the
//! skip-or-fail rule for tests that need a component ([`ci`]), a moto S3 server for the
//! OBJ tests ([`moto`]), and mutation of valid encodings for parser property tests
//! ([`mutate`]).
//!
//! Dev-only: crates list it under `[dev-dependencies]` (the `ferry-tests` and
//! `ferry-benches` crates, which exist only for tests and benches, use it as a normal
//! dependency). Nothing shipped depends on it.
// Reason: a `GlobalAlloc` implementation is an `unsafe impl` whose methods forward
// raw pointers to the system allocator, and reading the clock-tick rate is a libc call.
// Each unsafe block states why it is sound; nothing else here is unsafe.
#![allow(unsafe_code)]

pub mod alloc;
pub mod backend;
pub mod ci;
pub mod cpu;
pub mod moto;
pub mod mutate;
mod rng;

pub use rng::Rng;
