//! The transfers themselves: async functions that run on the backend's runtime.
//!
//! Registered DRAM is a raw address the post's caller vouched for until the request's
//! completion is pushed. A READ copies the response's chunks into it inside the
//! request's own task. A WRITE copies nothing: each PUT body is a [`Bytes`] view of the
//! caller's memory ([`Lent`]) that holds a clone of the request's [`Lease`]; once the
//! HTTP work is over, the task waits until the client has dropped every view before it
//! returns, and only then is the completion pushed. So nothing reads or writes the
//! caller's memory once the completion is out, even when a part upload's task or the
//! HTTP connection outlives the future that started it.

use std::sync::Arc;

use bytes::Bytes;
use ferry_backend_api::{FailureKind, Op};
use futures_util::StreamExt;
use object_store::path::Path as Key;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutPayload};
use tokio::sync::{oneshot, Semaphore};

/// S3's bound on the parts of one multipart upload.
const MAX_PARTS: u64 = 10_000;

/// One range of a request, resolved against its region.
pub(crate) struct Job {
    pub(crate) op: Op,
    pub(crate) store: Arc<dyn ObjectStore>,
    pub(crate) key: Key,
    /// Offset inside the object.
    pub(crate) offset: u64,
    pub(crate) len: u64,
    /// Local DRAM address.
    pub(crate) addr: u64,
    /// `s3://bucket/key`, for log lines.
    pub(crate) name: Arc<str>,
}

/// What every request of one backend shares.
pub(crate) struct Tuning {
    pub(crate) part_bytes: u64,
    pub(crate) multipart_threshold_bytes: u64,
    /// One permit per HTTP request in flight.
    pub(crate) limiter: Arc<Semaphore>,
    /// How long a WRITE waits, after its HTTP requests ended, for the client to let go
    /// of the caller's memory (one request's deadline).
    pub(crate) release_timeout: std::time::Duration,
    /// Whether PUT bodies may be views of the caller's memory: false for a store that
    /// keeps the bodies it is given (`store=memory`), which gets copies.
    pub(crate) lend_bodies: bool,
}

/// Why a range failed: kind and errno.
pub(crate) type Fail = (FailureKind, i32);

/// Run one range.
pub(crate) async fn run(job: &Job, tuning: &Tuning) -> Result<(), Fail> {
    let result = match job.op {
        Op::Read => read(job, tuning).await,
        Op::Write => write(job, tuning).await,
    };
    result.map_err(|(fail, what)| {
        log::warn!(
            "{}: {} {} failed ({:?}): {what}",
            crate::NAME,
            match job.op {
                Op::Read => "GET",
                Op::Write => "PUT",
            },
            job.name,
            fail.0
        );
        fail
    })
}

type Failed = (Fail, String);

fn closed() -> Failed {
    (
        (FailureKind::Canceled, libc_ecanceled()),
        "the backend is shutting down".into(),
    )
}

const fn libc_ecanceled() -> i32 {
    125 // ECANCELED on Linux
}

async fn permit(tuning: &Tuning) -> Result<tokio::sync::OwnedSemaphorePermit, Failed> {
    tuning
        .limiter
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| closed())
}

async fn read(job: &Job, tuning: &Tuning) -> Result<(), Failed> {
    if job.len == 0 {
        return Ok(());
    }
    let part = tuning.part_bytes.max(1);
    let chunks = job.len.div_ceil(part);
    let reads = (0..chunks).map(|c| {
        let at = c * part;
        read_chunk(job, at, part.min(job.len - at), tuning)
    });
    // The first failure drops the other chunks' futures: none copies any more.
    futures_util::future::try_join_all(reads).await.map(|_| ())
}

