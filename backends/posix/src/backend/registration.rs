//! FILE and DRAM regions: registration, deregistration, query.

use super::*;

/// The O_DIRECT alignment the kernel reports for `fd`, or the default.
pub(super) fn direct_alignment(fd: RawFd) -> DirectAlign {
    // SAFETY: statx is plain data; zeroed is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let empty = c"";
    // SAFETY: `empty` is a NUL-terminated string, `stx` is writable and outlives the
    // call; AT_EMPTY_PATH makes statx describe `fd` itself.
    let rc = unsafe {
        libc::statx(
            fd,
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    let reported = rc == 0
        && stx.stx_mask & libc::STATX_DIOALIGN != 0
        && stx.stx_dio_mem_align != 0
        && stx.stx_dio_offset_align != 0;
    if reported {
        DirectAlign {
            mem_bytes: u64::from(stx.stx_dio_mem_align),
            offset_bytes: u64::from(stx.stx_dio_offset_align),
        }
    } else {
        DirectAlign {
            mem_bytes: DIRECT_ALIGN_DEFAULT,
            offset_bytes: DIRECT_ALIGN_DEFAULT,
        }
    }
}

impl PosixBackend {
    pub(super) fn register_file(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        let desc = region.desc;
        let Some(slot) = self.files.vacant() else {
            return Err(Error::Capacity {
                what: "POSIX FILE regions (parameter max_files)",
                limit: self.files.capacity(),
            });
        };
        let mut entry = match region.path {
            Some((path, mode)) => {
                let fd = mode.open(path, NAME)?;
                FileEntry {
                    fd: fd.as_raw_fd(),
                    _owned: Some(fd),
                    path: Some(path.to_path_buf()),
                    start: desc.addr,
                    len_bytes: desc.len,
                    direct: None,
                    fixed: false,
                }
            }
            None => {
                let fd = RawFd::try_from(desc.dev).map_err(|_| {
                    Error::invalid(
                        descriptor(0, desc.addr, desc.len, desc.dev),
                        "device id is not a file descriptor",
                    )
                })?;
                FileEntry {
                    fd,
                    _owned: None,
                    path: None,
                    start: desc.addr,
                    len_bytes: desc.len,
                    direct: None,
                    fixed: false,
                }
            }
        };
        // SAFETY: F_GETFL only reads the descriptor's status flags.
        let flags = unsafe { libc::fcntl(entry.fd, libc::F_GETFL) };
        if flags < 0 {
            let e = io::Error::last_os_error();
            return Err(Error::Backend {
                backend: NAME.into(),
                errno: errno_of(&e),
                desc: Some(0),
                detail: format!("{} is not usable: {e}", entry.describe()).into(),
            });
        }
        if desc.addr.checked_add(desc.len).is_none() {
            return Err(Error::invalid(
                descriptor(0, desc.addr, desc.len, desc.dev),
                "file region wraps the offset space",
            ));
        }
        if flags & libc::O_DIRECT != 0 {
            entry.direct = Some(direct_alignment(entry.fd));
        }
        if self.access_hint != libc::POSIX_FADV_NORMAL {
            // SAFETY: posix_fadvise only records advice for an open descriptor; a
            // failure (e.g. a pipe) is harmless and ignored: it is a hint.
            unsafe { libc::posix_fadvise(entry.fd, 0, 0, self.access_hint) };
        }
        if let Engine::Uring(ring) = &self.engine {
            if self.register_files && ring.fixed_files {
                entry.fixed = ring.register_file(slot, entry.fd).is_ok();
            }
        }
        let token = self.files.fill(slot, entry);
        Ok(Registered {
            token,
            public_md: Vec::new(),
        })
    }

    pub(super) fn register_dram(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        let desc = region.desc;
        if desc.len == 0 || desc.end().is_none() {
            return Err(Error::invalid(
                descriptor(0, desc.addr, desc.len, desc.dev),
                "DRAM region must be non-empty and not wrap",
            ));
        }
        let mut token = 0;
        if let Engine::Uring(ring) = &self.engine {
            if self.register_buffers && ring.fixed_buffers && desc.len <= FIXED_BUFFER_BYTES_MAX {
                if let Some(slot) = self.buffers.vacant() {
                    // A refusal (memlock limit, file-backed memory) only means plain
                    // reads/writes for this region.
                    if ring.register_buffer(slot, desc.addr, desc.len).is_ok() {
                        token = self.buffers.fill(
                            slot,
                            BufEntry {
                                addr: desc.addr,
                                len_bytes: desc.len,
                            },
                        );
                    }
                }
            }
        }
        if token == 0 {
            // Plain memory: tracked all the same, so a post that names it after its
            // deregistration is refused.
            let slot = self
                .plain
                .vacant_or_grow(PLAIN_DRAM_MAX)
                .ok_or(Error::Capacity {
                    what: "POSIX DRAM regions",
                    limit: PLAIN_DRAM_MAX,
                })?;
            token = self.plain.fill(
                slot,
                BufEntry {
                    addr: desc.addr,
                    len_bytes: desc.len,
                },
            ) | PLAIN_DRAM;
        }
        Ok(Registered {
            token,
            public_md: Vec::new(),
        })
    }

    /// Release a region (the body of `Backend::deregister`). A region that a queued or
    /// in-flight operation uses is refused: one look at its use count.
    pub(super) fn deregister_region(&mut self, kind: MemKind, token: u64) -> Result<()> {
        let subject = || Subject::Named(format!("{kind} region with token {token:#x}").into());
        match kind {
            MemKind::File => {
                let slot = self
                    .files
                    .slot(token)
                    .ok_or_else(|| Error::not_found(subject()))?;
                if self.files.in_use(slot) {
                    return Err(Error::NotAllowed {
                        subject: subject(),
                        reason: "a posted request still uses it".into(),
                    });
                }
                if let Some(entry) = self.files.take(slot) {
                    if entry.fixed {
                        if let Engine::Uring(ring) = &self.engine {
                            // Clearing can only fail if the table is gone, and then
                            // nothing refers to the fd any more.
                            let _unused = ring.register_file(slot, -1);
                        }
                    }
                    // `entry.owned` (if any) closes the file here.
                    drop(entry);
                }
                Ok(())
            }
            MemKind::Dram if token & PLAIN_DRAM != 0 => {
                let slot = self
                    .plain
                    .slot(token & !PLAIN_DRAM)
                    .ok_or_else(|| Error::not_found(subject()))?;
                if self.plain.in_use(slot) {
                    return Err(Error::NotAllowed {
                        subject: subject(),
                        reason: "a posted request still uses it".into(),
                    });
                }
                self.plain.take(slot);
                Ok(())
            }
            MemKind::Dram => {
                let slot = self
                    .buffers
                    .slot(token)
                    .ok_or_else(|| Error::not_found(subject()))?;
                if self.buffers.in_use(slot) {
                    return Err(Error::NotAllowed {
                        subject: subject(),
                        reason: "a posted request still uses it".into(),
                    });
                }
                if let Engine::Uring(ring) = &self.engine {
                    ring.unregister_buffer(slot).map_err(|e| {
                        os_error(
                            errno_of(&e),
                            format!("cannot unregister fixed buffer {slot}: {e}"),
                        )
                    })?;
                }
                self.buffers.take(slot);
                Ok(())
            }
            other => Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!("memory kind {other}").into(),
            }),
        }
    }
}

