//! Ferry's executor: the [`CommandBuffer`] callers record into, the [`World`] of
//! struct-of-arrays tables it works on, and [`flush`], which runs the phases in a fixed
//! order (see [`executor`]). This crate never names a concrete backend.

pub mod command;
pub mod cost;
pub mod executor;
pub mod logging;
pub mod merge;
pub mod metrics;
pub mod world;

pub use command::{
    Command, CommandBuffer, Created, ExchangeCmd, FromCreated, MakeBuilder, MdRoute, Outcome,
    PrepDescs, Ref, Releasable, Side, Span, Ticket, XferStatus,
};
pub use executor::{flush, FlushSummary, MetadataLoader, Phase};
pub use metrics::{BackendMetrics, ExchangeEvent, Metrics, MetricsSnapshot};
pub use world::{Bounds, DeregStatus, LoadKind, PeerView, Telemetry, World, XferState};
