//! The backend: regions, posting, completions, query.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use ferry_backend_api::{
    Backend, Capabilities, Completion, Completions, Desc, Endpoint, Error, Failure, FailureKind,
    MemKind, Op, Params, PeerId, Post, QueryResult, RegionSpec, Registered, RemoteAgent, Result,
    Subject,
};
use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::io::{self, Job, Tuning};
use crate::{Config, StoreKind, MEM_KINDS, NAME};

/// An OBJECT region: one object (or a range of it).
struct Region {
    /// Index into the backend's stores.
    store: usize,
    key: Key,
    /// First byte of the region inside the object.
    base: u64,
    /// Length; 0 = to the end of the object.
    len: u64,
    /// `s3://bucket/key`.
    name: Arc<str>,
}

/// A slot of the region table; tokens are `generation << 32 | index`.
struct Slot {
    generation: u32,
    region: Option<Region>,
}

/// The OBJ backend. See the crate docs.
pub struct ObjBackend {
    params: Params,
    config: Config,
    /// Stores by bucket: the configured bucket first, others as regions name them.
    stores: Vec<(String, Arc<dyn ObjectStore>)>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    tuning: Arc<Tuning>,
    /// Completions pushed by the requests' tasks; holds `max_requests`, so a push
    /// never fails.
    done: Arc<ArrayQueue<Completion>>,
    /// Requests posted whose completion `progress` has not handed on yet.
    outstanding: usize,
    /// Declared last: dropped last, after everything above. Its drop waits for the
    /// worker threads, so no task copies into a caller's memory once the backend is gone.
    runtime: tokio::runtime::Runtime,
}

fn bad_range(index: usize, reason: impl Into<std::borrow::Cow<'static, str>>) -> Error {
    Error::invalid(
        Subject::Named(format!("{NAME} range #{index}").into()),
        reason,
    )
}

