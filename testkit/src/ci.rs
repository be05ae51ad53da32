//! The rule for tests that need a component (UCX, etcd, io_uring, a TCPStore server):
//! under CI a missing component fails the test; elsewhere the test says why it skips.

/// Whether the tests run under CI: `CI` is `true` or `1` (what CI services set).
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// A component a test needs is missing: panic under CI (naming `what` and `why`);
/// otherwise print `skipping: …` on stderr and return, so the caller returns early.
///
/// ```
/// fn etcd_test() {
///     let Ok(endpoint) = std::env::var("FERRY_TEST_ETCD") else {
///         return ferry_testkit::ci::skip("etcd", "FERRY_TEST_ETCD is not set");
///     };
///     // … the test, against `endpoint`
/// #   let _ = endpoint;
/// }
/// ```
#[track_caller]
pub fn skip(what: &str, why: impl std::fmt::Display) {
    if under_ci() {
        panic!("{what} is required under CI=true but unavailable: {why}");
    }
    eprintln!("skipping ({what}): {why}");
}
