//! An opt-in Prometheus endpoint (feature `prometheus`): `GET /metrics` answers the
//! metrics of every live agent of the process in the OpenMetrics text format (encoded
//! with `prometheus-client`; Prometheus scrapes it), labelled by `agent` (and `backend` or `kind`).
//!
//! Started by [`serve`], or by the first [`Agent::new`](crate::Agent::new) when
//! `FERRY_METRICS_LISTEN` is set: `PORT` listens on `127.0.0.1:PORT` (loopback by
//! default), `HOST:PORT` where given, `off` or empty not at all. One thread serves one
//! connection at a time, with a 2 s deadline for reading the request and for writing the
//! answer; requests are at most 8 KiB. Nothing here touches the transfer path: a scrape
//! reads the agents' counters, it never takes an agent's lock.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `ferry_requests_posted_total` | counter | agent, backend |
//! | `ferry_bytes_posted_total` | counter | agent, backend |
//! | `ferry_descriptors_posted_total` | counter | agent, backend |
//! | `ferry_requests_completed_total` | counter | agent, backend |
//! | `ferry_requests_failed_total` | counter | agent, backend |
//! | `ferry_requests_refused_total` | counter | agent, backend |
//! | `ferry_request_latency_seconds` | histogram (post→complete) | agent, backend |
//! | `ferry_errors_total` | counter | agent, kind |
//! | `ferry_flushes_total` | counter | agent |
//! | `ferry_peers` | gauge | agent |
//! | `ferry_exchange_{fetches,fetch_failures,loads,load_failures,invalidations,send_failures}_total` | counter | agent |

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use ferry_storage::{Error, Result, Subject};

use crate::metrics::{bucket_upper, Metrics, MetricsSnapshot, LATENCY_BUCKETS};

/// The environment variable that starts the endpoint with the first agent.
pub const LISTEN_VAR: &str = "FERRY_METRICS_LISTEN";
/// What `prometheus-client`'s text encoder writes: the OpenMetrics text format (which
/// Prometheus reads; it ends with `# EOF`).
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Largest request head read.
const REQUEST_BYTES_MAX: usize = 8 * 1024;
/// Deadline for reading a request and for writing its answer.
const IO_DEADLINE: Duration = Duration::from_secs(2);

/// Agents by name with their metrics.
type AgentList = Mutex<Vec<(String, Weak<Metrics>)>>;

/// Live agents' metrics, by name (pruned at each scrape).
fn agents() -> &'static AgentList {
    static AGENTS: OnceLock<AgentList> = OnceLock::new();
    AGENTS.get_or_init(Default::default)
}

/// Called by `Agent::new`: list the agent and start the endpoint if the environment
/// asks for it (once per process; a failure is logged, the agent works on).
pub(crate) fn agent_created(name: &str, metrics: &Arc<Metrics>) {
    agents()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((name.to_owned(), Arc::downgrade(metrics)));
    FROM_ENV.get_or_init(|| {
        let value = std::env::var(LISTEN_VAR).ok()?;
        let listen = match parse_listen(&value) {
            Ok(Some(listen)) => listen,
            Ok(None) => return None,
            Err(e) => {
                log::warn!("{LISTEN_VAR}: {e}; no metrics endpoint");
                return None;
            }
        };
        match serve(listen) {
            Ok(server) => {
                log::info!("metrics endpoint on http://{}/metrics", server.local_addr());
                Some(server)
            }
            Err(e) => {
                log::warn!("metrics endpoint on {listen}: {e}");
                None
            }
        }
    });
}

/// The endpoint `FERRY_METRICS_LISTEN` started, if any.
static FROM_ENV: OnceLock<Option<MetricsServer>> = OnceLock::new();

/// Where the endpoint started from `FERRY_METRICS_LISTEN` listens (`None` before the
/// first agent, or when the variable is unset, `off` or did not work).
pub fn env_server_addr() -> Option<SocketAddr> {
    FROM_ENV.get()?.as_ref().map(MetricsServer::local_addr)
}

