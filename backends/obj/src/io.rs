//! The transfers themselves: async functions that run on the backend's runtime.
//!
//! A range's bytes are copied between registered DRAM (a raw address the post's
//! caller vouched for until the request's completion is pushed) and the HTTP client's
//! buffers. Every copy happens inside the request's own task, before that task pushes
//! the completion; a request's part uploads run in tasks of their own but only on
//! copies, so nothing touches the caller's memory once the completion is out.

use std::sync::Arc;

use bytes::Bytes;
use ferry_backend_api::{FailureKind, Op};
use futures_util::StreamExt;
use object_store::path::Path as Key;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutPayload};
use tokio::sync::Semaphore;

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
}

/// Why a range failed: kind and errno.
pub(crate) type Fail = (FailureKind, i32);

/// Run one range.
pub(crate) async fn run(job: &Job, tuning: &Tuning) -> Result<(), Fail> {
    let result = match job.op {
        Op::Read => read(job, tuning).await,
        Op::Write if job.len >= tuning.multipart_threshold_bytes => {
            write_multipart(job, tuning).await
        }
        Op::Write => write_one(job, tuning).await,
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
        return Err((
            (FailureKind::ShortRead, 0),
            format!("the object ended after {} of {len} bytes", start + filled),
        ));
    }
    Ok(())
}

/// A copy of `len` bytes of the job's memory from `at`.
fn copy_out(job: &Job, at: u64, len: u64) -> Bytes {
    // SAFETY: [job.addr + at, + len) lies inside the job's range of registered DRAM,
    // valid until the request's completion is pushed (the post's promise); this runs in
    // the request's task before that, and only reads.
    let src = unsafe { std::slice::from_raw_parts((job.addr + at) as *const u8, len as usize) };
    Bytes::copy_from_slice(src)
}

async fn write_one(job: &Job, tuning: &Tuning) -> Result<(), Failed> {
    let _permit = permit(tuning).await?;
    let payload = PutPayload::from(copy_out(job, 0, job.len));
    job.store
        .put(&job.key, payload)
        .await
        .map(|_| ())
        .map_err(|e| classify(&e))
}

async fn write_multipart(job: &Job, tuning: &Tuning) -> Result<(), Failed> {
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
        let bytes = copy_out(job, at, part.min(job.len - at));
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
        _ if text.contains("416") || text.contains("InvalidRange") => (FailureKind::ShortRead, 0),
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
    text.contains("429")
        || text.contains("Too Many Requests")
        || text.contains("SlowDown")
        || text.contains("503 Service Unavailable")
}
