//! Backend parameters and construction.

use super::*;

pub(super) fn param_u32(params: &Params, name: &str, min: u32, max: u32) -> Result<u32> {
    let raw = params.get(name).map(String::as_str).unwrap_or("");
    match raw.parse::<u32>() {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(Error::invalid(
            Subject::BackendName(NAME.into()),
            format!("parameter '{name}' must be an integer in {min}..={max}, got '{raw}'"),
        )),
    }
}

pub(super) fn param_bool(params: &Params, name: &str) -> Result<bool> {
    match params.get(name).map(String::as_str) {
        Some("true" | "1" | "yes" | "on") => Ok(true),
        Some("false" | "0" | "no" | "off") => Ok(false),
        other => Err(Error::invalid(
            Subject::BackendName(NAME.into()),
            format!(
                "parameter '{name}' must be true or false, got '{}'",
                other.unwrap_or("")
            ),
        )),
    }
}

impl PosixBackend {
    /// A backend from effective parameters (see [`crate::PARAMS`]; use
    /// [`ferry_backend_api::effective_params`] to fill defaults). Logs the active
    /// engine on stderr.
    pub fn new(params: Params) -> Result<PosixBackend> {
        let depth = param_u32(&params, "queue_depth", 1, 32768)?;
        let workers = param_u32(&params, "workers", 1, 1024)?;
        let max_requests = param_u32(&params, "max_requests", 1, 1 << 24)?;
        let max_ops = param_u32(&params, "max_ops", 1, 1 << 26)?;
        let max_files = param_u32(&params, "max_files", 1, 1 << 20)?;
        let max_buffers = param_u32(&params, "max_buffers", 1, 16384)?;
        let register_buffers = param_bool(&params, "register_buffers")?;
        let register_files = param_bool(&params, "register_files")?;
        let access_hint = match params
            .get("access_hint")
            .map(String::as_str)
            .unwrap_or("normal")
        {
            "normal" => libc::POSIX_FADV_NORMAL,
            "sequential" => libc::POSIX_FADV_SEQUENTIAL,
            "random" => libc::POSIX_FADV_RANDOM,
            other => {
                return Err(Error::invalid(
                    Subject::Named("POSIX parameter access_hint".into()),
                    format!("'{other}' is not normal, sequential or random"),
                ))
            }
        };
        let engine_name = params.get("engine").map(String::as_str).unwrap_or("auto");

        let threads = || {
            ThreadEngine::new(workers, depth)
                .map_err(|e| os_error(errno_of(&e), format!("cannot start worker threads: {e}")))
        };
        let uring = || {
            UringEngine::new(
                depth,
                register_buffers.then_some(max_buffers),
                register_files.then_some(max_files),
            )
        };
        let engine = match engine_name {
            "uring" => {
                Engine::Uring(Box::new(uring().map_err(|e| {
                    os_error(errno_of(&e), format!("io_uring setup failed: {e}"))
                })?))
            }
            "threads" => Engine::Threads(threads()?),
            "auto" => match uring() {
                Ok(e) => Engine::Uring(Box::new(e)),
                Err(e) => {
                    log::warn!(
                        "posix: io_uring unavailable ({e}); falling back to the thread engine"
                    );
                    Engine::Threads(threads()?)
                }
            },
            other => {
                return Err(Error::invalid(
                    Subject::BackendName(NAME.into()),
                    format!("parameter 'engine' must be auto, uring or threads, got '{other}'"),
                ))
            }
        };
        let backend = PosixBackend {
            params,
            engine,
            register_buffers,
            register_files,
            access_hint,
            files: Table::new(max_files),
            buffers: Table::new(max_buffers),
            plain: Table::new(0),
            requests: Slab::new(max_requests, None),
            ops: Ops::new(max_ops),
            // Grows with use (bounded by max_ops, as the operation slab).
            pending: VecDeque::new(),
            reaped: Vec::with_capacity(depth as usize),
        };
        log::info!("posix: {}", backend.engine_text());
        Ok(backend)
    }

    /// The engine in words: `engine io_uring (queue depth 256, fixed buffers on, fixed
    /// files on)` or `engine threads (4 workers, queue depth 256)`. Logged at creation
    /// (info) and the agent's "backend created" line (`Backend::describe`).
    pub(super) fn engine_text(&self) -> String {
        match &self.engine {
            Engine::Uring(e) => format!(
                "engine io_uring (queue depth {}, fixed buffers {}, fixed files {})",
                e.depth(),
                if e.fixed_buffers { "on" } else { "off" },
                if e.fixed_files { "on" } else { "off" },
            ),
            Engine::Threads(e) => format!(
                "engine threads ({} workers, queue depth {})",
                self.params.get("workers").map_or("?", String::as_str),
                e.depth()
            ),
        }
    }
}
