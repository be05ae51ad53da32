//! The initiator side of `ferry bench xfer`: set up workers and targets, run every
//! case, aggregate the samples into rows.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use ferry::{
    Agent, AgentConfig, CostEstimate, CostMethod, Desc, FileMode, MemKind, Op, Params, Side,
    XferId, XferStatus,
};

use super::report::Outputs;
use super::vram::{registered, Memory};
use super::{target, BackendArg, Layout, Plan, RequestMode, Scheme, Shape};
use crate::bench::OpArg;

/// The notification that tells a target the initiator is done.
pub const DONE_NOTIFICATION: &[u8] = b"ferry-bench: done";

/// Set by the initiator's SIGINT/SIGTERM handler: the case in progress is abandoned
/// at its next iteration (or while it waits for a completion), the finished rows are
/// kept, the targets are told, and the outputs are completed.
pub static STOP: AtomicBool = AtomicBool::new(false);

/// The target files of the run (POSIX, GDS), for a second interrupt, whose immediate
/// exit skips the destructors that remove them otherwise.
static TARGET_FILES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Remove the run's target files now (the second interrupt, right before it exits).
pub fn remove_target_files() {
    let mut files = TARGET_FILES.lock().unwrap_or_else(|e| e.into_inner());
    for p in files.drain(..) {
        let _ = std::fs::remove_file(p);
    }
}

/// What a worker returns for a case cut short by [`STOP`].
const INTERRUPTED: &str = "interrupted";

fn stopping() -> bool {
    STOP.load(Ordering::Relaxed)
}

/// One measured case, over all its workers.
#[derive(Clone, Debug)]
pub struct Row {
    /// Scheme name.
    pub scheme: &'static str,
    /// READ or WRITE.
    pub op: &'static str,
    /// prepared or oneshot.
    pub request: &'static str,
    /// contiguous or shuffled.
    pub layout: &'static str,
    /// Block size in bytes.
    pub block_bytes: u64,
    /// Descriptors per request.
    pub batch: u32,
    /// Workers that ran the case.
    pub workers: usize,
    /// Requests per iteration per worker.
    pub requests_per_iter: usize,
    /// Timed iterations per worker.
    pub iters: u32,
    /// 1e9 bytes per second over all workers.
    pub gbps: f64,
    /// Average wall time of one iteration, µs.
    pub lat_avg_us: f64,
    /// Request preparation (prep + make, or create), average and p99, µs.
    pub prep_avg_us: f64,
    /// See `prep_avg_us`.
    pub prep_p99_us: f64,
    /// The post call (telemetry), µs.
    pub post_avg_us: f64,
    /// See `post_avg_us`.
    pub post_p99_us: f64,
    /// Post to completion (telemetry), µs.
    pub xfer_avg_us: f64,
    /// See `xfer_avg_us`.
    pub xfer_p99_us: f64,
    /// Descriptors (before merging) per second over all workers.
    pub descs_per_s: f64,
    /// Ranges per request after merging (telemetry).
    pub ranges: u64,
    /// The backend the requests went through (`Agent::xfer_backend`).
    pub via: &'static str,
    /// `Agent::estimate` of the case's requests (post to completion, average over
    /// them), µs; `None` when no estimate was available.
    pub est_us: Option<f64>,
    /// The estimates' margin (average), µs.
    pub est_margin_us: Option<f64>,
    /// How they were made: `analytical`, `measured`, `mixed`, or empty (none).
    pub est_method: &'static str,
    /// Byte check result (None: not asked for).
    pub check: Option<bool>,
}

/// Everything a sweep produced.
pub struct SweepRun {
    /// Rows in case order.
    pub rows: Vec<Row>,
    /// How the run was configured, as (key, value) pairs (printed and written out).
    pub config: Vec<(String, String)>,
    /// Each initiator agent's metrics at the end of the run, by agent name.
    pub metrics: Vec<(String, ferry::metrics::MetricsSnapshot)>,
    /// Cases the sweep had.
    pub cases: usize,
    /// Why the sweep ended before its last case (interrupted, or a case failed):
    /// `rows` holds the cases finished before it.
    pub stopped: Option<String>,
}

