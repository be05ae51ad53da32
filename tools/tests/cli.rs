//! The `ferry` binary as a user meets it: help, version, refused flags and values
//! (exit status 2 with a message naming the problem), failures of the work itself
//! (exit status 1), inspect of damaged blobs, and the TCPStore client and server.
// Reason: one test registers a buffer of its own to make a real metadata blob.
#![allow(unsafe_code)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferry::exchange::tcpstore::{self, ClientOptions, ServerConfig, TcpStoreClient};
use ferry::exchange::{ExchangeConfig, StoreConfig, TcpStoreConfig, Via};
use ferry::{Agent, AgentConfig, Desc, MemKind, Params};

fn ferry(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("FERRY_TCPSTORE_ENDPOINT")
        .output()
        .expect("run ferry")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `args` are refused before anything runs: status 2 and a message containing `says`.
#[track_caller]
fn refused(args: &[&str], says: &str) {
    let o = ferry(args);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {out}{err}");
    assert!(err.contains(says), "{args:?}: expected '{says}' in: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
}

/// `args` parse but the work fails: status 1 and `ferry: error:` with `says`.
#[track_caller]
fn fails(args: &[&str], says: &str) {
    let o = ferry(args);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{args:?}: {out}{err}");
    assert!(
        err.contains("ferry: error:") && err.contains(says),
        "{args:?}: expected '{says}' in: {err}"
    );
    assert!(!err.contains("panicked"), "{args:?}: {err}");
}

#[test]
fn every_command_has_help_and_the_tool_a_version() {
    let commands: &[&[&str]] = &[
        &[],
        &["demo"],
        &["bench"],
        &["bench", "xfer"],
        &["bench", "control"],
        &["bench", "posix"],
        &["backends"],
        &["inspect"],
        &["store"],
        &["store", "serve"],
        &["store", "get"],
        &["store", "list"],
        &["store", "delete"],
        &["md"],
        &["md", "fetch"],
    ];
    for cmd in commands {
        let mut args = cmd.to_vec();
        args.push("--help");
        let o = ferry(&args);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{args:?}: {err}");
        assert!(out.contains("Usage: ferry"), "{args:?}: {out}");
        assert!(out.contains("-h, --help"), "{args:?}: {out}");
    }
    let o = ferry(&["--version"]);
    assert!(o.status.success());
    assert_eq!(
        text(&o).0.trim(),
        format!("ferry {}", env!("CARGO_PKG_VERSION"))
    );
    // No subcommand: usage on stderr, status 2.
    refused(&[], "Usage: ferry");
}

#[test]
fn bad_flags_and_values_are_refused_with_a_message() {
    refused(&["demo", "--nope"], "unexpected argument '--nope'");
    refused(&["demo", "--mib"], "a value is required for '--mib <MIB>'");
    refused(&["demo", "--mib=0"], "0 is not in 1..=65536");
    refused(&["demo", "--mib", "99999999999999999999"], "invalid value");
    refused(&["demo", "--block-kib=-4"], "-4 is not in 1..=1048576");
    refused(&["demo", "--dev", "1"], "--vram");
    refused(
        &["bench", "control", "--seconds", "-1"],
        "more than 0 seconds",
    );
    refused(&["demo", "--mib", "-4"], "-4 is not in 1..=65536");
    refused(&["bench", "control", "--seconds=-1"], "more than 0 seconds");
    refused(&["bench", "control", "--seconds=1e30"], "at most 86400");
    refused(
        &["bench", "control", "--path", "sideways"],
        "possible values: prepared, full",
    );
    refused(&["bench", "posix", "--batch=0"], "0 is not in 1..=65536");
    refused(
        &["bench", "xfer", "--backend", "carrier-pigeon"],
        "possible values",
    );
    refused(&["bench", "xfer", "--max-block", "12Q"], "unknown unit");
    refused(&["bench", "xfer", "--max-block", "0"], "at least 1 byte");
    refused(&["bench", "xfer", "--max-block", "9999T"], "too large");
    refused(
        &["bench", "xfer", "--threads", "1000"],
        "1000 is not in 1..=64",
    );
    refused(&["bench", "xfer", "--param", "novalue"], "is not KEY=VALUE");
    refused(
        &["bench", "xfer", "--tcpstore", "nohost"],
        "is not HOST:PORT",
    );
    refused(
        &["store", "serve", "--listen", "127.0.0.1:99999"],
        "port must be a number",
    );
    refused(&["inspect"], "<FILE>");
    refused(&["md", "fetch", "a"], "--output <FILE>");
    // Parsed, but the combination is impossible: the work says why.
    fails(
        &["bench", "xfer", "--start-block", "1M", "--max-block", "4K"],
        "larger than --max-block",
    );
    fails(
        &["bench", "xfer", "--backend", "posix"],
        "--target-mem file",
    );
    fails(
        &["bench", "xfer", "--target-mem", "file"],
        "needs --backend posix",
    );
    fails(
        &["bench", "xfer", "--backend", "loopback", "--role", "target"],
        "needs --backend default, ucx or shm",
    );
    fails(
        &["bench", "xfer", "--backend", "ucx", "--role", "initiator"],
        "--tcpstore",
    );
    fails(
        &[
            "bench",
            "xfer",
            "--max-block",
            "1M",
            "--max-batch",
            "4",
            "--buffer",
            "1M",
            "--check",
        ],
        "--check needs every request to fit",
    );
    // With the `cuda` feature: tests/bench_xfer_vram.rs.
    #[cfg(not(feature = "cuda"))]
    fails(&["demo", "--vram"], "VRAM demo needs a GPU backend");
    fails(
        &["demo", "--mib", "1", "--block-kib", "3"],
        "multiple of --block-kib",
    );
    fails(&["inspect", "/nonexistent/blob"], "/nonexistent/blob");
}

#[test]
fn flag_equals_value_is_accepted_and_the_demo_verifies() {
    let o = ferry(&["demo", "--mib=4", "--block-kib=64"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains("WRITE 4 MiB in 64 blocks of 64 KiB"), "{out}");
    assert!(out.contains("verified 4 MiB both ways"), "{out}");
}

/// A valid metadata blob of agent `name` with one registered region.
fn blob(name: &str) -> Vec<u8> {
    let a = Agent::new(AgentConfig::named(name)).unwrap();
    a.create_backend("LOOPBACK", &Params::new()).unwrap();
    let mem = vec![0u8; 4096];
    // SAFETY: `mem` outlives the agent, and nothing moves bytes.
    unsafe { a.register(MemKind::Dram, Desc::of_slice(&mem)) }.unwrap();
    let md = a.local_md().unwrap();
    drop(a);
    md
}

#[test]
fn inspect_names_what_is_wrong_with_a_blob() {
    let dir = tempfile::tempdir().unwrap();
    let good = blob("inspect-me");
    let path = dir.path().join("md.bin");
    std::fs::write(&path, &good).unwrap();
    let p = path.to_str().unwrap();
    let o = ferry(&["inspect", p]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains("agent inspect-me") && out.contains("1 regions"),
        "{out}"
    );
    let o = ferry(&["inspect", p, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["valid"], true);
    assert_eq!(v["agent"], "inspect-me");
    assert_eq!(v["regions"].as_array().unwrap().len(), 1);
    assert_eq!(v["regions"][0]["kind"], "DRAM");
    assert_eq!(v["regions"][0]["len"], 4096);

    let mut flipped = good.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0xff;
    flipped[mid + 1] ^= 0x5a;
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", Vec::new(), "the file is empty"),
        ("short", b"FRM".to_vec(), "too short for the 8-byte header"),
        ("text", b"hello, world\n".to_vec(), "not Ferry metadata"),
        ("truncated", good[..good.len() / 2].to_vec(), "damaged"),
        (
            "version",
            [&good[..4], &[9, 0], &good[6..]].concat(),
            "unsupported agent metadata version 9",
        ),
    ];
    for (name, bytes, says) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, &bytes).unwrap();
        let p = path.to_str().unwrap();
        fails(&["inspect", p], says);
        let (_, err) = text(&ferry(&["inspect", p]));
        for internal in ["rkyv", "bytecheck", "Archived", "check failed"] {
            assert!(!err.contains(internal), "{name}: internal words in: {err}");
        }
        let o = ferry(&["inspect", p, "--json"]);
        assert_eq!(o.status.code(), Some(1));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["valid"], false, "{name}");
        assert!(v["problem"].as_str().unwrap().contains(says), "{name}: {v}");
    }
    // A flipped byte somewhere inside: refused in words, whatever the byte broke.
    let path = dir.path().join("flipped");
    std::fs::write(&path, &flipped).unwrap();
    let o = ferry(&["inspect", path.to_str().unwrap()]);
    if !o.status.success() {
        let (_, err) = text(&o);
        assert!(err.contains("the blob is"), "{err}");
        assert!(!err.contains("rkyv") && !err.contains("panicked"), "{err}");
    }
}

