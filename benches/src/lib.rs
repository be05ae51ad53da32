//! Ferry benchmarks: criterion benches live in `benches/`; rerunnable scenario
//! benchmarks that a command-line tool can also drive live here as modules.
// Reason: benchmarks register their own buffers, the caller-side promise that
// `Agent::register` (an `unsafe fn`) asks for; no other unsafe code lives here.
#![allow(unsafe_code)]

pub mod shm;
pub mod ucx;
pub mod ucx_md;
