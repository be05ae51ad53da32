//! Ferry: a data-movement engine for AI inference (the crate users depend on).