#[test]
fn store_get_list_delete_and_md_fetch_against_ferrys_server() {
    let server = tcpstore::serve(([127, 0, 0, 1], 0).into(), ServerConfig::default()).unwrap();
    let endpoint = server.local_addr().to_string();
    let mut client = TcpStoreClient::connect(&endpoint, ClientOptions::default()).unwrap();
    client.set(b"/cli/a", b"alpha").unwrap();
    client.set(b"raw-key", b"beta").unwrap();

    // Listed as `get` and `delete` take the keys; a key without torch's `/` needs --raw.
    let o = ferry(&["store", "list", "--endpoint", &endpoint]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(out.lines().collect::<Vec<_>>(), ["cli/a", "raw-key"]);
    assert!(err.contains("1 key(s) have no '/' prefix"), "{err}");
    let o = ferry(&["store", "list", "--raw", "--endpoint", &endpoint]);
    assert_eq!(
        text(&o).0.lines().collect::<Vec<_>>(),
        ["/cli/a", "raw-key"]
    );
    // Every listed key round-trips into `get` (the key `list` printed, unchanged).
    let listed = out.lines().next().unwrap().to_string();
    let o = ferry(&["store", "get", &listed, "--endpoint", &endpoint]);
    assert_eq!(o.stdout, b"alpha", "{}", text(&o).1);
    let o = ferry(&[
        "store",
        "get",
        "raw-key",
        "--raw",
        &format!("--endpoint={endpoint}"),
    ]);
    assert_eq!(o.stdout, b"beta");
    fails(
        &["store", "get", "missing", "--endpoint", &endpoint],
        "no key '/missing'",
    );
    let o = ferry(&["store", "delete", "cli/a", "--endpoint", &endpoint]);
    assert!(o.status.success(), "{}", text(&o).1);
    fails(
        &["store", "delete", "cli/a", "--endpoint", &endpoint],
        "no key '/cli/a'",
    );
    assert!(!client.check(&[b"/cli/a"]).unwrap());

    // md fetch: an agent publishes through the exchange; the tool writes its blob.
    let agent = Agent::new(AgentConfig::named("cli-published")).unwrap();
    agent.create_backend("LOOPBACK", &Params::new()).unwrap();
    let config = ExchangeConfig {
        store: StoreConfig::TcpStore(TcpStoreConfig::new(endpoint.clone())),
        ..ExchangeConfig::default()
    };
    agent.start_exchange(config).unwrap();
    agent.send_local_md(Via::Store).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("fetched.md");
    let f = file.to_str().unwrap();
    let o = ferry(&[
        "md",
        "fetch",
        "cli-published",
        "-o",
        f,
        "--tcpstore",
        &endpoint,
        "--timeout",
        "10",
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    let o = ferry(&["inspect", f]);
    assert!(text(&o).0.contains("agent cli-published"), "{}", text(&o).0);
    fails(
        &[
            "md",
            "fetch",
            "nobody",
            "-o",
            f,
            "--tcpstore",
            &endpoint,
            "--timeout",
            "0.3",
        ],
        "nobody",
    );
    server.stop();
}

#[test]
fn store_serve_takes_a_host_name_prints_limits_and_stops_on_ctrl_c() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["store", "serve", "--listen", "localhost:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    assert!(first.contains("listening on"), "{first}");
    let addr = first
        .split_whitespace()
        .find(|w| w.contains(':'))
        .unwrap()
        .to_string();
    let mut limits = String::new();
    for _ in 0..3 {
        out.read_line(&mut limits).unwrap();
    }
    assert!(limits.contains("max_connections"), "{limits}");
    // It serves.
    let mut client = TcpStoreClient::connect(&addr, ClientOptions::default()).unwrap();
    client.set(b"k", b"v").unwrap();
    // SET has no reply in the c10d protocol: a GET (answered) proves the server applied
    // it before the signal goes out.
    assert_eq!(client.get(b"k").unwrap(), b"v");
    // Ctrl-C (SIGINT) stops it cleanly.
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let until = Instant::now() + Duration::from_secs(10);
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < until, "store serve did not stop on SIGINT");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(code.success(), "{code}");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(rest.contains("stopped (1 keys were stored)"), "{rest}");
}

#[test]
fn library_logs_reach_stderr_through_the_subscriber_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("posix.bin");
    let f = file.to_str().unwrap();
    let bench = [
        "bench",
        "posix",
        "--engine",
        "threads",
        "--size-mib",
        "1",
        "--block-kib",
        "64",
        "--reps",
        "1",
        "--file",
        f,
    ];
    let line = "posix: engine threads";
    let quiet = ferry(&bench);
    let (out, err) = text(&quiet);
    assert!(quiet.status.success(), "{out}{err}");
    assert!(!err.contains(line), "logged without -v: {err}");
    let verbose = ferry(&[&["-v"][..], &bench[..]].concat());
    let (_, err) = text(&verbose);
    assert!(err.contains(line) && err.contains("INFO"), "-v: {err}");
    let o = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(bench)
        .env("RUST_LOG", "ferry_posix=info")
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert!(err.contains(line), "RUST_LOG: {err}");
}

/// `ferry demo` with `RUST_LOG` set as `spec`: (stdout, stderr).
fn demo_logged(spec: &str) -> (String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["demo", "--mib", "4"])
        .env("RUST_LOG", spec)
        .output()
        .expect("run ferry demo");
    let (out, err) = text(&o);
    assert!(o.status.success(), "RUST_LOG={spec}: {out}{err}");
    (out, err)
}