/// A target as one worker sees it.
#[derive(Clone, Copy, Debug)]
pub struct Remote {
    /// The peer (or Local for POSIX's file).
    pub side: Side,
    /// Its memory kind.
    pub kind: MemKind,
    /// Address (or file offset) of its buffer.
    pub base: u64,
    /// Device id of its buffer.
    pub dev: u64,
    /// Its buffer's length.
    pub len: u64,
}

/// One initiator: its agent, its memory, and the targets it knows. The agent is
/// declared first so that it is dropped before the memory it registered.
pub struct Worker {
    agent: Agent,
    local: Memory,
    remotes: Vec<Remote>,
}

/// What must outlive the workers: in-process target agents, the target process.
pub enum Targets {
    /// LOOPBACK: target agents of this process (each before its buffer).
    Local {
        /// Kept for their drop, after the workers'.
        _agents: Vec<(Agent, Memory)>,
    },
    /// UCX: the targets' process (when spawned here) and the store.
    Remote(target::Peers),
    /// POSIX: the run's files, listed in [`TARGET_FILES`] and deleted at the end.
    Files,
    /// OBJ: objects of the workers' own (left in the bucket).
    Objects,
}

impl Drop for Targets {
    fn drop(&mut self) {
        if let Targets::Files = self {
            remove_target_files();
        }
    }
}

/// Workers, then what they depend on (fields drop in this order).
pub struct Setup {
    /// The initiators.
    pub workers: Vec<Worker>,
    /// The targets.
    pub targets: Targets,
}

fn err(e: ferry::Error) -> String {
    e.to_string()
}

/// The `--param`s of backend type `backend`: `TYPE.key=value` goes to that type only; an
/// unprefixed key goes to the named backend, or with `--backend default` to UCX.
fn params_of(plan: &Plan, backend: &str) -> Params {
    let unprefixed_to = match plan.args.backend {
        BackendArg::Default => "UCX",
        other => other.name(),
    };
    plan.args
        .params
        .iter()
        .filter_map(|(k, v)| match k.split_once('.') {
            Some((ty, key)) if ty.eq_ignore_ascii_case(backend) => {
                Some((key.to_string(), v.clone()))
            }
            Some(_) => None,
            None => backend
                .eq_ignore_ascii_case(unprefixed_to)
                .then(|| (k.clone(), v.clone())),
        })
        .collect()
}

/// An agent with `plan`'s backend (or the default set), named `name`.
pub fn agent(plan: &Plan, name: &str) -> Result<Agent, String> {
    let agent = Agent::new(AgentConfig::named(name)).map_err(err)?;
    match plan.args.backend {
        BackendArg::Default => {
            agent
                .create_default_backends(|ty| params_of(plan, ty))
                .map_err(|e| format!("creating the default backends: {e}"))?;
        }
        other => {
            agent
                .create_backend(other.name(), &params_of(plan, other.name()))
                .map_err(|e| format!("creating the {} backend: {e}", other.name()))?;
        }
    }
    Ok(agent)
}

/// Worker `i`'s name.
pub fn initiator_name(plan: &Plan, i: usize) -> String {
    format!("{}-initiator-{i}", plan.args.run_id)
}

/// A named backend that this build lacks or that cannot run here is refused before
/// anything starts, with the reason (`ferry backends` shows the same).
fn available(backend: BackendArg) -> Result<(), String> {
    if backend == BackendArg::Default {
        return Ok(());
    }
    let name = backend.name();
    match ferry::Agent::available_backends()
        .into_iter()
        .find(|b| b.name == name)
        .map(|b| b.available)
    {
        Some(Ok(())) => Ok(()),
        Some(Err(why)) => Err(format!("{name} is unavailable here: {why}")),
        None => Err(format!("this build has no {name} backend")),
    }
}

