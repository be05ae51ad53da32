//! Feed arbitrary bytes to the P2P wire parsers of `ferry-exchange`: the hello decoder
//! and the frame reader (with and without a shared secret), and, in its structured
//! mode, frames written by the real writer with one byte flipped. The properties are
//! in `ferry_exchange::p2p::frame::fuzzing::exercise` (shared with the stable property
//! test `tests/tests/p2p_frames.rs`): any panic is a bug; so is a hello that does not
//! re-encode to its bytes, a written frame that does not read back, or a corrupted
//! authenticated frame that is accepted. Seeds: `seeds/p2p_frame/`.
#![no_main]

use ferry_exchange::p2p::frame::fuzzing::exercise;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    exercise(data);
});
