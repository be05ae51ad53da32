//! The backend trait's `unsafe fn`s, for tests that drive a backend directly.
//!
//! A test that calls these promises what the backend contract asks of the executor: it
//! keeps every buffer it registers alive until the backend is dropped or the region is
//! deregistered, and waits for every completion before it reads or drops a buffer that
//! a request uses. (A test of a refusal may pass ranges the backend must refuse before
//! touching them.)

use ferry_backend_api::Result;
use ferry_backend_api::{Backend, Completions, Endpoint, MemKind, Post, RegionSpec, Registered};

/// `register`, `post` and `deregister` under the promise in the module docs.
pub trait TestCalls {
    /// `Backend::register`.
    fn register_t(&mut self, region: &RegionSpec<'_>) -> Result<Registered>;
    /// `Backend::post`.
    fn post_t(
        &mut self,
        endpoint: Endpoint,
        batch: &[Post<'_>],
        done: &mut Completions,
    ) -> Result<()>;
    /// `Backend::deregister`.
    fn deregister_t(&mut self, kind: MemKind, token: u64) -> Result<()>;
}

impl<B: Backend + ?Sized> TestCalls for B {
    fn register_t(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        // SAFETY: the calling test keeps the registered memory (or fd) alive until the
        // region is deregistered or the backend dropped (module docs).
        unsafe { self.register(region) }
    }
    fn post_t(
        &mut self,
        endpoint: Endpoint,
        batch: &[Post<'_>],
        done: &mut Completions,
    ) -> Result<()> {
        // SAFETY: the ranges lie in registered, live buffers that the calling test does
        // not touch or drop until their completions arrived (module docs).
        unsafe { self.post(endpoint, batch, done) }
    }
    fn deregister_t(&mut self, kind: MemKind, token: u64) -> Result<()> {
        // SAFETY: the calling test deregisters only regions no request in flight uses,
        // or tests the backend's own refusal of one in use (module docs).
        unsafe { self.deregister(kind, token) }
    }
}