impl ObjBackend {
    /// A backend from effective parameters (see [`crate::PARAMS`]; use
    /// [`ferry_backend_api::effective_params`] to fill defaults).
    pub fn new(params: Params) -> Result<ObjBackend> {
        let config = Config::parse(&params)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads)
            .thread_name("ferry-obj")
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| Error::Backend {
                backend: NAME.into(),
                errno: e.raw_os_error().unwrap_or(5),
                desc: None,
                detail: format!("cannot start the backend's runtime: {e}").into(),
            })?;
        let store = build_store(&config, &config.bucket)?;
        let tuning = Arc::new(Tuning {
            part_bytes: config.part_bytes,
            multipart_threshold_bytes: config.multipart_threshold_bytes,
            limiter: Arc::new(tokio::sync::Semaphore::new(config.max_in_flight)),
            release_timeout: config.request_timeout,
            lend_bodies: config.store != crate::StoreKind::Memory,
        });
        Ok(ObjBackend {
            params: crate::masked(params),
            stores: vec![(config.bucket.clone(), store)],
            done: Arc::new(ArrayQueue::new(config.max_requests)),
            config,
            slots: Vec::new(),
            free: Vec::new(),
            tuning,
            outstanding: 0,
            runtime,
        })
    }

    fn scheme(&self) -> &'static str {
        match self.config.store {
            StoreKind::S3 => "s3",
            StoreKind::Memory => "memory",
        }
    }

    /// The store of `bucket`, made on first use.
    fn store_for(&mut self, bucket: &str) -> Result<usize> {
        if let Some(i) = self.stores.iter().position(|(b, _)| b == bucket) {
            return Ok(i);
        }
        let store = build_store(&self.config, bucket)?;
        self.stores.push((bucket.to_string(), store));
        Ok(self.stores.len() - 1)
    }

    /// (bucket, key) of an object name: `s3://bucket/key` or a key in the configured bucket.
    fn split_name<'n>(&self, name: &'n str) -> Result<(Option<&'n str>, &'n str)> {
        let prefix = format!("{}://", self.scheme());
        let (bucket, key) = match name.strip_prefix(prefix.as_str()) {
            Some(rest) => match rest.split_once('/') {
                Some((b, k)) if !b.is_empty() => (Some(b), k),
                _ => {
                    return Err(Error::invalid(
                        Subject::Named(format!("object '{name}'").into()),
                        "no key after the bucket",
                    ))
                }
            },
            None => (None, name),
        };
        if key.is_empty() {
            return Err(Error::invalid(
                Subject::Named(format!("object '{name}'").into()),
                "empty key",
            ));
        }
        Ok((bucket, key))
    }

    fn key_of(name: &str, key: &str) -> Result<Key> {
        Key::parse(key).map_err(|e| {
            Error::invalid(
                Subject::Named(format!("object '{name}'").into()),
                format!("not a valid object key: {e}"),
            )
        })
    }

    fn region(&self, token: u64) -> Option<&Region> {
        let slot = self.slots.get((token & 0xffff_ffff) as usize)?;
        if u64::from(slot.generation) != token >> 32 {
            return None;
        }
        slot.region.as_ref()
    }

    /// Check a request against the regions; the jobs it runs.
    fn jobs(&self, post: &Post<'_>) -> Result<Vec<Job>> {
        if post.local_kind != MemKind::Dram || post.remote_kind != MemKind::Object {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!(
                    "{} -> {} transfers (only DRAM <-> OBJECT)",
                    post.local_kind, post.remote_kind
                )
                .into(),
            });
        }
        let mut jobs = Vec::with_capacity(post.ranges.len());
        for (i, r) in post.ranges.iter().enumerate() {
            let region = self.region(r.remote_token).ok_or_else(|| {
                Error::not_found(Subject::Named(
                    format!(
                        "{NAME} object region (token {:#x}) of range #{i}",
                        r.remote_token
                    )
                    .into(),
                ))
            })?;
            if r.remote_addr < region.base
                || (region.len != 0 && r.remote_addr + r.len > region.base + region.len)
            {
                return Err(bad_range(
                    i,
                    format!(
                        "bytes {}..{} are outside region {} (offset {}, length {})",
                        r.remote_addr,
                        r.remote_addr + r.len,
                        region.name,
                        region.base,
                        region.len
                    ),
                ));
            }
            if post.op == Op::Write && r.remote_addr != 0 {
                return Err(bad_range(
                    i,
                    format!(
                        "a WRITE replaces the whole object {}, so it starts at offset 0 \
                         (got offset {})",
                        region.name, r.remote_addr
                    ),
                ));
            }
            if post.op == Op::Write
                && post.ranges[..i]
                    .iter()
                    .any(|o| o.remote_token == r.remote_token)
            {
                return Err(bad_range(
                    i,
                    format!(
                        "a request WRITEs object {} once (one range per object)",
                        region.name
                    ),
                ));
            }
            jobs.push(Job {
                op: post.op,
                store: self.stores[region.store].1.clone(),
                key: region.key.clone(),
                offset: r.remote_addr,
                len: r.len,
                addr: r.local_addr,
                name: region.name.clone(),
            });
        }
        Ok(jobs)
    }

    /// HEAD of `name` (or of the object with id `dev`).
    fn head(&mut self, name: &str) -> Result<QueryResult> {
        let (bucket, key) = self.split_name(name)?;
        let key = Self::key_of(name, key)?;
        let store = match bucket {
            Some(b) => {
                let b = b.to_string();
                self.store_for(&b)?
            }
            None => 0,
        };
        let store = self.stores[store].1.clone();
        let deadline = self.config.request_timeout * 2 + self.config.retry_timeout;
        let result = self
            .runtime
            .block_on(async move { tokio::time::timeout(deadline, store.head(&key)).await });
        match result {
            Ok(Ok(meta)) => Ok(QueryResult {
                exists: true,
                size: meta.size,
                mode: 0,
                mtime_ns: meta.last_modified.timestamp_nanos_opt().unwrap_or(0),
            }),
            Ok(Err(object_store::Error::NotFound { .. })) => Ok(QueryResult::default()),
            Ok(Err(e)) => {
                let ((kind, errno), text) = io::classify(&e);
                Err(match kind {
                    FailureKind::Denied => Error::NotAllowed {
                        subject: Subject::Named(format!("object {name}").into()),
                        reason: "access denied".into(),
                    },
                    _ => Error::Backend {
                        backend: NAME.into(),
                        errno,
                        desc: None,
                        detail: format!("HEAD of {name} failed: {text}").into(),
                    },
                })
            }
            Err(_) => Err(Error::Backend {
                backend: NAME.into(),
                errno: 110,
                desc: None,
                detail: format!("HEAD of {name} timed out after {deadline:?}").into(),
            }),
        }
    }
}

