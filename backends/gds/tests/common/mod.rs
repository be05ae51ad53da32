//! The stand-in cuFile (`standin/cufile_standin.c`), compiled once per test binary, and
//! the real libcufile named by `FERRY_TEST_CUFILE`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Build the stand-in as `name` with extra compiler arguments.
fn build(name: &str, defines: &[&str]) -> Result<PathBuf, String> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/standin/cufile_standin.c");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror"])
        .args(defines)
        .arg("-o")
        .arg(&out)
        .arg(&source)
        .arg("-lpthread")
        .status()
        .map_err(|e| format!("cannot run the C compiler '{cc}': {e}"))?;
    if !status.success() {
        return Err(format!("'{cc}' failed to build the stand-in ({status})"));
    }
    Ok(out)
}

fn built(
    cell: &'static OnceLock<Result<PathBuf, String>>,
    make: fn() -> Result<PathBuf, String>,
) -> Option<&'static Path> {
    match cell.get_or_init(make) {
        Ok(path) => Some(path.as_path()),
        Err(why) => {
            ferry_testkit::ci::skip("a C compiler for the GDS stand-in cuFile", why);
            None
        }
    }
}

/// The stand-in library, built once per test binary (`None` + reason when no compiler).
pub fn standin() -> Option<&'static Path> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    built(&BUILT, || build("libcufile_standin.so", &[]))
}

/// The stand-in whose `cuFileDriverOpen` blocks until `standin_release_open()`.
pub fn standin_blocking_open() -> Option<&'static Path> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    built(&BUILT, || {
        build(
            "libcufile_standin_blocking_open.so",
            &["-DSTANDIN_OPEN_BLOCKS"],
        )
    })
}

/// The real libcufile(s) named by `FERRY_TEST_CUFILE` (paths separated by `:`, e.g. the
/// `nvidia-cufile` wheel's `libcufile.so.0`, which PyTorch's CUDA wheel brings). Empty
/// after saying why (a failure under CI=true) when it is unset or a file is missing.
pub fn real_cufile() -> Vec<PathBuf> {
    let Some(list) = std::env::var_os("FERRY_TEST_CUFILE").filter(|v| !v.is_empty()) else {
        ferry_testkit::ci::skip(
            "a real libcufile (the nvidia-cufile wheel)",
            "FERRY_TEST_CUFILE is not set (tools/test.sh installs the wheel and sets it)",
        );
        return Vec::new();
    };
    let paths: Vec<PathBuf> = std::env::split_paths(&list).collect();
    if let Some(missing) = paths.iter().find(|p| !p.is_file()) {
        ferry_testkit::ci::skip(
            "a real libcufile (the nvidia-cufile wheel)",
            format!(
                "FERRY_TEST_CUFILE names {}, which does not exist",
                missing.display()
            ),
        );
        return Vec::new();
    }
    paths
}

/// GDS parameters naming `lib` as the cuFile library, plus `extra`.
pub fn params(lib: &Path, extra: &[(&str, &str)]) -> ferry_backend_api::Params {
    let mut params = ferry_backend_api::Params::new();
    params.insert("cufile_library".into(), lib.display().to_string());
    for (k, v) in extra {
        params.insert((*k).into(), (*v).into());
    }
    params
}

/// A GDS backend made directly (no agent) with `params`.
pub fn create(
    params: &ferry_backend_api::Params,
) -> Result<ferry_gds::GdsBackend, ferry_backend_api::Error> {
    ferry_gds::GdsBackend::new(&ferry_backend_api::BackendInit {
        agent_name: "gds-test",
        params,
    })
}
