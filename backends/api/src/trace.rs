//! Profiling hooks for backends (feature `tracy`): a span macro and named plots, both
//! free when the feature is off and a no-op while no Tracy client runs (the agent starts
//! one when built with `ferry/tracy`). With `ferry/tracy-ondemand` the client collects
//! nothing until a viewer connects.

#[cfg(feature = "tracy")]
pub use tracy_client;

/// A Tracy span until the end of the scope: `let _span = trace_span!("ferry-ucx::post");`
/// (nothing without the `tracy` feature or a running client).
#[cfg(feature = "tracy")]
#[macro_export]
macro_rules! trace_span {
    ($name:literal) => {
        $crate::trace::tracy_client::Client::running()
            .map(|c| c.span($crate::trace::tracy_client::span_location!($name), 0))
    };
}

/// A Tracy span until the end of the scope (the `tracy` feature is off: nothing).
#[cfg(not(feature = "tracy"))]
#[macro_export]
macro_rules! trace_span {
    ($name:literal) => {
        ()
    };
}

/// A named Tracy plot (a value over time, e.g. requests in flight).
#[derive(Debug)]
pub struct Plot {
    label: &'static str,
    #[cfg(feature = "tracy")]
    name: std::sync::OnceLock<tracy_client::PlotName>,
}

impl Plot {
    /// A plot shown as `label`.
    pub const fn new(label: &'static str) -> Plot {
        Plot {
            label,
            #[cfg(feature = "tracy")]
            name: std::sync::OnceLock::new(),
        }
    }

    /// The plot's label.
    pub fn label(&self) -> &'static str {
        self.label
    }

    /// Record `value` (nothing without the feature or a running client).
    #[inline]
    pub fn value(&self, value: f64) {
        #[cfg(feature = "tracy")]
        if let Some(client) = tracy_client::Client::running() {
            let name = *self
                .name
                .get_or_init(|| tracy_client::PlotName::new_leak(self.label.to_owned()));
            client.plot(name, value);
        }
        #[cfg(not(feature = "tracy"))]
        let _ = value;
    }
}