fn setup(plan: &Plan) -> Result<Setup, String> {
    if plan.args.backend.two_processes() {
        // Before the target process starts. (A file backend's own parameters, GDS's
        // `cufile_library`, can make it available: its creation says why it fails.)
        available(plan.args.backend)?;
    }
    let n = plan.threads();
    let mut workers = Vec::with_capacity(n);
    let targets = match plan.args.backend.shape() {
        Shape::InProcess => {
            let mut targets = Vec::with_capacity(n);
            for k in 0..n {
                let a = agent(plan, &target::target_name(plan, k))?;
                let b = registered(&a, plan.target_placement(), plan.buffer_bytes(k))?;
                targets.push((a, b));
            }
            for i in 0..n {
                let a = agent(plan, &initiator_name(plan, i))?;
                let local = registered(&a, plan.initiator_placement(), plan.buffer_bytes(i))?;
                let mut remotes = Vec::with_capacity(n);
                for (t, buf) in &targets {
                    let peer = a.load_remote_md(&t.local_md().map_err(err)?).map_err(err)?;
                    remotes.push(Remote {
                        side: peer.into(),
                        kind: MemKind::Dram,
                        base: buf.addr(),
                        dev: 0,
                        len: buf.len() as u64,
                    });
                }
                workers.push(Worker {
                    agent: a,
                    local,
                    remotes,
                });
            }
            Targets::Local { _agents: targets }
        }
        Shape::OwnFile => {
            let dir = plan
                .args
                .file_dir
                .clone()
                .unwrap_or_else(std::env::temp_dir);
            // Each file is in the guard from the moment it exists, so a set-up that
            // fails after it (an agent or a registration refused) removes it too.
            let files = Targets::Files;
            for i in 0..n {
                let path = dir.join(format!("ferry-bench-xfer-{}-{i}.bin", std::process::id()));
                let len = plan.buffer_bytes(i);
                let made = std::fs::File::create(&path);
                if made.is_ok() {
                    TARGET_FILES
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(path.clone());
                }
                made.and_then(|f| f.set_len(len))
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                let a = agent(plan, &initiator_name(plan, i))?;
                let local = registered(&a, plan.initiator_placement(), len)?;
                let mode = FileMode {
                    write: true,
                    ..FileMode::default()
                };
                a.register_file(&path, mode, Desc::new(0, 0, 1))
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                workers.push(Worker {
                    agent: a,
                    local,
                    remotes: vec![Remote {
                        side: Side::Local,
                        kind: MemKind::File,
                        base: 0,
                        dev: 1,
                        len,
                    }],
                });
            }
            files
        }
        Shape::OwnObjects => {
            for i in 0..n {
                let a = agent(plan, &initiator_name(plan, i))?;
                let len = plan.buffer_bytes(i);
                let local = registered(&a, plan.initiator_placement(), len)?;
                workers.push(Worker {
                    agent: a,
                    local,
                    // Objects are registered per case (`lists`): one per block slot,
                    // their ids `dev | block << 20 | slot`.
                    remotes: vec![Remote {
                        side: Side::Local,
                        kind: MemKind::Object,
                        base: 0,
                        dev: (i as u64) << 56,
                        len,
                    }],
                });
            }
            Targets::Objects
        }
        Shape::TwoProcesses => {
            let peers = target::connect(plan)?;
            for i in 0..n {
                let a = agent(plan, &initiator_name(plan, i))?;
                let local = registered(&a, plan.initiator_placement(), plan.buffer_bytes(i))?;
                let mut remotes = Vec::with_capacity(n);
                for t in &peers.targets {
                    let peer = a.load_remote_md_as(&t.name, &t.blob).map_err(err)?;
                    remotes.push(Remote {
                        side: peer.into(),
                        kind: plan.target_kind,
                        base: t.base,
                        dev: t.dev,
                        len: t.len,
                    });
                }
                workers.push(Worker {
                    agent: a,
                    local,
                    remotes,
                });
            }
            Targets::Remote(peers)
        }
    };
    Ok(Setup { workers, targets })
}

/// One case of the sweep.
#[derive(Clone, Copy, Debug)]
struct Case {
    scheme: Scheme,
    op: OpArg,
    request: RequestMode,
    layout: Layout,
    block: u64,
    batch: u32,
    seed: u64,
}

/// (target index, offset in the worker's buffer, offset in the target's buffer).
type Link = (usize, u64, u64);

fn links(plan: &Plan, scheme: Scheme, worker: usize) -> Vec<Link> {
    let n = plan.threads();
    let area = plan.area_bytes;
    match scheme {
        // A POSIX worker's one target is its own file.
        Scheme::Pairwise
            if matches!(
                plan.args.backend.shape(),
                Shape::OwnFile | Shape::OwnObjects
            ) =>
        {
            vec![(0, 0, 0)]
        }
        Scheme::Pairwise => vec![(worker, 0, 0)],
        Scheme::ManyToOne => vec![(0, 0, worker as u64 * area)],
        Scheme::OneToMany if worker == 0 => (0..n).map(|j| (j, j as u64 * area, 0)).collect(),
        Scheme::OneToMany => Vec::new(),
    }
}

