//! A well-behaved client's latency, and the server's resident memory, while hostile
//! clients attack a TCPStore server and a P2P listener (numbers, not assertions).
//!
//! ```text
//! # the targets, in their own process (so its memory is theirs alone):
//! cargo run --release -p ferry-exchange --example hostile_latency -- serve 127.0.0.1:29600 127.0.0.1:29601
//! # the attacks, each for a few seconds, with a good client measuring:
//! cargo run --release -p ferry-exchange --example hostile_latency -- attack 127.0.0.1:29600 127.0.0.1:29601 PID [SECONDS] [FILTER]
//! ```
//! `serve` runs Ferry's TCPStore server and a P2P listener of agent `target` with
//! default limits (the `FERRY_TCPSTORE_*` variables apply). Each line of `attack`
//! gives the good client's operations, failures, p50/p99/max latency (TCPStore: one
//! request; P2P: one fetch until its metadata arrived), and the target's VmRSS
//! before and at its peak.

#[path = "../tests/attacks/mod.rs"]
mod attacks;
#[path = "../tests/common/mod.rs"]
mod common;

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use attacks::*;
use common::{blob, FakeAgent};
use ferry_exchange::tcpstore::{serve, ServerConfig};
use ferry_exchange::{ExchangeConfig, Manager, Via, FULL_LABEL};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    match arg(0).as_str() {
        "serve" => serve_targets(arg(1).parse().unwrap(), arg(2).parse().unwrap()),
        "attack" => {
            let secs = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(3);
            attack_all(
                arg(1).parse().unwrap(),
                arg(2).parse().unwrap(),
                arg(3).parse().unwrap(),
                Duration::from_secs(secs),
                args.get(5).cloned().unwrap_or_default(),
            );
        }
        _ => eprintln!("usage: hostile_latency serve TCPSTORE_ADDR P2P_ADDR | attack TCPSTORE_ADDR P2P_ADDR PID [SECONDS] [FILTER]"),
    }
}

fn serve_targets(tcpstore: SocketAddr, p2p: SocketAddr) {
    let config = ServerConfig::default().with_env_overrides().unwrap();
    let server = serve(tcpstore, config).unwrap();
    let mut c = ExchangeConfig::default();
    c.p2p.listen = Some(p2p);
    let target = Manager::new("target", c).unwrap();
    target.set_local_md(blob("target", 50_000));
    println!(
        "pid {} tcpstore {} p2p {}",
        std::process::id(),
        server.local_addr(),
        target.p2p_listen_addr().unwrap()
    );
    loop {
        std::thread::park();
    }
}

/// An attack that runs on its own threads until `stop`.
type Attack = Box<dyn FnOnce(Arc<AtomicBool>) -> Vec<JoinHandle<()>>>;

fn looping(f: impl Fn() + Send + 'static) -> Attack {
    Box::new(move |stop: Arc<AtomicBool>| {
        vec![std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                f();
            }
        })]
    })
}

fn holding(f: impl FnOnce() -> Vec<TcpStream> + Send + 'static) -> Attack {
    Box::new(move |stop: Arc<AtomicBool>| {
        vec![std::thread::spawn(move || {
            let held = f();
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(20));
            }
            drop_all(held);
        })]
    })
}

