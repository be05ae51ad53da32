//! Shareable host memory: a sealed memfd mapped into this process ([`SharedMemory`]),
//! and a peer's segment mapped into ours ([`PeerMapping`]).
//!
//! A segment's memfd is named `ferry-shm-<nonce>` (32 hex digits of kernel randomness).
//! A same-host peer reaches it through `/proc/<owner pid>/fd/<fd>` (same uid, no ptrace
//! attach needed), and before mapping checks that what it opened really is that
//! segment: the name carries the nonce, the size is the advertised one, and the size is
//! sealed (`F_SEAL_SHRINK | F_SEAL_GROW`), so the owner cannot shrink it under the
//! mapping (which would turn a copy into a `SIGBUS`).

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

use ferry_backend_api::{Desc, Error, Subject};

use crate::host::{errno, random_bytes};

/// Whether to back shareable memory with huge pages (hugetlbfs, `MFD_HUGETLB`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HugePages {
    /// Ordinary 4 KiB pages.
    #[default]
    Off,
    /// 2 MiB huge pages when the kernel has them reserved; otherwise ordinary pages,
    /// with the reason kept in [`SharedMemory::huge_pages_fallback`].
    Prefer,
    /// 2 MiB huge pages or an error saying why not.
    Require,
}

/// How to allocate shareable memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct ShmOptions {
    /// Huge pages or not.
    pub huge_pages: HugePages,
    /// Fault every page in at allocation (`MAP_POPULATE`) instead of on first touch.
    pub populate: bool,
}

/// Bytes of one huge page (the hugetlbfs default size on x86-64 and arm64).
pub const HUGE_PAGE_BYTES: usize = 2 << 20;
const PAGE_BYTES: usize = 4096;

/// Host memory other processes on this host can map: a memfd, sealed at its size and
/// mapped read-write here. Register it like any DRAM range ([`SharedMemory::desc`]);
/// an SHM backend that registers a range inside it publishes what a same-host peer
/// needs to map it, and the peer's transfers into it are plain copies.
///
/// Unmapped and closed on drop. The caller must not drop it while a backend has it
/// registered (the registration's promise, `register` is `unsafe`). A peer that mapped
/// it keeps its own mapping of the same pages until it unloads us, so dropping it never
/// makes a peer fault.
#[derive(Debug)]
pub struct SharedMemory {
    base: *mut u8,
    len: usize,
    fd: OwnedFd,
    nonce: [u8; 16],
    huge: bool,
    fallback: Option<String>,
}

// SAFETY: the mapping is plain shared memory owned by this value; moving or sharing the
// handle between threads does not touch the bytes (access goes through raw pointers
// whose users promise the aliasing rules, or through `read`/`write` that copy).
unsafe impl Send for SharedMemory {}
// SAFETY: as above; `&SharedMemory` only hands out addresses and copies.
unsafe impl Sync for SharedMemory {}

/// A live segment of this process, as the backend publishes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LiveSegment {
    pub base: u64,
    pub len: u64,
    pub fd: RawFd,
    pub nonce: [u8; 16],
}

/// Every live [`SharedMemory`] of this process (few: one per pool and one inbox per SHM
/// backend), so that registration can tell shareable ranges from ordinary ones.
static LIVE: Mutex<Vec<LiveSegment>> = Mutex::new(Vec::new());

/// The live segment that holds all of `addr..addr + len`, if any.
pub(crate) fn live_segment(addr: u64, len: u64) -> Option<LiveSegment> {
    let end = addr.checked_add(len)?;
    LIVE.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .copied()
        .find(|s| addr >= s.base && end <= s.base + s.len)
}

/// The memfd name of the segment with `nonce`.
pub(crate) fn segment_name(nonce: &[u8; 16]) -> String {
    let mut name = String::with_capacity(10 + 32);
    name.push_str("ferry-shm-");
    for b in nonce {
        name.push_str(&format!("{b:02x}"));
    }
    name
}

fn os_error(what: &str, errno: i32) -> Error {
    Error::Backend {
        backend: "SHM".into(),
        errno,
        desc: None,
        detail: format!("{what}: {}", std::io::Error::from_raw_os_error(errno)).into(),
    }
}

