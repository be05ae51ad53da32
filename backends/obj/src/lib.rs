//! Ferry's OBJ backend: moves bytes between host memory (DRAM) and objects in an object
//! store (OBJECT) — S3 and S3-compatible servers — through the [`object_store`] crate.
//!
//! # Shape
//!
//! - A region of kind OBJECT names one object: by name (`Agent::register_object`: a key
//!   in the backend's bucket, or `s3://bucket/key`; NIXL's `metaInfo`), or by its id
//!   (`desc.dev` in decimal, as NIXL names an object registered without `metaInfo`).
//!   `desc.addr` is an offset inside the object, `desc.len` its length (0: unbounded).
//! - READ is object → memory: one ranged GET per range, split into ranged GETs of
//!   `part_bytes` that run side by side for a range longer than that. WRITE is memory →
//!   object: a range replaces the whole object (objects cannot be written in place), so
//!   its object offset must be 0; a PUT, or a multipart upload with parts of
//!   `part_bytes` (side by side) from `multipart_threshold_bytes` on.
//! - The backend owns a small tokio runtime (`threads` workers). `post` only checks the
//!   request and spawns one task for it; the task's HTTP requests run on the runtime and
//!   its one completion comes back through a bounded lock-free queue that `progress`
//!   drains. Neither ever blocks or waits on the network.
//! - At most `max_in_flight` HTTP requests run at once (a semaphore shared by every
//!   request; connections are reused and at most as many are kept idle); at most
//!   `max_requests` requests are outstanding (more is a `Capacity` error at post).
//! - Retryable failures (connection errors, 5xx, 429 / SlowDown) are retried by
//!   `object_store` with exponential backoff (`retries`, `backoff_initial_ms`,
//!   `retry_timeout_ms`); each HTTP request has a deadline (`request_timeout_ms`), so a
//!   server that dies or stalls mid-transfer ends in a failed completion, never a hang.
//! - Failures are typed: [`FailureKind::NotFound`](ferry_backend_api::FailureKind) (no
//!   such bucket or key), `Denied` (403/401), `Throttled` (retries ran out on 429/503),
//!   `ShortRead` (the object ended before the range), `Backend` (the rest); the engine
//!   names the object (`s3://bucket/key`) in the error. Credentials come from the
//!   parameters, the environment (`AWS_ACCESS_KEY_ID` …) or the shared credentials file
//!   (`AWS_PROFILE`); they are never logged and [`Backend::params`] shows them masked.
//! - `query` says whether each object exists and its size (a HEAD each).
//!
//! The memory kinds are DRAM and OBJECT; VRAM goes through a DRAM bounce buffer of the
//! caller's (the backend itself registers no device memory).

// The backend copies GET bodies into registered DRAM named by raw addresses (the backend
// contract's `post`) and lends that DRAM to the HTTP client as PUT bodies.
#![allow(unsafe_code)]

mod backend;
mod creds;
mod io;

pub use backend::ObjBackend;

use ferry_backend_api::{
    effective_params, Backend, BackendFactory, BackendInit, Error, MemKind, ParamSpec, Params,
    Result, Subject,
};

/// The backend type name.
pub const NAME: &str = "OBJ";

/// Memory kinds the backend serves.
pub const MEM_KINDS: &[MemKind] = &[MemKind::Dram, MemKind::Object];

