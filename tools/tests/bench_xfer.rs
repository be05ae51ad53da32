//! `ferry bench xfer` output schema: a short LOOPBACK sweep over every dimension (CSV,
//! JSON, plot) and a short UCX run with the target in a second process.

use std::process::Command;

const COLUMNS: &str = "scheme,op,request,layout,block_bytes,batch,workers,requests_per_iter,iters,gbps,lat_avg_us,prep_avg_us,prep_p99_us,post_avg_us,post_p99_us,xfer_avg_us,xfer_p99_us,descs_per_s,ranges,est_us,est_margin_us,est_method,via,check";

fn run(args: &[&str]) -> (String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .env(
            "UCX_NET_DEVICES",
            std::env::var("UCX_NET_DEVICES").unwrap_or("lo".into()),
        )
        .output()
        .expect("run ferry");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{args:?}:\n{out}\n{err}");
    (out, err)
}

fn rows(json: &serde_json::Value) -> &Vec<serde_json::Value> {
    json["rows"].as_array().expect("rows")
}

/// Every row has every column, with numbers where numbers belong.
fn check_row(r: &serde_json::Value) {
    let keys: Vec<&str> = COLUMNS.split(',').collect();
    let obj = r.as_object().expect("row object");
    assert_eq!(obj.len(), keys.len(), "{r}");
    for k in keys {
        assert!(obj.contains_key(k), "{k} missing in {r}");
    }
    for k in [
        "gbps",
        "lat_avg_us",
        "xfer_avg_us",
        "xfer_p99_us",
        "descs_per_s",
    ] {
        assert!(r[k].as_f64().unwrap() > 0.0, "{k} in {r}");
    }
    for k in ["prep_avg_us", "prep_p99_us", "post_avg_us", "post_p99_us"] {
        assert!(r[k].as_f64().unwrap() >= 0.0, "{k} in {r}");
    }
    assert!(
        r["xfer_p99_us"].as_f64() >= r["xfer_avg_us"].as_f64().map(|v| v * 0.0),
        "{r}"
    );
    assert_eq!(r["check"], true, "{r}");
    // Every case runs after a warm-up (or after an earlier case), so the agent has
    // completed requests to estimate from.
    let est = r["est_us"]
        .as_f64()
        .unwrap_or_else(|| panic!("est_us in {r}"));
    assert!(est > 0.0 && est.is_finite(), "{r}");
    assert!(r["est_margin_us"].as_f64().unwrap() >= 0.0, "{r}");
    assert!(
        ["analytical", "measured", "mixed"].contains(&r["est_method"].as_str().unwrap()),
        "{r}"
    );
    let batch = r["batch"].as_u64().unwrap();
    let ranges = r["ranges"].as_u64().unwrap();
    if r["layout"] == "contiguous" {
        assert_eq!(ranges, 1, "contiguous blocks merge into one range: {r}");
    } else {
        assert!((1..=batch).contains(&ranges), "{r}");
    }
}

