//! Descriptor lists sent to a peer: a memory kind plus address, length and device
//! columns.

use ferry_storage::{Desc, Error, MemKind, Subject};
use rkyv::rancor::Error as RkyvError;
use rkyv::util::AlignedVec;

use crate::header::{self, invalid, Format, HEADER_LEN_BYTES};
use crate::wire::{ArchivedWireDescs, WireDescs};

/// Encode a descriptor list of memory kind `kind` (24 bytes per descriptor plus a
/// few dozen bytes of header and archive).
///
/// Fails with [`Error::InvalidParam`] only when the list is too large for the archive
/// format (its columns must fit 32-bit relative offsets, about 89 million descriptors).
pub fn encode_descs(kind: MemKind, descs: &[Desc]) -> Result<Vec<u8>, Error> {
    let wire = WireDescs {
        kind: kind as u8,
        addrs: descs.iter().map(|d| d.addr).collect(),
        lens: descs.iter().map(|d| d.len).collect(),
        devs: descs.iter().map(|d| d.dev).collect(),
    };
    let mut out = Vec::with_capacity(HEADER_LEN_BYTES + 64 + descs.len() * 24);
    out.extend_from_slice(&header::encode(Format::Descs, 0));
    rkyv::api::high::to_bytes_in::<_, RkyvError>(&wire, out).map_err(|e| {
        Error::invalid(
            Subject::Named("descriptor list".into()),
            format!("{} descriptors do not fit the wire format: {e}", descs.len()),
        )
    })
}

/// Decode and validate a descriptor list from [`encode_descs`].
///
/// Refuses (with [`Error::InvalidMetadata`]) a bad header, a malformed archive, an
/// unknown memory kind, columns of different lengths and descriptors that wrap the
/// address space.
pub fn decode_descs(bytes: &[u8]) -> Result<(MemKind, Vec<Desc>), Error> {
    header::check(Format::Descs, bytes)?;
    let payload = &bytes[HEADER_LEN_BYTES..];
    // The archive needs 8-byte alignment; copy only when the caller's bytes lack it.
    if (payload.as_ptr() as usize) % 8 == 0 {
        decode_payload(payload)
    } else {
        let mut aligned = AlignedVec::<16>::with_capacity(payload.len());
        aligned.extend_from_slice(payload);
        decode_payload(&aligned)
    }
}

fn decode_payload(payload: &[u8]) -> Result<(MemKind, Vec<Desc>), Error> {
    let wire = rkyv::access::<ArchivedWireDescs, RkyvError>(payload)
        .map_err(|e| invalid(format!("descriptor list structure check failed: {e}")))?;
    let kind = MemKind::from_u8(wire.kind).ok_or_else(|| {
        invalid(format!(
            "descriptor list has unknown memory kind byte {}",
            wire.kind
        ))
    })?;
    let count = wire.addrs.len();
    if wire.lens.len() != count || wire.devs.len() != count {
        return Err(invalid(format!(
            "descriptor list column lengths differ (addrs {count}, lens {}, devs {})",
            wire.lens.len(),
            wire.devs.len()
        )));
    }
    let descs: Vec<Desc> = wire
        .addrs
        .iter()
        .zip(wire.lens.iter())
        .zip(wire.devs.iter())
        .map(|((addr, len), dev)| Desc::new(addr.to_native(), len.to_native(), dev.to_native()))
        .collect();
    if let Some(i) = descs.iter().position(|d| d.end().is_none()) {
        let d = descs[i];
        return Err(invalid(format!(
            "descriptor #{i} (addr {:#x}, len {}, dev {}) wraps the address space",
            d.addr, d.len, d.dev
        )));
    }
    Ok((kind, descs))
}