/// Parameters the backend understands, with their defaults. The names NIXL's `OBJ`
/// plugin uses mean the same here.
pub const PARAMS: &[ParamSpec] = &[
    ParamSpec {
        name: "store",
        default: "s3",
        doc: "object store: `s3` (AWS S3 or an S3-compatible server) or `memory` (in this \
              process, for tests and dry runs)",
    },
    ParamSpec {
        name: "bucket",
        default: "",
        doc: "bucket of objects named by key (empty: AWS_DEFAULT_BUCKET, then AWS_BUCKET)",
    },
    ParamSpec {
        name: "endpoint_override",
        default: "",
        doc: "S3 endpoint URL, e.g. http://127.0.0.1:9000 (empty: AWS_ENDPOINT_OVERRIDE, \
              then AWS_ENDPOINT, then AWS's own endpoints)",
    },
    ParamSpec {
        name: "scheme",
        default: "https",
        doc: "scheme for an endpoint_override given without one: http or https",
    },
    ParamSpec {
        name: "region",
        default: "us-east-1",
        doc: "AWS region (AWS_REGION when set and this is left at its default)",
    },
    ParamSpec {
        name: "access_key",
        default: "",
        doc: "access key id (empty: AWS_ACCESS_KEY_ID, then the AWS_PROFILE profile of \
              the shared credentials file, then instance/container credentials)",
    },
    ParamSpec {
        name: "secret_key",
        default: "",
        doc: "secret access key (never logged; shown masked)",
    },
    ParamSpec {
        name: "session_token",
        default: "",
        doc: "session token of temporary credentials (never logged; shown masked)",
    },
    ParamSpec {
        name: "use_virtual_addressing",
        default: "false",
        doc: "virtual-hosted-style requests (bucket.host/key) instead of path style",
    },
    ParamSpec {
        name: "unsigned_payload",
        default: "auto",
        doc: "sign requests without hashing their bodies (UNSIGNED-PAYLOAD): true, false, \
              or auto (unsigned over https, where TLS protects the body; signed over http, \
              as boto3 does; aws-sdk-cpp's S3 client sends unsigned bodies over http too)",
    },
    ParamSpec {
        name: "part_bytes",
        default: "16777216",
        doc: "bytes per multipart-upload part and per ranged GET of a long READ \
              (S3 wants at least 5 MiB for every part but the last; 16 MiB is the part \
              NIXL's S3 CRT client uses)",
    },
    ParamSpec {
        name: "multipart_threshold_bytes",
        default: "33554432",
        doc: "WRITE ranges of at least this many bytes go as multipart uploads; shorter \
              ones as one PUT",
    },
    ParamSpec {
        name: "max_in_flight",
        default: "64",
        doc: "most HTTP requests running at once over all transfers (also the most idle \
              connections kept)",
    },
    ParamSpec {
        name: "max_requests",
        default: "4096",
        doc: "most posted transfer requests outstanding at once",
    },
    ParamSpec {
        name: "threads",
        default: "2",
        doc: "worker threads of the backend's own tokio runtime",
    },
    ParamSpec {
        name: "retries",
        default: "4",
        doc: "retries of a retryable failure (connection error, 5xx, 429/SlowDown) per \
              HTTP request",
    },
    ParamSpec {
        name: "backoff_initial_ms",
        default: "100",
        doc: "first retry's backoff; doubles (with jitter) up to 15 s",
    },
    ParamSpec {
        name: "retry_timeout_ms",
        default: "60000",
        doc: "no retry starts later than this after an HTTP request's first attempt",
    },
    ParamSpec {
        name: "request_timeout_ms",
        default: "30000",
        doc: "deadline of one HTTP request attempt (connect timeout: 5 s)",
    },
];

/// Parameters holding secrets: masked in [`Backend::params`].
const SECRET_PARAMS: &[&str] = &["secret_key", "session_token"];

/// Creates [`ObjBackend`]s.
#[derive(Clone, Copy, Debug, Default)]
pub struct ObjFactory;

impl BackendFactory for ObjFactory {
    fn name(&self) -> &'static str {
        NAME
    }

    fn params(&self) -> &'static [ParamSpec] {
        PARAMS
    }

    fn mem_kinds(&self) -> &'static [MemKind] {
        MEM_KINDS
    }

    fn create(&self, init: &BackendInit<'_>) -> Result<Box<dyn Backend>> {
        let params = effective_params(NAME, PARAMS, init.params)?;
        Ok(Box::new(ObjBackend::new(params)?))
    }
}

/// Which object store a backend talks to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StoreKind {
    S3,
    Memory,
}

/// The backend's settings, parsed from its parameters.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) store: StoreKind,
    pub(crate) bucket: String,
    pub(crate) endpoint: Option<String>,
    pub(crate) region: String,
    pub(crate) access_key: Option<String>,
    pub(crate) secret_key: Option<String>,
    pub(crate) session_token: Option<String>,
    pub(crate) virtual_addressing: bool,
    pub(crate) unsigned_payload: bool,
    pub(crate) part_bytes: u64,
    pub(crate) multipart_threshold_bytes: u64,
    pub(crate) max_in_flight: usize,
    pub(crate) max_requests: usize,
    pub(crate) threads: usize,
    pub(crate) retries: usize,
    pub(crate) backoff_initial: std::time::Duration,
    pub(crate) retry_timeout: std::time::Duration,
    pub(crate) request_timeout: std::time::Duration,
}