/// Ranged GET of `len` bytes at `at` (relative to the job) into the job's memory.
async fn read_chunk(job: &Job, at: u64, len: u64, tuning: &Tuning) -> Result<(), Failed> {
    let _permit = permit(tuning).await?;
    let start = job.offset + at;
    let options = GetOptions {
        range: Some(GetRange::Bounded(start..start + len)),
        ..Default::default()
    };
    let got = job
        .store
        .get_opts(&job.key, options)
        .await
        .map_err(|e| classify(&e))?;
    // The bytes the server sends (object_store checked its Content-Range against the
    // request, clamped to the object's size): ending early means the object ends inside
    // the range.
    if got.range.end < start + len {
        return Err((
            (FailureKind::ShortRead, 0),
            format!(
                "the object ends at byte {}, inside the range {start}..{}",
                got.range.end,
                start + len
            ),
        ));
    }
    let mut stream = got.into_stream();
    let mut filled = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| classify(&e))?;
        // Bytes past the range (a server ignoring the Range header) are not copied.
        let take = (chunk.len() as u64).min(len - filled);
        if take > 0 {
            let dst = job.addr + at + filled;
            // SAFETY: [dst, dst + take) lies inside [job.addr, job.addr + job.len), a
            // range of registered DRAM that the post's caller promised stays valid and
            // unaliased until this request's completion is pushed, which happens only
            // after this task stops copying; `chunk` is the client's own buffer, so the
            // two do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(chunk.as_ptr(), dst as *mut u8, take as usize);
            }
        }
        filled += take;
    }
    if filled < len {
        // The server promised the whole range and the body stopped early: the connection
        // was cut, not the object short.
        return Err((
            (FailureKind::Backend, 5), // EIO
            format!("the reply ended after {filled} of the {len} bytes it promised"),
        ));
    }
    Ok(())
}

/// The request's hold on the caller's memory: every [`Lent`] view keeps a clone, and
/// the receiver made with it resolves once the last clone is gone.
type Lease = Arc<oneshot::Sender<()>>;

/// `len` bytes of caller memory lent to the HTTP client as the body of a PUT.
struct Lent {
    ptr: *const u8,
    len: usize,
    _lease: Lease,
}

// SAFETY: `Lent` only reads memory that the post's caller keeps valid and unchanged until
// the completion is pushed, which waits for every `Lent` to drop (see `write`); reading
// it from any thread is sound.
unsafe impl Send for Lent {}
// SAFETY: as for `Send`: shared access only ever reads.
unsafe impl Sync for Lent {}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: [ptr, ptr + len) lies inside the job's range of registered DRAM (made
        // by `lend`), valid until the request's completion is pushed, and that waits for
        // this view to drop.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// A view of `len` bytes of the job's memory from `at`, without a copy (a copy where
/// the store keeps its bodies).
fn lend(job: &Job, at: u64, len: u64, lease: &Lease, tuning: &Tuning) -> Bytes {
    debug_assert!(at + len <= job.len);
    if !tuning.lend_bodies {
        // SAFETY: [job.addr + at, + len) lies inside the job's range of registered
        // DRAM, valid until the request's completion is pushed; this runs in the
        // request's task before that, and only reads.
        let src = unsafe { std::slice::from_raw_parts((job.addr + at) as *const u8, len as usize) };
        return Bytes::copy_from_slice(src);
    }
    Bytes::from_owner(Lent {
        ptr: (job.addr + at) as *const u8,
        len: len as usize,
        _lease: lease.clone(),
    })
}

/// A WRITE: one PUT, or a multipart upload from the threshold. Returns only once the
/// HTTP client holds no view of the caller's memory.
async fn write(job: &Job, tuning: &Tuning) -> Result<(), Failed> {
    let (lease, released) = oneshot::channel::<()>();
    let lease = Arc::new(lease);
    let result = if job.len >= tuning.multipart_threshold_bytes {
        write_multipart(job, tuning, &lease).await
    } else {
        write_one(job, tuning, &lease).await
    };
    drop(lease);
    // Every view dropped closes the channel (nothing is ever sent on it).
    match tokio::time::timeout(tuning.release_timeout, released).await {
        Ok(_) => result,
        Err(_) => {
            log::error!(
                "{}: PUT {}: the HTTP client still reads the request's memory {:?} after its requests ended; reporting the request failed",
                crate::NAME,
                job.name,
                tuning.release_timeout
            );
            result.and(Err((
                (FailureKind::Backend, 62), // ETIME
                "the HTTP client did not release the request's memory".into(),
            )))
        }
    }
}

async fn write_one(job: &Job, tuning: &Tuning, lease: &Lease) -> Result<(), Failed> {
    let _permit = permit(tuning).await?;
    let payload = PutPayload::from(lend(job, 0, job.len, lease, tuning));
    job.store
        .put(&job.key, payload)
        .await
        .map(|_| ())
        .map_err(|e| classify(&e))
}