/// `PORT` (loopback), `HOST:PORT`, or `off`/empty (none).
pub fn parse_listen(value: &str) -> Result<Option<SocketAddr>> {
    let value = value.trim();
    if value.is_empty() || value == "off" {
        return Ok(None);
    }
    let bad = |why: String| Error::invalid(Subject::Named(LISTEN_VAR.into()), why);
    if let Ok(port) = value.parse::<u16>() {
        return Ok(Some(SocketAddr::from(([127, 0, 0, 1], port))));
    }
    value
        .to_socket_addrs()
        .map_err(|e| bad(format!("'{value}': {e} (expected PORT or HOST:PORT)")))?
        .next()
        .map(Some)
        .ok_or_else(|| bad(format!("'{value}' resolves to no address")))
}

/// A running endpoint; stopped (thread joined) on drop.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Serve `GET /metrics` on `listen` (port 0: any free port) for every live agent.
pub fn serve(listen: SocketAddr) -> Result<MetricsServer> {
    let io = |what: &str, e: std::io::Error| Error::Backend {
        backend: "metrics".into(),
        errno: e.raw_os_error().unwrap_or(0),
        desc: None,
        detail: format!("{what} {listen}: {e}").into(),
    };
    let listener = TcpListener::bind(listen).map_err(|e| io("binding", e))?;
    let addr = listener.local_addr().map_err(|e| io("reading", e))?;
    let stop = Arc::new(AtomicBool::new(false));
    let thread_stop = stop.clone();
    let thread = std::thread::Builder::new()
        .name("ferry-metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                if thread_stop.load(Ordering::Acquire) {
                    break;
                }
                if let Ok(conn) = conn {
                    answer(conn);
                }
            }
        })
        .map_err(|e| io("spawning the server of", e))?;
    Ok(MetricsServer {
        addr,
        stop,
        thread: Some(thread),
    })
}

fn answer(mut conn: TcpStream) {
    let deadline = Instant::now() + IO_DEADLINE;
    let mut head = [0u8; REQUEST_BYTES_MAX];
    let mut len = 0;
    while !head[..len].windows(4).any(|w| w == b"\r\n\r\n") {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || len == head.len() || conn.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match conn.read(&mut head[len..]) {
            Ok(0) | Err(_) => return,
            Ok(n) => len += n,
        }
    }
    let line = head[..len].split(|&b| b == b'\r').next().unwrap_or(&[]);
    let mut words = line.split(|&b| b == b' ');
    let (method, path) = (words.next(), words.next());
    let (status, body) = match (method, path) {
        (Some(b"GET"), Some(p)) if p == b"/metrics" || p.starts_with(b"/metrics?") => {
            ("200 OK", render())
        }
        (Some(b"GET"), _) => ("404 Not Found", "try /metrics\n".to_string()),
        _ => ("405 Method Not Allowed", "GET only\n".to_string()),
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = conn.set_write_timeout(Some(IO_DEADLINE));
    let _ = conn.write_all(reply.as_bytes());
}

/// The text every scrape gets: all live agents.
pub fn render() -> String {
    let snapshots: Vec<(String, MetricsSnapshot)> = {
        let mut list = agents().lock().unwrap_or_else(|e| e.into_inner());
        list.retain(|(_, m)| m.strong_count() > 0);
        list.iter()
            .filter_map(|(name, m)| Some((name.clone(), m.upgrade()?.snapshot())))
            .collect()
    };
    render_snapshots(snapshots)
}

/// Encode `snapshots` (agent name, snapshot) in the Prometheus text format.
pub fn render_snapshots(snapshots: Vec<(String, MetricsSnapshot)>) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshots(snapshots)));
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &registry).is_err() {
        out = "# encoding failed\n".into();
    }
    out
}

#[derive(Debug)]
struct Snapshots(Vec<(String, MetricsSnapshot)>);

/// A counter value for the encoder.
#[derive(Debug)]
struct Count(u64, MetricType);

impl EncodeMetric for Count {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::MetricEncoder,
    ) -> std::result::Result<(), std::fmt::Error> {
        match self.1 {
            MetricType::Gauge => encoder.encode_gauge(&self.0),
            _ => encoder.encode_counter::<NoLabelSet, _, u64>(&self.0, None),
        }
    }
    fn metric_type(&self) -> MetricType {
        self.1
    }
}