fn bad(name: &str, why: String) -> Error {
    Error::invalid(
        Subject::Named(format!("{NAME} parameter '{name}'").into()),
        why,
    )
}

fn param<'a>(params: &'a Params, name: &str) -> &'a str {
    params.get(name).map(String::as_str).unwrap_or("")
}

fn param_u64(params: &Params, name: &str, min: u64, max: u64) -> Result<u64> {
    let raw = param(params, name);
    match raw.parse::<u64>() {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(bad(
            name,
            format!("must be an integer in {min}..={max}, got '{raw}'"),
        )),
    }
}

fn param_bool(params: &Params, name: &str) -> Result<bool> {
    match param(params, name) {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        other => Err(bad(name, format!("must be true or false, got '{other}'"))),
    }
}

fn non_empty(value: &str) -> Option<String> {
    (!value.is_empty()).then(|| value.to_string())
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Config {
    /// Parse effective parameters (every key present).
    pub(crate) fn parse(params: &Params) -> Result<Config> {
        let store = match param(params, "store") {
            "s3" => StoreKind::S3,
            "memory" => StoreKind::Memory,
            other => return Err(bad("store", format!("'{other}' is not s3 or memory"))),
        };
        let bucket = non_empty(param(params, "bucket"))
            .or_else(|| env("AWS_DEFAULT_BUCKET"))
            .or_else(|| env("AWS_BUCKET"))
            .or_else(|| (store == StoreKind::Memory).then(|| "memory".to_string()))
            .ok_or_else(|| {
                bad(
                    "bucket",
                    "no bucket: set the parameter or AWS_DEFAULT_BUCKET".to_string(),
                )
            })?;
        let scheme = match param(params, "scheme") {
            s @ ("http" | "https") => s,
            other => return Err(bad("scheme", format!("'{other}' is not http or https"))),
        };
        let endpoint = non_empty(param(params, "endpoint_override"))
            .or_else(|| env("AWS_ENDPOINT_OVERRIDE"))
            .or_else(|| env("AWS_ENDPOINT"))
            .map(|e| {
                if e.contains("://") {
                    e
                } else {
                    format!("{scheme}://{e}")
                }
            });
        let region = match param(params, "region") {
            "us-east-1" => env("AWS_REGION").unwrap_or_else(|| "us-east-1".into()),
            other => other.to_string(),
        };
        let part_bytes = param_u64(params, "part_bytes", 4096, 5 << 30)?;
        let threshold = param_u64(params, "multipart_threshold_bytes", 1, u64::MAX)?;
        let ms = |name| {
            param_u64(params, name, 1, 24 * 3600 * 1000).map(std::time::Duration::from_millis)
        };
        let unsigned_payload = match param(params, "unsigned_payload") {
            "auto" => !endpoint
                .as_deref()
                .is_some_and(|e| e.starts_with("http://")),
            _ => param_bool(params, "unsigned_payload")?,
        };
        Ok(Config {
            unsigned_payload,
            store,
            bucket,
            endpoint,
            region,
            access_key: non_empty(param(params, "access_key")),
            secret_key: non_empty(param(params, "secret_key")),
            session_token: non_empty(param(params, "session_token")),
            virtual_addressing: param_bool(params, "use_virtual_addressing")?,
            part_bytes,
            multipart_threshold_bytes: threshold,
            max_in_flight: param_u64(params, "max_in_flight", 1, 4096)? as usize,
            max_requests: param_u64(params, "max_requests", 1, 1 << 20)? as usize,
            threads: param_u64(params, "threads", 1, 256)? as usize,
            retries: param_u64(params, "retries", 0, 100)? as usize,
            backoff_initial: ms("backoff_initial_ms")?,
            retry_timeout: ms("retry_timeout_ms")?,
            request_timeout: ms("request_timeout_ms")?,
        })
    }
}

/// `params` with every secret replaced by `***` (what [`Backend::params`] shows).
pub(crate) fn masked(mut params: Params) -> Params {
    for key in SECRET_PARAMS {
        if let Some(v) = params.get_mut(*key) {
            if !v.is_empty() {
                *v = "***".into();
            }
        }
    }
    params
}
