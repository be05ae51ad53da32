//! Feed arbitrary bytes to everything that parses peer bytes: `PeerMd::from_bytes`
//! (then every accessor of a blob that validates) and `decode_descs`. Any panic is a
//! bug; so is a validated blob whose own regions are not found where they are.
#![no_main]

use ferry_metadata::{decode_descs, PeerMd, DESCS_MAGIC, HEADER_LEN_BYTES, MAGIC, VERSION};
use libfuzzer_sys::fuzz_target;

fn check_peer_md(bytes: &[u8]) {
    let Ok(md) = PeerMd::from_bytes(bytes) else {
        return;
    };
    assert_eq!(md.as_bytes(), bytes);
    let _ = (md.agent(), md.generation(), md.is_partial());
    for b in 0..md.backend_count() {
        let (name, _) = md.backend(b as u8).expect("backend in range");
        assert_eq!(md.backend_index(name), Some(b as u8));
    }
    let mut count = 0usize;
    for (i, view) in md.regions().enumerate() {
        count += 1;
        assert_eq!(md.region(i as u32), Some(view));
        assert_eq!(md.find(view.backend, view.kind, view.desc), Some(i as u32));
        assert_eq!(md.exact(view.backend, view.kind, view.desc), Some(i as u32));
    }
    assert_eq!(count, md.region_count());
}

fuzz_target!(|data: &[u8]| {
    check_peer_md(data);
    if let Ok((_, descs)) = decode_descs(data) {
        assert!(descs.iter().all(|d| d.end().is_some()));
    }
    // Also try the payload behind valid headers, so the fuzzer need not find them.
    for magic in [MAGIC, DESCS_MAGIC] {
        let mut framed = Vec::with_capacity(HEADER_LEN_BYTES + data.len());
        framed.extend_from_slice(&magic);
        framed.extend_from_slice(&VERSION.to_le_bytes());
        framed.extend_from_slice(&[0, 0]);
        framed.extend_from_slice(data);
        check_peer_md(&framed);
        let _ = decode_descs(&framed);
    }
});