/// What one worker measured in one case.
#[derive(Default)]
struct Samples {
    bytes: u64,
    descs: u64,
    elapsed: Duration,
    prep: Vec<Duration>,
    post: Vec<Duration>,
    xfer: Vec<Duration>,
    ranges: u64,
    /// The backend the case's requests went through.
    via: &'static str,
    estimates: Vec<CostEstimate>,
    check: Option<bool>,
}

/// The descriptor lists of one link: local and remote.
struct Lists {
    local: Vec<Desc>,
    remote: Vec<Desc>,
    remote_side: Side,
    remote_kind: MemKind,
    /// The worker's memory kind.
    local_kind: MemKind,
    /// Bytes of the local area the lists cover (for the check).
    local_off: u64,
    covered: u64,
}

fn shuffle(v: &mut [u64], seed: u64) {
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
}

fn lists(w: &Worker, plan: &Plan, case: &Case, link: Link) -> Result<Lists, String> {
    let (t, local_off, remote_off) = link;
    let remote = w
        .remotes
        .get(t)
        .ok_or_else(|| format!("target {t} is unknown to the worker"))?;
    let slots = (plan.area_bytes / case.block).max(1);
    let n = u64::from(case.batch).min(slots);
    let mut order: Vec<u64> = (0..n).collect();
    if case.layout == Layout::Shuffled {
        shuffle(&mut order, case.seed ^ 0x5eed);
    }
    let local = (0..u64::from(case.batch))
        .map(|i| {
            Desc::new(
                w.local.addr() + local_off + (i % n) * case.block,
                case.block,
                w.local.dev(),
            )
        })
        .collect();
    let remote_descs = if remote.kind == MemKind::Object {
        object_descs(w, plan, case, remote, &order)?
    } else {
        (0..u64::from(case.batch))
            .map(|i| {
                Desc::new(
                    remote.base + remote_off + order[(i % n) as usize] * case.block,
                    case.block,
                    remote.dev,
                )
            })
            .collect()
    };
    if remote_off + n * case.block > remote.len {
        return Err(format!(
            "target {t}'s buffer ({} bytes) is too small for this case",
            remote.len
        ));
    }
    Ok(Lists {
        local,
        remote: remote_descs,
        remote_side: remote.side,
        remote_kind: remote.kind,
        local_kind: w.local.kind(),
        local_off,
        covered: n * case.block,
    })
}

/// OBJ: one object per block slot (a WRITE replaces a whole object), registered with
/// the worker's agent the first time a case names it; descriptor i is slot `order[i]`'s
/// object, from its first byte.
fn object_descs(
    w: &Worker,
    plan: &Plan,
    case: &Case,
    remote: &Remote,
    order: &[u64],
) -> Result<Vec<Desc>, String> {
    if case.block >= 1 << 36 || order.len() as u64 >= 1 << 20 {
        return Err("OBJ: blocks of 64 GiB or more, or over 2^20 slots, have no object ids".into());
    }
    let id = |slot: u64| remote.dev | case.block << 20 | slot;
    for &slot in order {
        let name = format!("ferry-bench/{}/{:x}", plan.args.run_id, id(slot));
        match w.agent.register_object(&name, Desc::new(0, 0, id(slot))) {
            Ok(_) | Err(ferry::Error::NotAllowed { .. }) => {} // new, or registered before
            Err(e) => return Err(format!("registering object {name}: {e}")),
        }
    }
    let n = order.len();
    Ok((0..case.batch as usize)
        .map(|i| Desc::new(0, case.block, id(order[i % n])))
        .collect())
}

fn wait_all(agent: &Agent, xs: &[XferId], done: &mut [bool]) -> Result<(), String> {
    loop {
        if stopping() {
            return Err(INTERRUPTED.into());
        }
        let mut left = 0;
        for (k, &x) in xs.iter().enumerate() {
            if !done[k] {
                match agent.check(x).map_err(err)? {
                    XferStatus::Done => done[k] = true,
                    _ => left += 1,
                }
            }
        }
        if left == 0 {
            return Ok(());
        }
    }
}

