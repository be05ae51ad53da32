//! What is probed when: availability checks only load cuFile and look its symbols up;
//! `cuFileDriverOpen` runs at backend creation, on its own thread and bounded by
//! `driver_open_timeout_ms`; without an NVIDIA device it is not called at all. Tested
//! against the stand-in cuFile built with `-DSTANDIN_OPEN_BLOCKS`, whose driver open
//! does not return until the test lets it (as a real cuFile spins without a GPU).
// Reason: the test calls the stand-in's knobs (C functions) itself.
#![allow(unsafe_code)]

mod common;

use common::{create, params};

use std::path::Path;
use std::time::{Duration, Instant};

use ferry_backend_api::{BackendFactory, Error};
use ferry_gds::{cufile, GdsFactory};

/// `standin_open_calls()` of the stand-in at `lib`.
fn open_calls(lib: &Path) -> i32 {
    // SAFETY: the stand-in is built by this test; loading it again returns the handle
    // the backend uses; standin_open_calls is declared as int standin_open_calls(void).
    unsafe {
        let lib = libloading::Library::new(lib).unwrap();
        let f = lib
            .get::<unsafe extern "C" fn() -> i32>(b"standin_open_calls\0")
            .unwrap();
        f()
    }
}

fn release_open(lib: &Path) {
    // SAFETY: as above; void standin_release_open(void).
    unsafe {
        let lib = libloading::Library::new(lib).unwrap();
        let f = lib
            .get::<unsafe extern "C" fn()>(b"standin_release_open\0")
            .unwrap();
        f();
    }
}

fn machine_has_nvidia_device() -> bool {
    cufile::DEVICE_NODES.iter().any(|p| Path::new(p).exists())
}

#[test]
fn a_driver_open_that_does_not_return_is_bounded_and_never_repeated() {
    let Some(lib) = common::standin_blocking_open() else {
        return;
    };
    let p = params(
        lib,
        &[("device_check", "false"), ("driver_open_timeout_ms", "300")],
    );
    // Availability loads and looks up symbols only.
    GdsFactory.available_with(&p).unwrap();
    assert_eq!(open_calls(lib), 0, "availability called cuFileDriverOpen");

    let started = Instant::now();
    let err = create(&p).err().expect("the open does not return");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "{took:?}"
    );
    match &err {
        Error::Backend { errno, detail, .. } => {
            assert_eq!(*errno, libc::ETIMEDOUT, "{err}");
            assert!(detail.contains(&lib.display().to_string()), "{err}");
            assert!(detail.contains("cuFileDriverOpen"), "{err}");
            assert!(detail.contains("driver_open_timeout_ms"), "{err}");
            assert!(detail.contains(cufile::OPEN_THREAD), "{err}");
        }
        other => panic!("expected a Backend error, got {other:?}"),
    }
    assert_eq!(open_calls(lib), 1);

    // A second creation is refused at once and starts no second call.
    let started = Instant::now();
    let again = create(&p).err().expect("still not returned");
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "{:?}",
        started.elapsed()
    );
    assert!(again.to_string().contains("has not returned"), "{again}");
    assert_eq!(open_calls(lib), 1, "a second cuFileDriverOpen was started");
    // Availability now says why, still without calling cuFile.
    let why = GdsFactory.available_with(&p).unwrap_err();
    assert!(why.contains("has not returned"), "{why}");
    assert!(why.contains(&lib.display().to_string()), "{why}");

    // Once the pending open returns, creation works, with no further open.
    release_open(lib);
    let deadline = Instant::now() + Duration::from_secs(10);
    let backend = loop {
        match create(&p) {
            Ok(b) => break b,
            Err(e) if Instant::now() < deadline => {
                assert!(e.to_string().contains("has not returned"), "{e}");
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("the released open never finished: {e}"),
        }
    };
    assert_eq!(backend.library(), lib);
    assert_eq!(open_calls(lib), 1);
}

#[test]
fn without_an_nvidia_device_the_driver_is_not_called() {
    let Some(lib) = common::standin() else { return };
    let p = params(lib, &[]); // device_check defaults to true
    if machine_has_nvidia_device() {
        eprintln!("this machine has an NVIDIA device node: the pre-check passes here");
        return;
    }
    let started = Instant::now();
    let why = GdsFactory.available_with(&p).unwrap_err();
    assert!(why.contains("no NVIDIA device"), "{why}");
    assert!(why.contains("/dev/nvidiactl"), "{why}");
    assert!(why.contains(&lib.display().to_string()), "{why}");
    let err = create(&p).err().expect("refused without a device");
    assert!(matches!(err, Error::NotSupported { .. }), "{err:?}");
    assert!(
        err.to_string().contains("cuFileDriverOpen is not called"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(open_calls(lib), 0, "cuFileDriverOpen was called");
    // The default library follows the same rule (absent here, or refused for want of
    // a device), and never takes long.
    let started = Instant::now();
    let _ = GdsFactory.available();
    assert!(started.elapsed() < Duration::from_millis(100));
    // With the check off the same library opens (the stand-in needs no GPU).
    create(&params(lib, &[("device_check", "false")])).unwrap();
    assert_eq!(open_calls(lib), 1);
}

#[test]
fn timeout_and_device_check_parameters_are_validated() {
    let Some(lib) = common::standin() else { return };
    for (key, value) in [
        ("driver_open_timeout_ms", "0"),
        ("driver_open_timeout_ms", "600001"),
        ("driver_open_timeout_ms", "soon"),
        ("device_check", "maybe"),
    ] {
        let p = params(lib, &[(key, value)]);
        let err = create(&p)
            .err()
            .unwrap_or_else(|| panic!("{key}={value} accepted"));
        assert!(matches!(err, Error::InvalidParam { .. }), "{err:?}");
        assert!(err.to_string().contains(key), "{err}");
        let why = GdsFactory.available_with(&p).unwrap_err();
        assert!(why.contains(key), "{why}");
    }
}
