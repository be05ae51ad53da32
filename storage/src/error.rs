//! The one error type of Ferry, with the reference system's status distinctions. Each
//! variant carries what was wrong: which handle, which descriptor, which peer.

use std::borrow::Cow;
use std::fmt;

use crate::{BackendId, MemKind, PeerId, PrepId, RegionId, XferId};

/// Something an error can point at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Subject {
    /// A region handle.
    Region(RegionId),
    /// A prepared-list handle.
    Prep(PrepId),
    /// A transfer-request handle.
    Xfer(XferId),
    /// A peer handle.
    Peer(PeerId),
    /// A peer by agent name.
    PeerName(String),
    /// A backend handle.
    Backend(BackendId),
    /// A backend by type name.
    BackendName(String),
    /// Descriptor `index` of a list (or of a request's index list).
    Descriptor {
        /// Position in the list.
        index: u32,
        /// Its address.
        addr: u64,
        /// Its length.
        len: u64,
        /// Its device.
        dev: u64,
    },
    /// A memory kind.
    Kind(MemKind),
    /// The result of command `index` of the same command buffer.
    Command(u32),
    /// Anything else, named in words.
    Named(Cow<'static, str>),
}

impl fmt::Display for Subject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Subject::Region(id) => write!(f, "region {id:?}"),
            Subject::Prep(id) => write!(f, "prepared list {id:?}"),
            Subject::Xfer(id) => write!(f, "transfer request {id:?}"),
            Subject::Peer(id) => write!(f, "peer {id:?}"),
            Subject::PeerName(name) => write!(f, "peer agent '{name}'"),
            Subject::Backend(id) => write!(f, "backend {id:?}"),
            Subject::BackendName(name) => write!(f, "backend '{name}'"),
            Subject::Descriptor {
                index,
                addr,
                len,
                dev,
            } => write!(
                f,
                "descriptor #{index} (addr {addr:#x}, len {len}, dev {dev})"
            ),
            Subject::Kind(kind) => write!(f, "memory kind {kind}"),
            Subject::Command(i) => write!(f, "the result of command #{i}"),
            Subject::Named(s) => f.write_str(s),
        }
    }
}

/// Every way a Ferry call can fail.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A caller-supplied value is malformed (empty range, bad index, bad parameter).
    #[error("invalid parameter: {subject}: {reason}")]
    InvalidParam {
        /// What was wrong.
        subject: Subject,
        /// Why.
        reason: Cow<'static, str>,
    },
    /// A handle, region, peer or backend does not exist (or no longer does).
    #[error("not found: {subject}")]
    NotFound {
        /// What was looked for.
        subject: Subject,
    },
    /// Two things that must agree do not (conflicting metadata, kinds, lengths).
    #[error("mismatch: {subject}: {reason}")]
    Mismatch {
        /// Where the disagreement is.
        subject: Subject,
        /// What disagrees.
        reason: Cow<'static, str>,
    },
    /// The call is valid but not allowed in the current state.
    #[error("not allowed: {subject}: {reason}")]
    NotAllowed {
        /// What it concerns.
        subject: Subject,
        /// Why not.
        reason: Cow<'static, str>,
    },
    /// The request is still in progress and cannot be posted again.
    #[error("transfer request {xfer:?} is still in progress (repost of an active request)")]
    RepostActive {
        /// The request.
        xfer: XferId,
    },
    /// The backend or agent does not support this.
    #[error("not supported by {backend}: {what}")]
    NotSupported {
        /// Which backend (or "agent").
        backend: Cow<'static, str>,
        /// What was asked.
        what: Cow<'static, str>,
    },
    /// A backend failed.
    #[error("backend {backend} failed{}: {detail}{}", desc_suffix(*.desc), errno_suffix(*.errno))]
    Backend {
        /// Which backend.
        backend: Cow<'static, str>,
        /// The OS or transport error number, 0 if none.
        errno: i32,
        /// The merged range (or descriptor) index concerned, if known.
        desc: Option<u32>,
        /// What happened.
        detail: Cow<'static, str>,
    },
    /// The peer went away (connection lost, process died, dropped).
    #[error("remote disconnect: {subject}")]
    RemoteDisconnect {
        /// The peer.
        subject: Subject,
    },
    /// The transfer was canceled.
    #[error("transfer request {xfer:?} was canceled")]
    Canceled {
        /// The request.
        xfer: XferId,
    },
    /// Telemetry was asked for a request that has none (never posted, or disabled).
    #[error("no telemetry for transfer request {xfer:?}")]
    NoTelemetry {
        /// The request.
        xfer: XferId,
    },
    /// Metadata bytes from a peer are malformed.
    #[error("invalid metadata: {reason}")]
    InvalidMetadata {
        /// What check failed.
        reason: Cow<'static, str>,
    },
    /// A bounded table or queue is full.
    #[error("capacity exceeded: {what} (limit {limit})")]
    Capacity {
        /// Which bound.
        what: &'static str,
        /// The configured limit.
        limit: usize,
    },
    /// A prepared list (or request) names a region that was deregistered after the list
    /// was prepared; nothing was moved.
    #[error("stale region: {region:?} (covering descriptor #{descriptor}) was deregistered after the list was prepared")]
    StaleRegion {
        /// The deregistered region.
        region: RegionId,
        /// Position of the descriptor (in the request's order) that named it.
        descriptor: u32,
    },
    /// A panic inside an earlier flush left this agent's tables in an unknown state; the
    /// agent refuses further work (drop it and make a new one).
    #[error("agent '{agent}' is poisoned: a panic inside an earlier flush interrupted it, so it refuses further work")]
    Poisoned {
        /// The agent's name.
        agent: String,
    },
    /// A command depends on an earlier command of the same buffer that failed.
    #[error("command #{command} failed, so this command, which uses its result, did not run")]
    DependencyFailed {
        /// Index of the failed command.
        command: u32,
    },
}