impl SharedMemory {
    /// Allocate `len` bytes (rounded up to a page, or to a huge page) of zeroed
    /// shareable memory.
    pub fn alloc(len: usize, options: &ShmOptions) -> Result<SharedMemory, Error> {
        if len == 0 || len > isize::MAX as usize / 2 {
            return Err(Error::invalid(
                Subject::Named("shared memory length".into()),
                format!("{len} bytes: must be positive and below isize::MAX / 2"),
            ));
        }
        match options.huge_pages {
            HugePages::Off => Self::create(len, false, options.populate),
            HugePages::Require => {
                Self::create(len, true, options.populate).map_err(|e| Error::NotSupported {
                    backend: "SHM".into(),
                    what: format!("huge pages for shared memory: {e} ({})", huge_pages_state())
                        .into(),
                })
            }
            HugePages::Prefer => match Self::create(len, true, options.populate) {
                Ok(m) => Ok(m),
                Err(e) => {
                    let mut m = Self::create(len, false, options.populate)?;
                    m.fallback = Some(format!("{e} ({})", huge_pages_state()));
                    Ok(m)
                }
            },
        }
    }

    fn create(len: usize, huge: bool, populate: bool) -> Result<SharedMemory, Error> {
        let mut nonce = [0u8; 16];
        random_bytes(&mut nonce)
            .map_err(|e| os_error("getrandom", e.raw_os_error().unwrap_or(libc::EIO)))?;
        let page = if huge { HUGE_PAGE_BYTES } else { PAGE_BYTES };
        let len = len.next_multiple_of(page);
        let name = CString::new(segment_name(&nonce)).expect("hex has no NUL");
        let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
        if huge {
            flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
        }
        // SAFETY: a NUL-terminated name and flags; returns a new fd or -1.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), flags) };
        if raw < 0 {
            return Err(os_error("memfd_create", errno()));
        }
        // SAFETY: a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our own memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os_error("ftruncate of the memfd", errno()));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on our own memfd.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(os_error("sealing the memfd's size", errno()));
        }
        let mut mflags = libc::MAP_SHARED;
        if populate || huge {
            // Huge pages are reserved at mmap; populating makes a missing page an error
            // here, not a SIGBUS on first touch.
            mflags |= libc::MAP_POPULATE;
        }
        // SAFETY: a new shared mapping of our memfd, no address hint; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                mflags,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(os_error("mmap of the memfd", errno()));
        }
        let base = base.cast::<u8>();
        if huge && !populated(base, len) {
            // SAFETY: unmapping exactly the mapping made above, used by nothing yet.
            unsafe { libc::munmap(base.cast(), len) };
            return Err(os_error("huge pages could not be reserved", libc::ENOMEM));
        }
        let m = SharedMemory {
            base,
            len,
            fd,
            nonce,
            huge,
            fallback: None,
        };
        LIVE.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(m.live());
        Ok(m)
    }

    pub(crate) fn live(&self) -> LiveSegment {
        LiveSegment {
            base: self.base as u64,
            len: self.len as u64,
            fd: self.fd.as_raw_fd(),
            nonce: self.nonce,
        }
    }

    /// The first byte's address.
    pub fn addr(&self) -> u64 {
        self.base as u64
    }

    /// Raw pointer to the first byte (for callers that build their own views; every
    /// access must respect that peers and transfers write these bytes too).
    pub fn as_ptr(&self) -> *mut u8 {
        self.base
    }

    /// Length in bytes (the requested length rounded up to the page size).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never empty (allocation refuses length 0); here for API completeness.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A DRAM descriptor of `len` bytes at `offset` (device 0), or `None` past the end.
    pub fn desc_at(&self, offset: usize, len: usize) -> Option<Desc> {
        (offset.checked_add(len)? <= self.len)
            .then(|| Desc::new(self.addr() + offset as u64, len as u64, 0))
    }

    /// A DRAM descriptor of the whole segment (device 0).
    pub fn desc(&self) -> Desc {
        Desc::new(self.addr(), self.len as u64, 0)
    }

    /// Whether it is backed by huge pages.
    pub fn huge_pages(&self) -> bool {
        self.huge
    }

    /// Why huge pages were asked for ([`HugePages::Prefer`]) but not used.
    pub fn huge_pages_fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// Copy `out.len()` bytes at `offset` into `out`. Bytes a transfer or a peer writes
    /// at the same time may be torn; read when no transfer into them is in flight.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), Error> {
        self.check(offset, out.len())?;
        // SAFETY: offset..offset+len lies inside the mapping (checked); the mapping is
        // shared memory that other writers change only through raw pointers too.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base.add(offset), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }

    /// Copy `data` to `offset`. Same rule as [`SharedMemory::read`].
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), Error> {
        self.check(offset, data.len())?;
        // SAFETY: offset..offset+len lies inside the mapping (checked); see `read`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.base.add(offset), data.len()) };
        Ok(())
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), Error> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::invalid(
                Subject::Named("shared memory range".into()),
                format!(
                    "{len} bytes at offset {offset} pass the end ({} bytes)",
                    self.len
                ),
            ));
        }
        Ok(())
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        let me = self.live();
        LIVE.lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|s| *s != me);
        // SAFETY: unmapping exactly our mapping; the owner promised no registration
        // refers to it any more.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Whether every page of `base..base + len` is resident (after `MAP_POPULATE` of a