/// An `object_store` client for `bucket` with the backend's settings.
fn build_store(config: &Config, bucket: &str) -> Result<Arc<dyn ObjectStore>> {
    match config.store {
        StoreKind::Memory => Ok(Arc::new(object_store::memory::InMemory::new())),
        StoreKind::S3 => {
            use object_store::aws::AmazonS3Builder;
            use object_store::{BackoffConfig, ClientOptions, RetryConfig};
            let mut builder = AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_region(&config.region)
                .with_virtual_hosted_style_request(config.virtual_addressing)
                .with_unsigned_payload(config.unsigned_payload);
            let keys_in_env = std::env::var_os("AWS_ACCESS_KEY_ID").is_some();
            match (&config.access_key, &config.secret_key) {
                (Some(a), Some(s)) => {
                    builder = builder.with_access_key_id(a).with_secret_access_key(s);
                    if let Some(t) = &config.session_token {
                        builder = builder.with_token(t);
                    }
                }
                (None, None) if !keys_in_env => {
                    if let Some((a, s, t)) = crate::creds::from_profile() {
                        builder = builder.with_access_key_id(a).with_secret_access_key(s);
                        if let Some(t) = t {
                            builder = builder.with_token(t);
                        }
                    }
                }
                (None, None) => {}
                _ => {
                    return Err(Error::invalid(
                        Subject::Named(format!("{NAME} credentials").into()),
                        "access_key and secret_key go together",
                    ))
                }
            }
            let mut client = ClientOptions::new()
                .with_timeout(config.request_timeout)
                .with_connect_timeout(Duration::from_secs(5).min(config.request_timeout))
                .with_pool_max_idle_per_host(config.max_in_flight);
            if let Some(endpoint) = &config.endpoint {
                builder = builder.with_endpoint(endpoint);
                if endpoint.starts_with("http://") {
                    builder = builder.with_allow_http(true);
                    client = client.with_allow_http(true);
                }
            }
            let retry = RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: config.backoff_initial,
                    max_backoff: Duration::from_secs(15),
                    base: 2.0,
                },
                max_retries: config.retries,
                retry_timeout: config.retry_timeout,
            };
            let store = builder
                .with_client_options(client)
                .with_retry(retry)
                .build()
                .map_err(|e| {
                    // The builder's errors name settings, never secret values.
                    Error::invalid(
                        Subject::Named(format!("{NAME} store for bucket '{bucket}'").into()),
                        e.to_string(),
                    )
                })?;
            Ok(Arc::new(store))
        }
    }
}