fn desc_suffix(desc: Option<u32>) -> String {
    desc.map(|d| format!(" on range #{d}")).unwrap_or_default()
}

fn errno_suffix(errno: i32) -> String {
    if errno == 0 {
        String::new()
    } else {
        format!(
            " (errno {errno}: {})",
            std::io::Error::from_raw_os_error(errno)
        )
    }
}

impl Error {
    /// Shorthand for [`Error::InvalidParam`].
    pub fn invalid(subject: Subject, reason: impl Into<Cow<'static, str>>) -> Error {
        Error::InvalidParam {
            subject,
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Error::NotFound`].
    pub fn not_found(subject: Subject) -> Error {
        Error::NotFound { subject }
    }

    /// Shorthand for [`Error::Backend`] without a range or errno.
    pub fn backend(
        backend: impl Into<Cow<'static, str>>,
        detail: impl Into<Cow<'static, str>>,
    ) -> Error {
        Error::Backend {
            backend: backend.into(),
            errno: 0,
            desc: None,
            detail: detail.into(),
        }
    }

    /// The reference system's status name for this error (`NIXL_ERR_*` without prefix);
    /// `POISONED` is Ferry's own (the reference system has no such state).
    pub fn status_name(&self) -> &'static str {
        match self {
            Error::InvalidParam { .. } => "INVALID_PARAM",
            Error::NotFound { .. } => "NOT_FOUND",
            Error::Mismatch { .. } => "MISMATCH",
            Error::NotAllowed { .. } => "NOT_ALLOWED",
            Error::RepostActive { .. } => "REPOST_ACTIVE",
            Error::NotSupported { .. } => "NOT_SUPPORTED",
            Error::Backend { .. } => "BACKEND",
            Error::RemoteDisconnect { .. } => "REMOTE_DISCONNECT",
            Error::Canceled { .. } => "CANCELED",
            Error::NoTelemetry { .. } => "NO_TELEM",
            Error::InvalidMetadata { .. } => "INVALID_PARAM",
            Error::Capacity { .. } => "NOT_ALLOWED",
            Error::DependencyFailed { .. } => "INVALID_PARAM",
            Error::StaleRegion { .. } => "NOT_FOUND",
            // Not a refusal of this call: the agent refuses everything from now on.
            Error::Poisoned { .. } => "POISONED",
        }
    }
}

/// Shorthand result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