/// hugetlb mapping, a page the pool could not supply is not).
fn populated(base: *mut u8, len: usize) -> bool {
    let pages = len.div_ceil(PAGE_BYTES);
    let mut vec = vec![0u8; pages];
    // SAFETY: base..base+len is our mapping; `vec` has one byte per 4 KiB page.
    let r = unsafe { libc::mincore(base.cast(), len, vec.as_mut_ptr()) };
    r == 0 && vec.iter().all(|v| v & 1 == 1)
}

/// Words about the huge-page pool, for error messages.
fn huge_pages_state() -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "?".into())
    };
    format!(
        "vm.nr_hugepages = {}, free 2 MiB pages = {}",
        read("/proc/sys/vm/nr_hugepages"),
        read("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
    )
}

/// A peer's segment mapped into this process. Unmapped on drop.
#[derive(Debug)]
pub(crate) struct PeerMapping {
    base: *mut u8,
    len: usize,
}

// SAFETY: a plain shared mapping owned by this value; see `SharedMemory`.
unsafe impl Send for PeerMapping {}

impl PeerMapping {
    /// Open `fd` of process `pid` through `/proc`, check that it is the segment named
    /// by `nonce` with `len` bytes and a sealed size, and map it.
    pub(crate) fn open(
        pid: u32,
        fd: i32,
        nonce: &[u8; 16],
        len: u64,
    ) -> Result<PeerMapping, String> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("cannot open {path}: {e}"))?;
        let own = format!("/proc/self/fd/{}", file.as_raw_fd());
        let target = std::fs::read_link(&own).map_err(|e| format!("readlink {own}: {e}"))?;
        let expected = format!("/memfd:{}", segment_name(nonce));
        let target = target.to_string_lossy();
        if !target.starts_with(&expected) {
            return Err(format!(
                "{path} is '{target}', not the segment '{expected}' (closed or reused fd)"
            ));
        }
        let size = file
            .metadata()
            .map_err(|e| format!("fstat {path}: {e}"))?
            .len();
        if size != len || len == 0 || len > isize::MAX as u64 {
            return Err(format!(
                "{path} holds {size} bytes, the metadata says {len}"
            ));
        }
        // SAFETY: fcntl on the fd we just opened.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        let needed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals < 0 || seals & needed != needed {
            return Err(format!("{path}: the segment's size is not sealed"));
        }
        // SAFETY: a new shared mapping of a file we hold open, of its sealed size;
        // checked below. The mapping outlives the fd (closed when `file` drops).
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(format!(
                "mmap of {path}: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(PeerMapping {
            base: base.cast(),
            len: len as usize,
        })
    }

    /// The first byte here.
    pub(crate) fn base(&self) -> *mut u8 {
        self.base
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for PeerMapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly our mapping; the backend drops it only when no copy
        // uses it (copies run inside `post`, which holds the backend `&mut`).
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}
