//! Ferry's executor: the [`CommandBuffer`] callers record into, the [`World`] of
//! struct-of-arrays tables it works on, and [`flush`], which runs the phases in a fixed
//! order (see [`executor`]). This crate never names a concrete backend.

pub mod command;
pub mod executor;
pub mod merge;
mod peers;
pub use peers::LoadKind;
pub mod world;

pub use command::{
    Command, CommandBuffer, Created, FromCreated, MakeBuilder, Outcome, Ref, Releasable, Side, Span,
    Ticket, XferStatus,
};
pub use executor::{flush, FlushSummary, MetadataLoader};
pub use world::{Bounds, PeerView, Telemetry, World, XferState};