fn attack_all(ts: SocketAddr, p2p: SocketAddr, pid: u32, secs: Duration, filter: String) {
    let tcpstore: Vec<(&str, Attack)> = vec![
        ("none (baseline)", Box::new(|_| Vec::new())),
        (
            "random bytes",
            looping(move || random_bytes(ts, 10, 4096, 7)),
        ),
        (
            "huge length prefixes",
            looping(move || {
                let mut held = huge_length_prefixes(ts, 60 << 20);
                for s in &mut held {
                    closed_within(s, Duration::from_secs(1));
                }
            }),
        ),
        (
            "200 clients that never send",
            holding(move || idle_connections(ts, 200, false)),
        ),
        (
            "500 idle connections",
            holding(move || idle_connections(ts, 500, true)),
        ),
        (
            "20 slow senders (1 byte / 100 ms)",
            Box::new(move |stop: Arc<AtomicBool>| {
                (0..20)
                    .map(|_| {
                        let stop = stop.clone();
                        std::thread::spawn(move || {
                            while !stop.load(Ordering::Acquire) {
                                slow_sender(ts, 1000, Duration::from_millis(100));
                            }
                        })
                    })
                    .collect()
            }),
        ),
        (
            "APPEND loop (64 KiB)",
            looping(move || {
                append_loop(ts, 64 << 10, 200);
            }),
        ),
        (
            "WAIT with 100,000 keys (x4)",
            holding(move || {
                (0..4)
                    .filter_map(|i| wait_many_keys(ts, 100_000, &format!("w{i}")))
                    .collect()
            }),
        ),
        (
            "MULTI_GET of a 1 MiB key 10,000 times",
            looping(move || {
                multi_get_same(ts, b"/big", 1 << 20, 10_000);
            }),
        ),
        (
            "issue: 1,100 idle connections",
            holding(move || idle_connections(ts, 1100, true)),
        ),
        (
            "issue: 6 KB MULTI_GET naming a 1 MiB value 512 times",
            looping(move || {
                multi_get_same(ts, b"/v", 1 << 20, 512);
            }),
        ),
    ];
    println!("| TCPStore attack | good client ops | failures | p50 | p99 | max | server VmRSS before → peak |");
    println!("|---|---|---|---|---|---|---|");
    for (name, attack) in tcpstore {
        if !name.contains(filter.as_str()) {
            continue;
        }
        let before = proc_status_kib(Some(pid), "VmRSS:").unwrap_or(0);
        let sampler = RssSampler::start(Some(pid));
        let stop = Arc::new(AtomicBool::new(false));
        let threads = attack(stop.clone());
        // Let the attack take hold before measuring.
        std::thread::sleep(Duration::from_millis(500));
        let good = GoodClient::start(ts, "latency", 50);
        std::thread::sleep(secs);
        let report = good.finish();
        stop.store(true, Ordering::Release);
        for t in threads {
            let _unused = t.join();
        }
        let peak = sampler.finish();
        println!(
            "| {name} | {} | {} | {} us | {} us | {} us | {} → {} MiB |",
            report.ops,
            report.failures.len(),
            report.percentile_us(0.5),
            report.percentile_us(0.99),
            report.percentile_us(1.0),
            before / 1024,
            peak / 1024
        );
        if let Some(f) = report.failures.first() {
            println!("|   first failure: {f} | | | | | | |");
        }
        std::thread::sleep(Duration::from_millis(500));
    }

    let p2p_attacks: Vec<(&str, Attack)> = vec![
        ("none (baseline)", Box::new(|_| Vec::new())),
        (
            "issue: 70 connections trickling 1 byte / 2 s",
            Box::new(move |stop: Arc<AtomicBool>| {
                (0..70)
                    .map(|_| {
                        let stop = stop.clone();
                        std::thread::spawn(move || {
                            while !stop.load(Ordering::Acquire) {
                                for t in p2p_trickle(p2p, 1, Duration::from_secs(2)) {
                                    let _unused = t.join();
                                }
                            }
                        })
                    })
                    .collect()
            }),
        ),
        (
            "issue: 16 connections announcing 64 MiB frames (48 MiB sent)",
            holding(move || p2p_big_frames(p2p, 16, 64 << 20, 48 << 20)),
        ),
        (
            "500 idle connections",
            holding(move || idle_connections(p2p, 500, false)),
        ),
    ];
    println!();
    println!(
        "| P2P attack | good fetches | failures | p50 | p99 | max | target VmRSS before → peak |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (name, attack) in p2p_attacks {
        if !name.contains(filter.as_str()) {
            continue;
        }
        let before = proc_status_kib(Some(pid), "VmRSS:").unwrap_or(0);
        let sampler = RssSampler::start(Some(pid));
        let stop = Arc::new(AtomicBool::new(false));
        let threads = attack(stop.clone());
        std::thread::sleep(Duration::from_millis(1000));
        let mut good = FakeAgent::new("good", ExchangeConfig::default());
        let md = blob("target", 50_000);
        let (mut lat, mut failures) = (Vec::new(), 0usize);
        let end = Instant::now() + secs;
        while Instant::now() < end {
            good.peers.clear();
            good.fetch_failures.clear();
            let t = Instant::now();
            good.manager
                .fetch_remote_md("target", Via::Peer(p2p), None)
                .unwrap();
            // Pumped every 20 us (FakeAgent::pump_until sleeps 2 ms between pumps).
            let give_up = Instant::now() + Duration::from_secs(10);
            let ok = loop {
                good.pump();
                if good.md("target", FULL_LABEL) == Some(&md[..]) || !good.fetch_failures.is_empty()
                {
                    break true;
                }
                if Instant::now() > give_up {
                    break false;
                }
                std::thread::sleep(Duration::from_micros(20));
            };
            if ok && good.fetch_failures.is_empty() {
                lat.push(t.elapsed().as_micros() as u64);
            } else {
                failures += 1;
            }
        }
        stop.store(true, Ordering::Release);
        for t in threads {
            let _unused = t.join();
        }
        let peak = sampler.finish();
        let r = GoodReport {
            ops: (lat.len() + failures) as u64,
            failures: vec![String::new(); failures],
            lat_us: lat,
        };
        println!(
            "| {name} | {} | {} | {} us | {} us | {} us | {} → {} MiB |",
            r.ops,
            failures,
            r.percentile_us(0.5),
            r.percentile_us(0.99),
            r.percentile_us(1.0),
            before / 1024,
            peak / 1024
        );
    }
}
