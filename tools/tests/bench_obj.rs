//! `ferry backends` lists OBJ with its parameters, and `ferry bench xfer --backend obj`
//! runs a short WRITE + READ sweep (bytes checked) against a moto S3 server started on
//! 127.0.0.1 for the test. Needs the `obj` feature and `FERRY_TEST_MOTO_SERVER`
//! (tools/test.sh provides both); under CI=true either missing fails.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn ferry(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .output()
        .expect("run ferry");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn built_with_obj() -> bool {
    if cfg!(feature = "obj") {
        return true;
    }
    ferry_testkit::ci::skip("OBJ backend", "ferry-tools built without the obj feature");
    false
}

#[test]
fn ferry_backends_lists_obj_with_its_parameters() {
    if !built_with_obj() {
        return;
    }
    let (ok, out, err) = ferry(&["backends"]);
    assert!(ok, "{err}");
    assert!(out.contains("OBJ"), "{out}");
    for param in [
        "endpoint_override",
        "bucket",
        "part_bytes",
        "max_in_flight",
        "retries",
    ] {
        assert!(out.contains(param), "{param} missing:\n{out}");
    }
}

/// A moto server, killed by pid on drop.
struct Moto(Child, u16);

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn moto() -> Option<Moto> {
    let Ok(bin) = std::env::var("FERRY_TEST_MOTO_SERVER") else {
        ferry_testkit::ci::skip("moto S3 server", "FERRY_TEST_MOTO_SERVER is not set");
        return None;
    };
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let child = Command::new(&bin)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
    let m = Moto(child, port);
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "moto did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(m)
}

#[test]
fn bench_xfer_obj_writes_and_reads_objects() {
    if !built_with_obj() {
        return;
    }
    let Some(m) = moto() else { return };
    let mut s = TcpStream::connect(("127.0.0.1", m.1)).unwrap();
    write!(
        s,
        "PUT /bench HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("obj.json");
    let endpoint = format!("http://127.0.0.1:{}", m.1);
    let (ok, out, err) = ferry(&[
        "bench",
        "xfer",
        "--backend",
        "obj",
        "--endpoint",
        &endpoint,
        "--bucket",
        "bench",
        "--param",
        "access_key=testing",
        "--param",
        "secret_key=testing",
        "--op",
        "write,read",
        "--start-block",
        "64K",
        "--max-block",
        "256K",
        "--block-factor",
        "4",
        "--max-batch",
        "4",
        "--batch-factor",
        "4",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--check",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(ok, "{out}\n{err}");
    assert!(
        !out.contains("secret_key=testing") && !err.contains("secret_key=testing"),
        "a secret reached the output:\n{out}\n{err}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = v["rows"].as_array().expect("rows");
    // 2 ops × 2 blocks × 2 batches.
    assert_eq!(rows.len(), 8, "{v}");
    for r in rows {
        assert_eq!(r["check"], true, "{r}");
        assert_eq!(r["via"], "OBJ", "{r}");
    }
}