impl Collector for Snapshots {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::result::Result<(), std::fmt::Error> {
        type Field = fn(&crate::metrics::BackendMetrics) -> u64;
        let per_backend: [(&str, &str, Field); 6] = [
            ("ferry_requests_posted", "requests posted", |b| b.posted),
            ("ferry_bytes_posted", "bytes of posted requests", |b| {
                b.bytes
            }),
            (
                "ferry_descriptors_posted",
                "descriptors of posted requests, after merging",
                |b| b.descriptors,
            ),
            (
                "ferry_requests_completed",
                "requests completed successfully",
                |b| b.completed,
            ),
            (
                "ferry_requests_failed",
                "requests failed after their post",
                |b| b.failed,
            ),
            (
                "ferry_requests_refused",
                "posts refused by the backend",
                |b| b.refused,
            ),
        ];
        for (name, help, field) in per_backend {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (agent, s) in &self.0 {
                for b in &s.backends {
                    let labels = [("agent", agent.as_str()), ("backend", b.name)];
                    Count(field(b), MetricType::Counter).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        {
            let mut family = encoder.encode_descriptor(
                "ferry_request_latency_seconds",
                "request latency from post to completion",
                None,
                MetricType::Histogram,
            )?;
            for (agent, s) in &self.0 {
                for b in &s.backends {
                    let labels = [("agent", agent.as_str()), ("backend", b.name)];
                    let buckets: Vec<(f64, u64)> = (0..LATENCY_BUCKETS)
                        .map(|i| {
                            let upper = if i + 1 == LATENCY_BUCKETS {
                                f64::INFINITY
                            } else {
                                bucket_upper(i).as_secs_f64()
                            };
                            (upper, b.latency[i])
                        })
                        .collect();
                    family
                        .encode_family(&labels)?
                        .encode_histogram::<NoLabelSet>(
                            b.latency_sum.as_secs_f64(),
                            b.latency_count(),
                            &buckets,
                            None,
                        )?;
                }
            }
        }
        {
            let mut family = encoder.encode_descriptor(
                "ferry_errors",
                "request errors by kind (refused posts, failed completions)",
                None,
                MetricType::Counter,
            )?;
            for (agent, s) in &self.0 {
                for (kind, n) in &s.errors {
                    let labels = [("agent", agent.as_str()), ("kind", *kind)];
                    Count(*n, MetricType::Counter).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        type AgentField = fn(&MetricsSnapshot) -> u64;
        let per_agent: [(&str, &str, MetricType, AgentField); 8] = [
            ("ferry_flushes", "flushes run", MetricType::Counter, |s| {
                s.flushes
            }),
            (
                "ferry_peers",
                "peers whose metadata is loaded",
                MetricType::Gauge,
                |s| s.peers,
            ),
            (
                "ferry_exchange_fetches",
                "metadata fetches started",
                MetricType::Counter,
                |s| s.fetches,
            ),
            (
                "ferry_exchange_fetch_failures",
                "metadata fetches failed",
                MetricType::Counter,
                |s| s.fetch_failures,
            ),
            (
                "ferry_exchange_loads",
                "exchange metadata loaded",
                MetricType::Counter,
                |s| s.loads,
            ),
            (
                "ferry_exchange_load_failures",
                "exchange metadata refused at load",
                MetricType::Counter,
                |s| s.load_failures,
            ),
            (
                "ferry_exchange_invalidations",
                "peers invalidated through the exchange",
                MetricType::Counter,
                |s| s.invalidations,
            ),
            (
                "ferry_exchange_send_failures",
                "failed sends, publishes and withdrawals",
                MetricType::Counter,
                |s| s.send_failures,
            ),
        ];
        for (name, help, kind, field) in per_agent {
            let mut family = encoder.encode_descriptor(name, help, None, kind)?;
            for (agent, s) in &self.0 {
                let labels = [("agent", agent.as_str())];
                Count(field(s), kind).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_values_parse_or_are_refused() {
        assert_eq!(
            parse_listen("9464").unwrap(),
            Some("127.0.0.1:9464".parse().unwrap())
        );
        assert_eq!(
            parse_listen("0.0.0.0:9000").unwrap(),
            Some("0.0.0.0:9000".parse().unwrap())
        );
        assert_eq!(parse_listen("off").unwrap(), None);
        assert_eq!(parse_listen("").unwrap(), None);
        let e = parse_listen("not an address").unwrap_err();
        assert!(e.to_string().contains(LISTEN_VAR), "{e}");
    }
}
