//! The stand-in cuFile (`standin/cufile_standin.c`), compiled once per test binary.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The stand-in library, built once per test binary (`None` + reason when no compiler).
pub fn standin() -> Option<&'static Path> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = BUILT.get_or_init(|| {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/standin/cufile_standin.c");
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("libcufile_standin.so");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let status = std::process::Command::new(&cc)
            .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o"])
            .arg(&out)
            .arg(&source)
            .arg("-lpthread")
            .status()
            .map_err(|e| format!("cannot run the C compiler '{cc}': {e}"))?;
        if !status.success() {
            return Err(format!("'{cc}' failed to build the stand-in ({status})"));
        }
        Ok(out)
    });
    match built {
        Ok(path) => Some(path.as_path()),
        Err(why) => {
            ferry_testkit::ci::skip("a C compiler for the GDS stand-in cuFile", why);
            None
        }
    }
}
