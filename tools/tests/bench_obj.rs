//! `ferry backends` lists OBJ with its parameters, and `ferry bench xfer --backend obj`
//! runs a short WRITE + READ sweep (bytes checked) against a moto S3 server started on
//! 127.0.0.1 for the test. Needs the `obj` feature and `FERRY_TEST_MOTO_SERVER`
//! (tools/test.sh provides both); under CI=true either missing fails.

use std::process::Command;

use ferry_testkit::moto::Moto;

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

#[test]
fn bench_xfer_obj_writes_and_reads_objects() {
    if !built_with_obj() {
        return;
    }
    let Some(m) = Moto::start() else { return };
    m.create_bucket("bench");
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("obj.json");
    let endpoint = m.endpoint();
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
