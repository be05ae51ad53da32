//! Checks of ranges and requests before anything starts.

use super::*;

impl PosixBackend {
    /// Check range `index` of a request against its FILE region: the region exists,
    /// covers the range, and — for O_DIRECT files — the memory address, length and file
    /// offset are aligned. The error names the descriptor, the file and the alignment.
    pub fn check_range(&self, index: usize, range: &Range) -> Result<()> {
        let subject = || descriptor(index, range.remote_addr, range.len, range.remote_dev);
        let Some(slot) = self.files.slot(range.remote_token) else {
            return Err(Error::not_found(subject()));
        };
        let Some(file) = self.files.get(slot) else {
            return Err(Error::not_found(subject()));
        };
        if !file.covers(range.remote_addr, range.len) {
            return Err(Error::invalid(
                subject(),
                format!(
                    "outside the registered region of {} (offset {}, len {})",
                    file.describe(),
                    file.start,
                    if file.len_bytes == 0 {
                        "unbounded".to_string()
                    } else {
                        file.len_bytes.to_string()
                    }
                ),
            ));
        }
        if range.local_addr.checked_add(range.len).is_none() {
            return Err(Error::invalid(
                descriptor(index, range.local_addr, range.len, range.local_dev),
                "memory range wraps the address space",
            ));
        }
        {
            let buf = if range.local_token & PLAIN_DRAM != 0 {
                self.plain
                    .slot(range.local_token & !PLAIN_DRAM)
                    .and_then(|s| self.plain.get(s))
            } else {
                self.buffers
                    .slot(range.local_token)
                    .and_then(|s| self.buffers.get(s))
            };
            match buf {
                None => {
                    return Err(Error::not_found(descriptor(
                        index,
                        range.local_addr,
                        range.len,
                        range.local_dev,
                    )))
                }
                Some(b) if !b.covers(range.local_addr, range.len) => {
                    return Err(Error::invalid(
                        descriptor(index, range.local_addr, range.len, range.local_dev),
                        "outside its registered DRAM region",
                    ))
                }
                Some(_) => {}
            }
        }
        self.check_alignment(index, range)
    }

    /// For O_DIRECT files: whether range `index` has an aligned memory address, length
    /// and file offset. Always `Ok` for buffered files and unknown tokens.
    pub fn check_alignment(&self, index: usize, range: &Range) -> Result<()> {
        let Some(file) = self
            .files
            .slot(range.remote_token)
            .and_then(|s| self.files.get(s))
        else {
            return Ok(());
        };
        let Some(align) = file.direct else {
            return Ok(());
        };
        let what = if !range.local_addr.is_multiple_of(align.mem_bytes) {
            Some(("memory address", range.local_addr, range.local_dev))
        } else if !range.len.is_multiple_of(align.offset_bytes) {
            Some(("length", range.len, range.remote_dev))
        } else if !range.remote_addr.is_multiple_of(align.offset_bytes) {
            Some(("file offset", range.remote_addr, range.remote_dev))
        } else {
            None
        };
        match what {
            None => Ok(()),
            Some((name, value, dev)) => {
                let addr = if name == "memory address" {
                    range.local_addr
                } else {
                    range.remote_addr
                };
                Err(Error::invalid(
                    descriptor(index, addr, range.len, dev),
                    format!(
                        "O_DIRECT on {} needs {}-byte alignment of address and {}-byte alignment \
                         of length and offset; {name} {value:#x} is not aligned",
                        file.describe(),
                        align.mem_bytes,
                        align.offset_bytes,
                    ),
                ))
            }
        }
    }

    /// Validate a whole request as `post` would, without starting it (the hook for the
    /// executor's prep phase).
    pub fn check_post(&self, endpoint: Endpoint, post: &Post<'_>) -> Result<()> {
        if let Endpoint::Peer(_) = endpoint {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: "transfers to other agents (POSIX is local only)".into(),
            });
        }
        if post.local_kind != MemKind::Dram || post.remote_kind != MemKind::File {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!(
                    "{} ↔ {} transfers (only DRAM ↔ FILE)",
                    post.local_kind, post.remote_kind
                )
                .into(),
            });
        }
        for (i, range) in post.ranges.iter().enumerate() {
            self.check_range(i, range)?;
        }
        Ok(())
    }
}