impl Backend for ObjBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            remote: false,
            local: true,
            notifications: false,
            mem_kinds: MEM_KINDS,
        }
    }

    fn params(&self) -> &Params {
        &self.params
    }

    fn describe(&self) -> Option<String> {
        Some(match self.config.store {
            StoreKind::Memory => "object_store in memory".into(),
            StoreKind::S3 => format!(
                "object_store S3, bucket '{}' at {} ({} runtime threads, {} HTTP requests in flight at most)",
                self.config.bucket,
                self.config.endpoint.as_deref().unwrap_or("AWS"),
                self.config.threads,
                self.config.max_in_flight
            ),
        })
    }

    unsafe fn register(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        match region.kind {
            // DRAM is addressed directly; nothing to set up.
            MemKind::Dram => return Ok(Registered::default()),
            MemKind::Object => {}
            other => {
                return Err(Error::NotSupported {
                    backend: NAME.into(),
                    what: format!("memory kind {other}").into(),
                })
            }
        }
        let id_name;
        let name = match region.path {
            Some((path, _)) => path.to_str().ok_or_else(|| {
                Error::invalid(
                    Subject::Named("object name".into()),
                    "the object name is not UTF-8",
                )
            })?,
            None => {
                id_name = region.desc.dev.to_string();
                &id_name
            }
        };
        let (bucket, key) = self.split_name(name)?;
        let parsed = Self::key_of(name, key)?;
        let (store, bucket) = match bucket {
            Some(b) => (self.store_for(b)?, b.to_string()),
            None => (0, self.config.bucket.clone()),
        };
        let full: Arc<str> = format!("{}://{bucket}/{key}", self.scheme()).into();
        let new = Region {
            store,
            key: parsed,
            base: region.desc.addr,
            len: region.desc.len,
            name: full,
        };
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    region: None,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.region = Some(new);
        Ok(Registered {
            token: (u64::from(slot.generation) << 32) | u64::from(index),
            public_md: Vec::new(),
        })
    }

    unsafe fn deregister(&mut self, kind: MemKind, token: u64) -> Result<()> {
        if kind == MemKind::Dram {
            return Ok(());
        }
        if self.region(token).is_none() {
            return Err(Error::not_found(Subject::Named(
                format!("{NAME} region token {token:#x}").into(),
            )));
        }
        let index = (token & 0xffff_ffff) as u32;
        let slot = &mut self.slots[index as usize];
        slot.region = None;
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(index);
        Ok(())
    }

    fn conn_info(&self) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }

    fn load_remote(&mut self, _peer: PeerId, _remote: RemoteAgent<'_>) -> Result<()> {
        Err(Error::NotSupported {
            backend: NAME.into(),
            what: "peers (OBJ moves bytes within the local agent)".into(),
        })
    }

    fn unload_remote(&mut self, _peer: PeerId) {}

    fn reaches(&self, _peer: PeerId, _remote_token: u64) -> bool {
        false
    }

    fn validate(&self, endpoint: Endpoint, post: &Post<'_>) -> Result<()> {
        if endpoint != Endpoint::Local {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: "transfers to peers".into(),
            });
        }
        self.jobs(post).map(|_| ())
    }

    fn describe_target(&self, kind: MemKind, token: u64) -> Option<String> {
        (kind == MemKind::Object)
            .then(|| self.region(token).map(|r| format!("object {}", r.name)))
            .flatten()
    }

    unsafe fn post(
        &mut self,
        endpoint: Endpoint,
        batch: &[Post<'_>],
        done: &mut Completions,
    ) -> Result<()> {
        if endpoint != Endpoint::Local {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: "transfers to peers".into(),
            });
        }
        if self.outstanding + batch.len() > self.config.max_requests {
            return Err(Error::Capacity {
                what: "OBJ requests outstanding (parameter max_requests)",
                limit: self.config.max_requests,
            });
        }
        // Check the whole batch before starting any of it.
        let mut all = Vec::with_capacity(batch.len());
        for post in batch {
            all.push((post.tag, self.jobs(post)?));
        }
        for (tag, jobs) in all {
            if jobs.is_empty() {
                done.success(tag);
                continue;
            }
            self.outstanding += 1;
            let tuning = self.tuning.clone();
            let queue = self.done.clone();
            self.runtime.spawn(async move {
                let runs = jobs.iter().map(|j| io::run(j, &tuning));
                let results = futures_util::future::join_all(runs).await;
                let result = match results.iter().position(Result::is_err) {
                    None => Ok(()),
                    Some(i) => {
                        let (kind, errno) = results[i].expect_err("position found an error");
                        Err(Failure {
                            kind,
                            errno,
                            range: Some(i as u32),
                        })
                    }
                };
                // Room for every outstanding request (max_requests), so this succeeds.
                let _ = queue.push(Completion { tag, result });
            });
        }
        Ok(())
    }

    fn progress(&mut self, done: &mut Completions) {
        while let Some(c) = self.done.pop() {
            self.outstanding -= 1;
            done.push(c);
        }
    }

    fn query(
        &mut self,
        kind: MemKind,
        descs: &[Desc],
        paths: &[Option<&Path>],
    ) -> Result<Vec<QueryResult>> {
        if kind != MemKind::Object {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!("query of {kind}").into(),
            });
        }
        let mut out = Vec::with_capacity(descs.len());
        for (i, d) in descs.iter().enumerate() {
            let name = match paths.get(i).copied().flatten() {
                Some(p) => p
                    .to_str()
                    .ok_or_else(|| {
                        Error::invalid(
                            Subject::Named(format!("object name #{i}").into()),
                            "not UTF-8",
                        )
                    })?
                    .to_string(),
                None => d.dev.to_string(),
            };
            out.push(self.head(&name)?);
        }
        Ok(out)
    }
}
