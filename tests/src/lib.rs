//! Ferry integration tests.