#[test]
fn loopback_sweep_writes_csv_json_and_a_plot() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("x.csv");
    let json = dir.path().join("x.json");
    let png = dir.path().join("x.png");
    let font = std::path::Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists()
        || std::env::var("FERRY_PLOT_FONT").is_ok();
    let mut args = vec![
        "bench",
        "xfer",
        "--backend",
        "loopback",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--max-block",
        "16K",
        "--op",
        "read,write",
        "--layout",
        "contiguous,shuffled",
        "--max-batch",
        "4",
        "--batch-factor",
        "4",
        "--request",
        "prepared,oneshot",
        "--threads",
        "2",
        "--scheme",
        "pairwise,many-to-one,one-to-many",
        "--check",
    ];
    let (c, j, p) = (
        csv.to_str().unwrap(),
        json.to_str().unwrap(),
        png.to_str().unwrap(),
    );
    args.extend(["--csv", c, "--json", j]);
    if font {
        args.extend(["--plot", p]);
    } else {
        ferry_testkit::ci::skip(
            "a TrueType font for --plot",
            "DejaVuSans.ttf not found (package fonts-dejavu-core)",
        );
    }
    let (out, err) = run(&args);
    // stderr is not a terminal here: no progress bar.
    assert!(!err.contains("bench xfer ["), "{err}");
    // 3 schemes × 2 ops × 2 request modes × 2 layouts × 3 blocks × 2 batches.
    let n = 3 * 2 * 2 * 2 * 3 * 2;
    assert!(out.contains("backend: LOOPBACK"), "{out}");
    let text = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], COLUMNS);
    assert_eq!(lines.len(), 1 + n, "{text}");
    for line in &lines[1..] {
        assert_eq!(
            line.split(',').count(),
            COLUMNS.split(',').count(),
            "{line}"
        );
        assert!(line.ends_with(",ok"), "{line}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["config"]["backend"], "LOOPBACK");
    assert_eq!(v["threads"], 2);
    assert_eq!(rows(&v).len(), n);
    for r in rows(&v) {
        check_row(r);
        let expect_workers = if r["scheme"] == "one-to-many" { 1 } else { 2 };
        assert_eq!(r["workers"], expect_workers, "{r}");
        let per_iter = if r["scheme"] == "one-to-many" { 2 } else { 1 };
        assert_eq!(r["requests_per_iter"], per_iter, "{r}");
    }
    if font {
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    }
}

#[test]
fn ucx_sweep_runs_the_target_in_a_second_process() {
    let ucx = ferry::Agent::available_backends()
        .into_iter()
        .find(|b| b.name == "UCX")
        .map(|b| b.available);
    match ucx {
        Some(Ok(())) => {}
        Some(Err(why)) => return ferry_testkit::ci::skip("UCX", why),
        None => return ferry_testkit::ci::skip("UCX", "no UCX backend in this build"),
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("u.json");
    let csv = dir.path().join("u.csv");
    let (out, _) = run(&[
        "bench",
        "xfer",
        "--backend",
        "ucx",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--max-block",
        "64K",
        "--block-factor",
        "4",
        "--op",
        "read,write",
        "--layout",
        "contiguous,shuffled",
        "--max-batch",
        "4",
        "--batch-factor",
        "4",
        "--check",
        "--json",
        json.to_str().unwrap(),
        "--csv",
        csv.to_str().unwrap(),
    ]);
    assert!(out.contains("target process (pid"), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["config"]["backend"], "UCX");
    // 2 ops × 2 layouts × 3 blocks (4K, 16K, 64K) × 2 batches (1, 4).
    assert_eq!(rows(&v).len(), 24);
    for r in rows(&v) {
        check_row(r);
    }
    let text = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(text.lines().next(), Some(COLUMNS));
    assert_eq!(text.lines().count(), 25);
}

/// UCX's availability here, or the reason the caller should skip.
fn ucx_missing() -> Option<String> {
    match ferry::Agent::available_backends()
        .into_iter()
        .find(|b| b.name == "UCX")
        .map(|b| b.available)
    {
        Some(Ok(())) => None,
        Some(Err(why)) => Some(why),
        None => Some("no UCX backend in this build".into()),
    }
}

/// `--role target` and `--role initiator` as two commands meeting through `store`
/// (`--tcpstore ADDR` or `--etcd URL`); returns the initiator's JSON, or the
/// initiator's stderr when it failed.
fn two_roles(store: &[&str], run_id: &str) -> Result<serde_json::Value, String> {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("roles.json");
    let sweep = [
        "--max-block",
        "16K",
        "--block-factor",
        "4",
        "--iters",
        "3",
        "--check",
    ];
    let mut target = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "bench",
            "xfer",
            "--backend",
            "ucx",
            "--role",
            "target",
            "--run-id",
            run_id,
        ])
        .args(store)
        .args(sweep)
        .env("UCX_NET_DEVICES", "lo")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "bench",
            "xfer",
            "--backend",
            "ucx",
            "--role",
            "initiator",
            "--run-id",
            run_id,
        ])
        .args(store)
        .args(sweep)
        .args(["--op", "read,write", "--json", json.to_str().unwrap()])
        .env("UCX_NET_DEVICES", "lo")
        .output()
        .unwrap();
    if !o.status.success() {
        let _ = target.kill();
        let _ = target.wait();
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    // The target leaves by itself once the initiator said it is done.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let status = loop {
        if let Some(s) = target.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < until,
            "the target did not leave"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
    Ok(serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap())
}