/// Post every request and wait for all.
fn post_all(agent: &Agent, xs: &[XferId], done: &mut [bool]) -> Result<(), String> {
    for (k, &x) in xs.iter().enumerate() {
        done[k] = agent.post(x).map_err(err)? == XferStatus::Done;
    }
    wait_all(agent, xs, done)
}

fn one_shot(agent: &Agent, op: Op, l: &Lists) -> Result<(), String> {
    let x = agent
        .create(
            op,
            l.local_kind,
            &l.local,
            l.remote_side,
            l.remote_kind,
            &l.remote,
            None,
        )
        .map_err(err)?;
    let mut done = [false];
    let r = post_all(agent, &[x], &mut done);
    agent.release(x).map_err(err)?;
    r
}

/// `Agent::estimate` for every request of one iteration: the prepared ones, or (one-shot)
/// requests made from the lists for the purpose and released again. Untimed. Empty when
/// the agent has no estimate yet (no completed request: `NoTelemetry`).
fn estimates(
    agent: &Agent,
    op: Op,
    lists: &[Lists],
    prepared: &[XferId],
) -> Result<Vec<CostEstimate>, String> {
    let mut out = Vec::with_capacity(lists.len());
    for (k, l) in lists.iter().enumerate() {
        let (x, temporary) = match prepared.get(k) {
            Some(&x) => (x, false),
            None => {
                let x = agent
                    .create(
                        op,
                        MemKind::Dram,
                        &l.local,
                        l.remote_side,
                        l.remote_kind,
                        &l.remote,
                        None,
                    )
                    .map_err(err)?;
                (x, true)
            }
        };
        let e = agent.estimate(x);
        if temporary {
            agent.release(x).map_err(err)?;
        }
        match e {
            Ok(e) => out.push(e),
            Err(ferry::Error::NoTelemetry { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(format!("estimating a request: {e}")),
        }
    }
    Ok(out)
}

fn run_case(
    w: &Worker,
    plan: &Plan,
    case: &Case,
    my: &[Link],
    barrier: &Barrier,
) -> Result<Samples, String> {
    // Set-up errors still reach the barrier, so no other worker waits forever.
    let ready = prepare_case(w, plan, case, my);
    barrier.wait();
    let (lists, prepared, prep_once) = ready?;
    let op = case.op.op();
    let agent = &w.agent;
    let mut s = Samples::default();
    s.prep.extend(prep_once);
    // The backend is chosen at make: read it once, outside the timed iterations.
    s.via = prepared
        .first()
        .and_then(|&x| agent.xfer_backend(x).ok())
        .unwrap_or("");
    let mut done = vec![false; lists.len()];
    let mut xs: Vec<XferId> = prepared.clone();
    let bytes_per_iter: u64 = lists
        .iter()
        .map(|l| l.local.len() as u64 * case.block)
        .sum();
    let descs_per_iter: u64 = lists.iter().map(|l| l.local.len() as u64).sum();
    let total = plan.args.warmup + plan.args.iters;
    let mut started = Instant::now();
    for it in 0..total {
        if stopping() {
            return Err(INTERRUPTED.into());
        }
        if it == plan.args.warmup {
            // The estimate, before the timed iterations (the measured model has seen
            // the earlier cases and this one's warm-up).
            s.estimates = estimates(agent, op, &lists, &prepared)?;
            s.prep.retain(|_| case.request == RequestMode::Prepared);
            s.post.clear();
            s.xfer.clear();
            started = Instant::now();
        }
        if case.request == RequestMode::Oneshot {
            xs.clear();
            for l in &lists {
                let t0 = Instant::now();
                let x = agent
                    .create(
                        op,
                        l.local_kind,
                        &l.local,
                        l.remote_side,
                        l.remote_kind,
                        &l.remote,
                        None,
                    )
                    .map_err(err)?;
                s.prep.push(t0.elapsed());
                xs.push(x);
            }
        }
        post_all(agent, &xs, &mut done)?;
        if s.via.is_empty() {
            // One-shot: the first request made tells.
            s.via = xs
                .first()
                .and_then(|&x| agent.xfer_backend(x).ok())
                .unwrap_or("?");
        }
        for &x in &xs {
            let t = agent.telemetry(x).map_err(err)?;
            s.post.push(t.post_duration);
            s.xfer.push(t.xfer_duration);
            s.ranges = t.desc_count;
        }
        if case.request == RequestMode::Oneshot {
            for &x in &xs {
                agent.release(x).map_err(err)?;
            }
        }
    }
    s.elapsed = started.elapsed();
    if s.estimates.is_empty() {
        // Nothing had completed before the timed iterations (no warm-up in the first
        // case): estimate now.
        s.estimates = estimates(agent, op, &lists, &prepared)?;
    }
    s.bytes = bytes_per_iter * u64::from(plan.args.iters);
    s.descs = descs_per_iter * u64::from(plan.args.iters);
    for &x in &prepared {
        agent.release(x).map_err(err)?;
    }
    if plan.args.check {
        let mut ok = true;
        for l in &lists {
            if case.op == OpArg::Write {
                w.local.zero(l.local_off as usize, l.covered as usize)?;
                one_shot(agent, Op::Read, l)?;
            }
            if let Some(at) = w
                .local
                .verify(l.local_off as usize, l.covered as usize, case.seed)?
            {
                tracing::warn!(
                    "byte check: {} block {} batch {}: first wrong byte at offset {at} of the worker's area",
                    case.op.op(),
                    case.block,
                    case.batch
                );
                ok = false;
            }
        }
        s.check = Some(ok);
    }
    Ok(s)
}

type Prepared = (Vec<Lists>, Vec<XferId>, Vec<Duration>);

fn prepare_case(w: &Worker, plan: &Plan, case: &Case, my: &[Link]) -> Result<Prepared, String> {
    let lists: Vec<Lists> = my
        .iter()
        .map(|&link| lists(w, plan, case, link))
        .collect::<Result<_, _>>()?;
    if plan.args.check {
        for l in &lists {
            w.local
                .fill(l.local_off as usize, l.covered as usize, case.seed)?;
            if case.op == OpArg::Read {
                // Put the pattern there first, then clear our copy: the timed reads
                // must bring it back.
                one_shot(&w.agent, Op::Write, l)?;
                w.local.zero(l.local_off as usize, l.covered as usize)?;
            }
        }
    }
    let mut prepared = Vec::new();
    let mut prep = Vec::new();
    if case.request == RequestMode::Prepared {
        for l in &lists {
            let t0 = Instant::now();
            let lp = w
                .agent
                .prep(Side::Local, l.local_kind, &l.local)
                .map_err(err)?;
            let rp = w
                .agent
                .prep(l.remote_side, l.remote_kind, &l.remote)
                .map_err(err)?;
            let x = w
                .agent
                .make(case.op.op(), lp, &[], rp, &[], None)
                .map_err(err)?;
            prep.push(t0.elapsed());
            // The request keeps what it needs; the lists can go.
            w.agent.release_prep(lp).map_err(err)?;
            w.agent.release_prep(rp).map_err(err)?;
            prepared.push(x);
        }
    }
    Ok((lists, prepared, prep))
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn avg_p99(v: &mut [Duration]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    v.sort_unstable();
    let sum: Duration = v.iter().sum();
    let p99 = v[(v.len() * 99).div_ceil(100).saturating_sub(1)];
    (us(sum) / v.len() as f64, us(p99))
}

fn name_of_scheme(s: Scheme) -> &'static str {
    match s {
        Scheme::Pairwise => "pairwise",
        Scheme::ManyToOne => "many-to-one",
        Scheme::OneToMany => "one-to-many",
    }
}

fn row(case: &Case, plan: &Plan, samples: Vec<Samples>, requests_per_iter: usize) -> Row {
    let workers = samples.len();
    let elapsed = samples
        .iter()
        .map(|s| s.elapsed)
        .max()
        .unwrap_or_default()
        .max(Duration::from_nanos(1));
    let bytes: u64 = samples.iter().map(|s| s.bytes).sum();
    let descs: u64 = samples.iter().map(|s| s.descs).sum();
    let lat = samples.iter().map(|s| us(s.elapsed)).sum::<f64>()
        / workers.max(1) as f64
        / f64::from(plan.args.iters);
    let mut prep: Vec<Duration> = samples
        .iter()
        .flat_map(|s| s.prep.iter().copied())
        .collect();
    let mut post: Vec<Duration> = samples
        .iter()
        .flat_map(|s| s.post.iter().copied())
        .collect();
    let mut xfer: Vec<Duration> = samples
        .iter()
        .flat_map(|s| s.xfer.iter().copied())
        .collect();
    let (prep_avg_us, prep_p99_us) = avg_p99(&mut prep);
    let (post_avg_us, post_p99_us) = avg_p99(&mut post);
    let (xfer_avg_us, xfer_p99_us) = avg_p99(&mut xfer);
    let check = if plan.args.check {
        Some(samples.iter().all(|s| s.check == Some(true)))
    } else {
        None
    };
    let ests: Vec<&CostEstimate> = samples.iter().flat_map(|s| &s.estimates).collect();
    let mean = |f: fn(&CostEstimate) -> Duration| {
        (!ests.is_empty()).then(|| ests.iter().map(|e| us(f(e))).sum::<f64>() / ests.len() as f64)
    };
    let est_method = match ests.first().map(|e| e.method) {
        None => "",
        Some(m) if ests.iter().any(|e| e.method != m) => "mixed",
        Some(CostMethod::Analytical) => "analytical",
        Some(CostMethod::Measured) => "measured",
    };
    Row {
        scheme: name_of_scheme(case.scheme),
        op: match case.op {
            OpArg::Read => "READ",
            OpArg::Write => "WRITE",
        },
        request: match case.request {
            RequestMode::Prepared => "prepared",
            RequestMode::Oneshot => "oneshot",
        },
        layout: match case.layout {
            Layout::Contiguous => "contiguous",
            Layout::Shuffled => "shuffled",
        },
        block_bytes: case.block,
        batch: case.batch,
        workers,
        requests_per_iter,
        iters: plan.args.iters,
        gbps: bytes as f64 / elapsed.as_secs_f64() / 1e9,
        lat_avg_us: lat,
        prep_avg_us,
        prep_p99_us,
        post_avg_us,
        post_p99_us,
        xfer_avg_us,
        xfer_p99_us,
        descs_per_s: descs as f64 / elapsed.as_secs_f64(),
        ranges: samples.first().map_or(0, |s| s.ranges),
        via: samples.first().map_or("", |s| s.via),
        est_us: mean(|e| e.duration),
        est_margin_us: mean(|e| e.margin),
        est_method,
        check,
    }
}

fn cases(plan: &Plan) -> Vec<Case> {
    let a = &plan.args;
    let mut v = Vec::new();
    for &scheme in &a.scheme {
        for &op in &a.op {
            for &request in &a.request {
                for &layout in &a.layout {
                    for &block in &plan.blocks {
                        for &batch in &plan.batches {
                            let seed = 0x1000 + v.len() as u64;
                            v.push(Case {
                                scheme,
                                op,
                                request,
                                layout,
                                block,
                                batch,
                                seed,
                            });
                        }
                    }
                }
            }
        }
    }
    v
}

fn describe(plan: &Plan, setup: &Setup) -> Vec<(String, String)> {
    let a = &plan.args;
    let mut c = vec![
        ("backend".to_string(), a.backend.name().to_string()),
        (
            "initiator".to_string(),
            format!(
                "{} ({} workers)",
                plan.initiator_placement().describe(),
                a.threads
            ),
        ),
        (
            "target".to_string(),
            match plan.target_kind {
                MemKind::File | MemKind::Object => plan.target_kind.name().to_string(),
                _ => plan.target_placement().describe(),
            },
        ),
        (
            "placement".to_string(),
            match (&setup.targets, a.backend) {
                (Targets::Remote(p), _) => p.placement.clone(),
                (_, b) if b.shape() == Shape::OwnFile => "files of this process".to_string(),
                (_, b) if b.shape() == Shape::OwnObjects => "objects of each worker".to_string(),
                _ => "agents of this process".to_string(),
            },
        ),
        (
            "iters".to_string(),
            format!("{} (+{} warm-up)", a.iters, a.warmup),
        ),
        (
            "buffer".to_string(),
            format!("{} per worker", crate::args::human_bytes(plan.area_bytes)),
        ),
    ];
    if !a.params.is_empty() {
        // Secrets (OBJ's secret_key, session_token) are shown masked.
        let p: Vec<String> = a
            .params
            .iter()
            .map(|(k, v)| match k.as_str() {
                "secret_key" | "session_token" => format!("{k}=***"),
                _ => format!("{k}={v}"),
            })
            .collect();
        c.push(("params".to_string(), p.join(",")));
    }
    if let Some(b) = setup.workers.first().and_then(|w| {
        let all = w.agent.backends();
        if a.backend == BackendArg::Default {
            let names: Vec<&str> = all.iter().map(|b| b.name).collect();
            c.push(("backends".to_string(), names.join(", ")));
        }
        all.into_iter()
            .find(|b| a.backend != BackendArg::Default || b.name == "UCX")
    }) {
        let effective: Vec<String> = b
            .params
            .iter()
            .filter(|(k, _)| {
                [
                    "transports",
                    "engine",
                    "error_handling",
                    "progress_thread",
                    "peer_timeout_ms",
                ]
                .contains(&k.as_str())
            })
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        if !effective.is_empty() {
            let label = if a.backend == BackendArg::Default {
                "UCX params"
            } else {
                "backend params"
            };
            c.push((label.to_string(), effective.join(",")));
        }
    }
    for var in ["UCX_TLS", "UCX_NET_DEVICES"] {
        if let Ok(v) = std::env::var(var) {
            if a.backend.has_ucx() {
                c.push((var.to_string(), v));
            }
        }
    }
    c
}

/// Run the sweep `plan` describes (the initiator side), handing each row to `out` as
/// soon as its case is measured. A set-up failure is an error; a case that fails or is
/// interrupted ends the sweep with the rows finished before it (`stopped` says why).
pub fn run(plan: &Plan, out: &mut Outputs) -> Result<SweepRun, String> {
    let setup = setup(plan)?;
    let config = describe(plan, &setup);
    let cases = cases(plan);
    out.begin(&config);
    let bar = crate::progress::bar(cases.len() as u64, "bench xfer");
    let mut rows = Vec::with_capacity(cases.len());
    let mut stopped = None;
    for case in &cases {
        if stopping() {
            stopped = Some(INTERRUPTED.to_string());
            break;
        }
        bar.set_message(format!(
            "{} {} {}",
            case.op.op(),
            crate::args::human_bytes(case.block),
            case.batch
        ));
        let active: Vec<(usize, Vec<Link>)> = (0..plan.threads())
            .map(|i| (i, links(plan, case.scheme, i)))
            .filter(|(_, l)| !l.is_empty())
            .collect();
        let barrier = Barrier::new(active.len());
        let samples: Vec<Result<Samples, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = active
                .iter()
                .map(|(i, my)| {
                    let w = &setup.workers[*i];
                    let barrier = &barrier;
                    s.spawn(move || run_case(w, plan, case, my, barrier))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("a worker panicked".into())))
                .collect()
        });
        let samples = match samples
            .into_iter()
            .collect::<Result<Vec<Samples>, String>>()
        {
            Ok(s) => s,
            Err(e) => {
                // A failure seen after a stop request is the stop's doing (the target's
                // Ctrl-C, say, reaches it first).
                stopped = Some(if stopping() || e == INTERRUPTED {
                    INTERRUPTED.to_string()
                } else {
                    format!(
                        "{} block {} batch {} failed: {e}",
                        case.op.op(),
                        crate::args::human_bytes(case.block),
                        case.batch
                    )
                });
                break;
            }
        };
        let per_iter = active.first().map_or(0, |(_, l)| l.len());
        let row = row(case, plan, samples, per_iter);
        let written = bar.suspend(|| out.row(&row));
        rows.push(row);
        bar.inc(1);
        if let Err(e) = written {
            stopped = Some(e);
            break;
        }
    }
    bar.finish_and_clear();
    // Tell the targets (if remote) that we are done, whatever happened.
    if let Targets::Remote(_) = &setup.targets {
        if let Some(w) = setup.workers.first() {
            for r in &w.remotes {
                if let Err(e) = w.agent.notify(r.side, DONE_NOTIFICATION) {
                    tracing::warn!("telling a target we are done: {e}");
                }
            }
            // Deliver the notifications before the agents go.
            let until = Instant::now() + Duration::from_millis(200);
            while Instant::now() < until {
                w.agent.progress();
            }
        }
    }
    let metrics = setup
        .workers
        .iter()
        .enumerate()
        .map(|(i, w)| (initiator_name(plan, i), w.agent.metrics()))
        .collect();
    Ok(SweepRun {
        rows,
        config,
        metrics,
        cases: cases.len(),
        stopped,
    })
}