async fn write_multipart(job: &Job, tuning: &Tuning, lease: &Lease) -> Result<(), Failed> {
    let mut upload = {
        let _permit = permit(tuning).await?;
        job.store
            .put_multipart(&job.key)
            .await
            .map_err(|e| classify(&e))?
    };
    let part = tuning.part_bytes.max(job.len.div_ceil(MAX_PARTS));
    let parts = job.len.div_ceil(part);
    let mut running = Vec::with_capacity(parts as usize);
    let mut failed = None;
    for p in 0..parts {
        // Stop issuing parts once one has failed.
        if running
            .iter()
            .any(|h: &tokio::task::JoinHandle<_>| h.is_finished())
        {
            let mut still = Vec::with_capacity(running.len());
            for h in running.drain(..) {
                if h.is_finished() {
                    if let Err(e) = joined(h.await) {
                        failed.get_or_insert(e);
                    }
                } else {
                    still.push(h);
                }
            }
            running = still;
            if failed.is_some() {
                break;
            }
        }
        let permit = permit(tuning).await?;
        let at = p * part;
        let bytes = lend(job, at, part.min(job.len - at), lease, tuning);
        let upload_part = upload.put_part(PutPayload::from(bytes));
        running.push(tokio::spawn(async move {
            let result = upload_part.await;
            drop(permit);
            result
        }));
    }
    for h in running {
        if let Err(e) = joined(h.await) {
            failed.get_or_insert(e);
        }
    }
    if let Some(e) = failed {
        let _ = upload.abort().await;
        return Err(e);
    }
    let _permit = permit(tuning).await?;
    match upload.complete().await {
        Ok(_) => Ok(()),
        Err(e) => {
            let _ = upload.abort().await;
            Err(classify(&e))
        }
    }
}

fn joined(result: Result<object_store::Result<()>, tokio::task::JoinError>) -> Result<(), Failed> {
    match result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(classify(&e)),
        Err(_) => Err(closed()),
    }
}

/// The error's text with every source in its chain.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        next = s.source();
    }
    text
}

/// Map an `object_store` error to a failure kind and errno (with its text for the log).
pub(crate) fn classify(e: &object_store::Error) -> Failed {
    use object_store::Error as E;
    let text = chain(e);
    let fail = match e {
        E::NotFound { .. } => (FailureKind::NotFound, 2), // ENOENT
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => (FailureKind::Denied, 13), // EACCES
        _ if throttled(&text) => (FailureKind::Throttled, 16), // EBUSY
        _ if status(&text, 416) || text.contains("InvalidRange") => (FailureKind::ShortRead, 0),
        _ if text.contains("NoSuchBucket") || text.contains("NoSuchKey") => {
            (FailureKind::NotFound, 2)
        }
        _ if text.contains("AccessDenied") => (FailureKind::Denied, 13),
        _ if text.to_ascii_lowercase().contains("timed out")
            || text.to_ascii_lowercase().contains("timeout") =>
        {
            (FailureKind::Backend, 110) // ETIMEDOUT
        }
        _ if text.to_ascii_lowercase().contains("connection refused") => {
            (FailureKind::Backend, 111) // ECONNREFUSED
        }
        _ => (FailureKind::Backend, 5), // EIO
    };
    (fail, text)
}

fn throttled(text: &str) -> bool {
    status(text, 429)
        || status(text, 503)
        || text.contains("Too Many Requests")
        || text.contains("SlowDown")
        || text.contains("503 Service Unavailable")
}

/// Whether the error's text reports HTTP status `code`. The client writes a status as
/// "status code: 416 Range Not Satisfiable"; a bare number is not enough, as ports, byte
/// counts and request ids hold digits too.
fn status(text: &str, code: u16) -> bool {
    text.contains(&format!("status code: {code}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind_of(text: &str) -> (FailureKind, i32) {
        let e = object_store::Error::Generic {
            store: "S3",
            source: text.to_string().into(),
        };
        classify(&e).0
    }

    #[test]
    fn statuses_are_read_from_the_status_not_from_any_digits() {
        for (text, want) in [
            (
                "Server returned non-2xx status code: 416 Range Not Satisfiable: ",
                (FailureKind::ShortRead, 0),
            ),
            (
                "Server returned non-2xx status code: 429 Too Many Requests: ",
                (FailureKind::Throttled, 16),
            ),
            (
                "Server returned non-2xx status code: 503 Service Unavailable: ",
                (FailureKind::Throttled, 16),
            ),
            // A port, a byte count or a request id with the same digits is not a status.
            (
                "error sending request for url (http://127.0.0.1:41654/b/k): closed",
                (FailureKind::Backend, 5),
            ),
            (
                "error decoding response body after 4290 bytes, request 5030",
                (FailureKind::Backend, 5),
            ),
        ] {
            assert_eq!(kind_of(text), want, "{text}");
        }
    }
}