#[test]
fn initiator_and_target_roles_meet_through_a_tcpstore() {
    if let Some(why) = ucx_missing() {
        return ferry_testkit::ci::skip("UCX", why);
    }
    let server = ferry::exchange::tcpstore::serve(
        ([127, 0, 0, 1], 0).into(),
        ferry::exchange::tcpstore::ServerConfig::default(),
    )
    .unwrap();
    let addr = server.local_addr().to_string();
    let v = two_roles(&["--tcpstore", &addr], "roles-tcpstore").expect("initiator");
    assert_eq!(rows(&v).len(), 2 * 2, "{v}");
    for r in rows(&v) {
        check_row(r);
    }
    server.stop();
}

#[test]
fn initiator_and_target_roles_meet_through_etcd() {
    let Ok(etcd) = std::env::var("FERRY_TEST_ETCD") else {
        return ferry_testkit::ci::skip("etcd", "FERRY_TEST_ETCD is not set");
    };
    if let Some(why) = ucx_missing() {
        return ferry_testkit::ci::skip("UCX", why);
    }
    let run_id = format!("roles-etcd-{}", std::process::id());
    match two_roles(&["--etcd", &etcd], &run_id) {
        Ok(v) => {
            assert_eq!(rows(&v).len(), 2 * 2, "{v}");
            for r in rows(&v) {
                check_row(r);
            }
        }
        Err(e) if e.contains("lacks its `etcd` cargo feature") => {
            ferry_testkit::ci::skip("the etcd feature", e)
        }
        Err(e) => panic!("initiator failed: {e}"),
    }
}

/// `--metrics-listen 127.0.0.1:0`: the endpoint starts on a free port (printed on
/// stderr) and `--json` embeds the initiator's metrics with the requests it moved.
#[test]
fn json_embeds_the_initiator_metrics_with_an_endpoint_on_a_free_port() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("m.json");
    let (_, err) = run(&[
        "bench",
        "xfer",
        "--backend",
        "loopback",
        "--iters",
        "4",
        "--warmup",
        "2",
        "--max-block",
        "8K",
        "--metrics-listen",
        "127.0.0.1:0",
        "--json",
        json.to_str().unwrap(),
    ]);
    let line = err
        .lines()
        .find(|l| l.starts_with("ferry: metrics on http://127.0.0.1:"))
        .unwrap_or_else(|| panic!("no endpoint address on stderr: {err}"));
    assert!(!line.contains("127.0.0.1:0/"), "{line}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let m = &v["metrics"]["ferry-bench-initiator-0"];
    let b = &m["backends"][0];
    assert_eq!(b["name"], "LOOPBACK", "{m}");
    // 2 blocks (4K, 8K) × (2 warm-up + 4 timed) iterations, one request each.
    assert_eq!(b["posted"], 12, "{m}");
    assert_eq!(b["completed"], 12, "{m}");
    assert_eq!(b["bytes"], 6 * (4096 + 8192), "{m}");
    assert!(b["latency_count"].as_u64().unwrap() > 0, "{m}");
    assert!(b["latency_sum_us"].as_f64().unwrap() > 0.0, "{m}");
    assert_eq!(b["failed"], 0, "{m}");
    assert!(m["flushes"].as_u64().unwrap() > 0, "{m}");
    assert_eq!(m["peers"], 1, "{m}");
    assert_eq!(m["errors"], serde_json::json!({}), "{m}");
}