pub(super) fn is_absent(errno: i32) -> bool {
    errno == libc::ENOENT || errno == libc::ENOTDIR
}

pub(super) fn query_path(path: &Path) -> Result<QueryResult> {
    match std::fs::metadata(path) {
        Ok(m) => Ok(QueryResult {
            exists: true,
            size: m.len(),
            mode: m.mode(),
            mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
        }),
        Err(e) if is_absent(errno_of(&e)) => Ok(QueryResult::default()),
        Err(e) => Err(os_error(
            errno_of(&e),
            format!("cannot stat file '{}': {e}", path.display()),
        )),
    }
}

pub(super) fn query_fd(index: usize, desc: &Desc) -> Result<QueryResult> {
    let Ok(fd) = RawFd::try_from(desc.dev) else {
        return Ok(QueryResult::default());
    };
    // SAFETY: stat is plain data; zeroed is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is writable and outlives the call.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        let e = io::Error::last_os_error();
        return match errno_of(&e) {
            libc::EBADF => Ok(QueryResult::default()),
            errno => Err(Error::Backend {
                backend: NAME.into(),
                errno,
                desc: Some(index as u32),
                detail: format!("cannot stat file descriptor {fd}: {e}").into(),
            }),
        };
    }
    Ok(QueryResult {
        exists: true,
        size: st.st_size as u64,
        mode: st.st_mode,
        mtime_ns: st.st_mtime * 1_000_000_000 + st.st_mtime_nsec,
    })
}