#[test]
fn rust_log_debug_explains_the_demos_control_plane_and_trace_summarizes_flushes() {
    let (out, err) = demo_logged("debug");
    assert!(out.contains("verified 4 MiB both ways"), "{out}");
    // One line per control-plane event: agents, backends, regions, the peer.
    for line in [
        "agent 'demo-prefill' created",
        "agent 'demo-decode' created",
        "agent 'demo-prefill': backend LOOPBACK created: in-process memmove",
        "agent 'demo-decode': backend LOOPBACK created",
        "agent 'demo-prefill': registered DRAM region",
        "agent 'demo-decode': registered DRAM region",
        "agent 'demo-prefill': metadata of peer 'demo-decode' loaded",
        "1 region(s)); taken by LOOPBACK",
    ] {
        assert!(err.contains(line), "RUST_LOG=debug: no '{line}' in:\n{err}");
    }
    assert_eq!(err.matches("registered DRAM region").count(), 3, "{err}");
    // Piped stderr carries no colour codes, and debug shows no flush summaries.
    assert!(!err.contains('\u{1b}'), "{err}");
    assert!(err.contains(" DEBUG "), "{err}");
    assert!(!err.contains("flush:"), "{err}");

    // Trace of the flush summary only: a line per flush, nothing of the debug lines.
    let (_, err) = demo_logged("ferry::flush=trace");
    assert!(!err.contains("created"), "{err}");
    let posts: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("agent 'demo-prefill': flush: 1 command(s) [post 1]"))
        .collect();
    // Two passes (warm-up and measured) each way.
    assert_eq!(posts.len(), 4, "{err}");
    for l in posts {
        assert!(l.contains(" TRACE ferry::flush:"), "{l}");
        assert!(l.contains("1 posted (4194304 bytes)"), "{l}");
        assert!(l.contains("0 failed"), "{l}");
    }
    assert!(err.contains("[prep 3, make 2]"), "{err}");

    // No RUST_LOG, no -v: nothing on stderr at all.
    let o = ferry(&["demo", "--mib", "4"]);
    let (_, err) = text(&o);
    assert!(o.status.success());
    assert!(err.is_empty(), "{err}");
    // A RUST_LOG the filter cannot parse is reported, and the demo still runs.
    let (_, err) = demo_logged("ferry=loud");
    assert!(
        err.contains("RUST_LOG=\"ferry=loud\" not understood"),
        "{err}"
    );
}

/// Logs piped to a file or another program carry no ANSI colour codes (the
/// subscriber colours only a terminal), so they stay greppable.
#[test]
fn piped_logs_have_no_colour_codes() {
    let o = ferry(&["-vv", "demo", "--mib", "1"]);
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("DEBUG"), "debug lines expected: {err}");
    assert!(
        !err.contains('\u{1b}'),
        "ANSI escape in piped stderr: {err:?}"
    );
}