/// The endpoint answers a scrape while the command runs, with the command's agents.
#[test]
fn metrics_listen_serves_prometheus_while_a_bench_runs() {
    use std::io::{BufRead, Read, Write};
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "bench",
            "control",
            "--batch",
            "16",
            "--seconds",
            "2",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("ferry: metrics on http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("unexpected first stderr line: {line}"))
        .to_string();
    let scrape = || -> String {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        c.read_to_string(&mut body).unwrap();
        body
    };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let body = loop {
        let body = scrape();
        if body.contains("ferry_requests_posted_total{agent=\"bench-a\"") {
            break body;
        }
        assert!(std::time::Instant::now() < until, "{body}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
}

#[test]
fn metrics_listen_refuses_a_bad_address() {
    for bad in ["off", "not an address", "127.0.0.1:99999"] {
        let o = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["bench", "xfer", "--metrics-listen", bad])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("--metrics-listen"), "{bad}: {err}");
    }
}

#[test]
fn peer_timeout_ms_is_checked_and_reaches_the_ucx_backend() {
    let refused = |args: &[&str], code: i32, words: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["bench", "xfer"])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(words), "{args:?}: {err}");
    };
    refused(
        &["--backend", "ucx", "--peer-timeout-ms", "86400001"],
        2,
        "not in 0..=86400000",
    );
    refused(&["--backend", "ucx", "--peer-timeout-ms", "-5"], 2, "-5");
    refused(
        &["--backend", "loopback", "--peer-timeout-ms", "100"],
        1,
        "UCX parameter",
    );
    refused(
        &[
            "--backend",
            "ucx",
            "--peer-timeout-ms",
            "100",
            "--param",
            "peer_timeout_ms=200",
        ],
        1,
        "both given",
    );
    if let Some(why) = ucx_missing() {
        return ferry_testkit::ci::skip("UCX", why);
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("t.json");
    run(&[
        "bench",
        "xfer",
        "--backend",
        "ucx",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--max-block",
        "4K",
        "--peer-timeout-ms",
        "2500",
        "--check",
        "--json",
        json.to_str().unwrap(),
    ]);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // The initiator agent's backend reports the value it runs with.
    let effective = v["config"]["backend params"].as_str().unwrap_or_default();
    assert!(effective.contains("peer_timeout_ms=2500"), "{v}");
    for r in rows(&v) {
        check_row(r);
    }
}

#[test]
fn a_target_whose_store_is_unreachable_stops_with_the_reason() {
    if let Some(why) = ucx_missing() {
        return ferry_testkit::ci::skip("UCX", why);
    }
    // A port nothing listens on: bind one, then close it.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["bench", "xfer", "--backend", "ucx", "--role", "target"])
        .args(["--tcpstore", &addr, "--run-id", "unreachable-store"])
        .env("UCX_NET_DEVICES", "lo")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run ferry");
    // It used to serve forever; give it far more than it needs, then fail the test.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the target kept serving with an unreachable store");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!status.success(), "{err}");
    assert!(err.contains("unreachable") && err.contains(&addr), "{err}");
}

