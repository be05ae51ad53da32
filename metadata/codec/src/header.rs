//! The 8-byte header in front of every Ferry blob: a 4-byte magic, the format version
//! (`u16`, little-endian) and flags (`u16`, little-endian). The rkyv archive follows.

use ferry_storage::Error;

/// Magic of an agent-metadata blob.
pub const MAGIC: [u8; 4] = *b"FRMD";
/// Magic of an encoded descriptor list.
pub const DESCS_MAGIC: [u8; 4] = *b"FRDL";
/// Version of both wire formats written by this crate (and the only one it reads).
pub const VERSION: u16 = 2;
/// Header flag: the metadata is partial (selected regions, maybe no connection info).
pub const FLAG_PARTIAL: u16 = 1 << 0;
/// Size of the header in bytes.
pub const HEADER_LEN_BYTES: usize = 8;

/// Which format a blob's header must announce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    /// Agent metadata (`MAGIC`), flags within `FLAG_PARTIAL`.
    Metadata,
    /// A descriptor list (`DESCS_MAGIC`), no flags.
    Descs,
}

impl Format {
    fn magic(self) -> [u8; 4] {
        match self {
            Format::Metadata => MAGIC,
            Format::Descs => DESCS_MAGIC,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Format::Metadata => "agent metadata",
            Format::Descs => "a descriptor list",
        }
    }

    fn known_flags(self) -> u16 {
        match self {
            Format::Metadata => FLAG_PARTIAL,
            Format::Descs => 0,
        }
    }
}

/// The header for `format` with `flags`.
pub(crate) fn encode(format: Format, flags: u16) -> [u8; HEADER_LEN_BYTES] {
    let mut header = [0u8; HEADER_LEN_BYTES];
    header[..4].copy_from_slice(&format.magic());
    header[4..6].copy_from_slice(&VERSION.to_le_bytes());
    header[6..8].copy_from_slice(&flags.to_le_bytes());
    header
}

/// Check the header of `bytes` against `format`; returns its flags.
pub(crate) fn check(format: Format, bytes: &[u8]) -> Result<u16, Error> {
    let Some(header) = bytes.first_chunk::<HEADER_LEN_BYTES>() else {
        return Err(invalid(format!(
            "blob is {} bytes, shorter than the {HEADER_LEN_BYTES}-byte header",
            bytes.len()
        )));
    };
    let magic = [header[0], header[1], header[2], header[3]];
    if magic != format.magic() {
        let other = [Format::Metadata, Format::Descs]
            .into_iter()
            .find(|f| f.magic() == magic)
            .map(|f| format!(" (that is the magic of {})", f.name()))
            .unwrap_or_default();
        return Err(invalid(format!(
            "bad magic {magic:02x?}{other}, expected {:02x?} for {}",
            format.magic(),
            format.name()
        )));
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != VERSION {
        return Err(invalid(format!(
            "unsupported {} version {version} (this build reads version {VERSION})",
            format.name()
        )));
    }
    let flags = u16::from_le_bytes([header[6], header[7]]);
    let unknown = flags & !format.known_flags();
    if unknown != 0 {
        return Err(invalid(format!(
            "unknown header flags {unknown:#06x} in {} (flags {flags:#06x})",
            format.name()
        )));
    }
    Ok(flags)
}

/// An [`Error::InvalidMetadata`] with `reason`.
pub(crate) fn invalid(reason: impl Into<std::borrow::Cow<'static, str>>) -> Error {
    Error::InvalidMetadata {
        reason: reason.into(),
    }
}