/// With no `--backend`, the agents get the default set and the target is a second
/// process on this host: every request goes through SHM (a same-host peer), none
/// through UCX, and the bytes check.
#[test]
fn the_default_sends_a_same_host_peer_through_shm() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("d.json");
    let (out, _) = run(&[
        "bench",
        "xfer",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--max-block",
        "64K",
        "--block-factor",
        "16",
        "--op",
        "read,write",
        "--check",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.contains("backend: default"), "{out}");
    assert!(out.contains("target process (pid"), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let backends = v["config"]["backends"]
        .as_str()
        .expect("backends in config");
    assert!(backends.starts_with("LOOPBACK, SHM"), "{backends}");
    let rows = rows(&v);
    assert_eq!(rows.len(), 2 * 2, "{v}");
    for r in rows {
        check_row(r);
        assert_eq!(r["via"], "SHM", "{r}");
    }
}

/// Start a long default-set sweep (target in a second process) writing CSV and JSON,
/// wait for its first rows, send `signal` to the initiator or to the target, and check
/// that every row finished before the signal is in the CSV, the JSON says why it
/// stopped, and nothing is left running.
fn interrupt_a_sweep(signal: &str, to_target: bool) {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("i.csv");
    let jsonl = dir.path().join("i.jsonl");
    let json = dir.path().join("i.json");
    // 11 cases (4 KiB .. 4 MiB) of 20,000 iterations: tens of seconds in all, so the
    // signal lands mid-sweep.
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "bench",
            "xfer",
            "--iters",
            "20000",
            "--warmup",
            "10",
            "--max-block",
            "4M",
            "--csv",
            csv.to_str().unwrap(),
            "--jsonl",
            jsonl.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ])
        .env(
            "UCX_NET_DEVICES",
            std::env::var("UCX_NET_DEVICES").unwrap_or("lo".into()),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ferry");
    // The table streams to stdout: its first line names the target's pid.
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let (tx, lines) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    let before = loop {
        while let Ok(l) = lines.try_recv() {
            table.push(l);
        }
        let text = std::fs::read_to_string(&csv).unwrap_or_default();
        if text.lines().count() >= 3 {
            break text;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the sweep ended ({status}) before two rows: {table:?}");
        }
        assert!(Instant::now() < deadline, "no two rows in 120 s: {table:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let pid = if to_target {
        let header = table.first().expect("the table's first line");
        let at = header.find("target process (pid ").expect(header) + 20;
        header[at..]
            .split(')')
            .next()
            .unwrap()
            .parse::<u32>()
            .unwrap()
    } else {
        child.id()
    };
    let sent = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success(), "kill {signal} {pid}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the initiator did not stop within 60 s of {signal}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    reader.join().unwrap();
    table.extend(lines.try_iter());
    assert!(
        !status.success(),
        "an interrupted sweep is a failure: {stderr}"
    );
    assert!(stderr.contains("cases measured"), "{stderr}");
    if !to_target {
        assert!(stderr.contains("interrupted"), "{stderr}");
    }
    // Every row written before the signal is still there, and more may have followed.
    let after = std::fs::read_to_string(&csv).unwrap();
    assert!(after.starts_with(&before), "{before}\n---\n{after}");
    let csv_rows: Vec<&str> = after.lines().skip(1).collect();
    assert_eq!(after.lines().next(), Some(COLUMNS));
    assert!(
        (2..11).contains(&csv_rows.len()),
        "{} rows: {after}",
        csv_rows.len()
    );
    for r in &csv_rows {
        assert_eq!(r.split(',').count(), COLUMNS.split(',').count(), "{r}");
    }
    // The table printed the same rows (header lines first).
    assert_eq!(table.len(), 2 + csv_rows.len(), "{table:?}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(rows(&v).len(), csv_rows.len(), "{v}");
    // The JSON lines: one object per finished row, the same rows.
    let lines = std::fs::read_to_string(&jsonl).unwrap();
    let streamed: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(&streamed, rows(&v), "{lines}");
    assert_eq!(v["cases"], 11, "{v}");
    assert!(v["stopped"].is_string(), "{v}");
    for (r, line) in rows(&v).iter().zip(&csv_rows) {
        let block = line.split(',').nth(4).unwrap();
        assert_eq!(r["block_bytes"].to_string(), block, "{r} vs {line}");
    }
    // The target process is gone too (its own process group: the initiator stops it).
    if let Some(header) = table.first() {
        let at = header.find("target process (pid ").expect(header) + 20;
        let target: u32 = header[at..].split(')').next().unwrap().parse().unwrap();
        let gone_by = Instant::now() + Duration::from_secs(20);
        while std::path::Path::new(&format!("/proc/{target}")).exists() {
            let zombie = std::fs::read_to_string(format!("/proc/{target}/stat"))
                .map(|s| s.contains(") Z "))
                .unwrap_or(true);
            if zombie {
                break;
            }
            assert!(Instant::now() < gone_by, "target {target} still runs");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[test]
fn sigint_to_the_initiator_keeps_the_finished_rows() {
    interrupt_a_sweep("-INT", false);
}

#[test]
fn sigterm_to_the_initiator_keeps_the_finished_rows() {
    interrupt_a_sweep("-TERM", false);
}

#[test]
fn sigint_to_the_target_keeps_the_finished_rows() {
    interrupt_a_sweep("-INT", true);
}

/// Output paths are checked before anything runs: no target is started, no case run.
#[test]
fn an_unwritable_output_path_is_refused_before_the_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir");
    for flag in ["--csv", "--jsonl", "--json", "--plot"] {
        let path = missing.join("out");
        let started = std::time::Instant::now();
        let o = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args([
                "bench",
                "xfer",
                "--iters",
                "100000",
                flag,
                path.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(!o.status.success(), "{flag}: {err}");
        assert!(
            err.contains(flag) && err.contains("no-such-dir"),
            "{flag}: {err}"
        );
        // Refused before the set-up: no table header, no row.
        assert!(out.is_empty(), "{flag}: {out}");
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
    }
}

/// `--backend gds` against the GDS backend's stand-in cuFile (compiled with `cc`; no
/// GPU needed): DRAM <-> FILE, both ops, bytes checked, every row through GDS. Without
/// a cuFile the backend is refused with the reason.
#[test]
fn gds_sweeps_memory_to_files_through_a_stand_in_cufile() {
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("libcufile-standin.so");
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../backends/gds/tests/standin/cufile_standin.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&lib)
        .arg(&source)
        .arg("-lpthread")
        .status()
    {
        Ok(s) if s.success() => {}
        other => {
            return ferry_testkit::ci::skip(
                "a C compiler for the GDS stand-in cuFile",
                format!("{cc}: {other:?}"),
            )
        }
    }
    let json = dir.path().join("g.json");
    let cufile = format!("cufile_library={}", lib.display());
    let (out, _) = run(&[
        "bench",
        "xfer",
        "--backend",
        "gds",
        "--target-mem",
        "file",
        "--file-dir",
        dir.path().to_str().unwrap(),
        "--iters",
        "3",
        "--warmup",
        "1",
        "--max-block",
        "64K",
        "--block-factor",
        "16",
        "--op",
        "read,write",
        "--check",
        "--param",
        &cufile,
        "--param",
        "device_check=false",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.contains("backend: GDS"), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(rows(&v).len(), 2 * 2, "{v}");
    for r in rows(&v) {
        check_row(r);
        assert_eq!(r["via"], "GDS", "{r}");
    }
    // No cuFile by that name: refused with the backend's reason, nothing measured, and
    // the target file made before the agent was refused is removed again.
    let files = dir.path().join("refused");
    std::fs::create_dir(&files).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "bench",
            "xfer",
            "--backend",
            "gds",
            "--target-mem",
            "file",
            "--file-dir",
            files.to_str().unwrap(),
            "--param",
            "cufile_library=/nonexistent/libcufile.so.0",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("GDS") && err.contains("/nonexistent/libcufile.so.0"),
        "{err}"
    );
    let left: Vec<_> = std::fs::read_dir(&files)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "a refused set-up left {left:?}");
}

/// A second interrupt exits at once (130), skipping the destructors that remove a file
/// sweep's target files: they are removed before that exit too. SIGINT and SIGTERM
/// right after it (two different signals, so they cannot merge while pending; the
/// first ends the sweep within milliseconds, so the second must follow at once). Up to
/// five tries, should the sweep still end first: every try must leave the directory
/// empty, and one must exit with 130.
#[test]
fn a_second_interrupt_still_removes_the_target_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut exited_at_once = false;
    for attempt in 0..5 {
        let files = dir.path().join(format!("try-{attempt}"));
        std::fs::create_dir(&files).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args([
                "bench",
                "xfer",
                "--backend",
                "posix",
                "--target-mem",
                "file",
                "--file-dir",
                files.to_str().unwrap(),
                "--max-block",
                "1M",
                "--iters",
                "10000000",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Wait for the target file: the sweep is under way.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::fs::read_dir(&files).unwrap().next().is_none() {
            assert!(std::time::Instant::now() < until, "no target file appeared");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
        let pid = child.id().to_string();
        let twice = Command::new("sh")
            .args(["-c", &format!("kill -INT {pid}; kill -TERM {pid}")])
            .status()
            .unwrap();
        let status = child.wait().unwrap();
        let left: Vec<_> = std::fs::read_dir(&files)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "try {attempt} ({status}) left {left:?}");
        // `kill` fails if the process had exited before the second signal.
        if twice.success() && status.code() == Some(130) {
            exited_at_once = true;
            break;
        }
    }
    assert!(exited_at_once, "no try exited at the second interrupt");
}
