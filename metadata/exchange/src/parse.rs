//! Parsing and checking configuration values: shared by the settings of the exchange
//! (`config.rs`), of P2P (`p2p/config.rs`) and of each store (`stores/*/config.rs`).

use std::net::SocketAddr;
use std::time::Duration;

use ferry_storage::{Error, Subject};

/// Longest timeout (I/O, fetch, P2P idle); longer ones are clamped with a warning.
pub const TIMEOUT_MAX: Duration = Duration::from_secs(24 * 3600);

pub(crate) fn bad_var(name: &'static str, value: &str, reason: &'static str) -> Error {
    Error::invalid(
        Subject::Named(format!("environment variable {name}='{value}'").into()),
        reason,
    )
}

pub(crate) fn parse_ms(name: &'static str, v: &str) -> Result<Duration, Error> {
    v.trim()
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| bad_var(name, v, "expected a whole number of milliseconds"))
}

pub(crate) fn parse_addr_or_off(name: &'static str, v: &str) -> Result<Option<SocketAddr>, Error> {
    let v = v.trim();
    if v.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    v.parse()
        .map(Some)
        .map_err(|_| bad_var(name, v, "expected IP:PORT (e.g. 127.0.0.1:0) or 'off'"))
}

/// Clamp `value` to `max`, with a warning naming `what`.
pub(crate) fn clamp(value: &mut Duration, max: Duration, what: &str) {
    if *value > max {
        log::warn!(
            "exchange config: {what} of {} ms is over the maximum of {} ms; using the maximum",
            value.as_millis(),
            max.as_millis()
        );
        *value = max;
    }
}

pub(crate) fn check_duration(what: &str, value: Duration, max: Duration) -> Result<(), Error> {
    let reason = if value.is_zero() {
        "must be above zero".to_owned()
    } else if value > max {
        format!("must be at most {} ms", max.as_millis())
    } else {
        return Ok(());
    };
    Err(Error::invalid(
        Subject::Named(format!("{what} = {} ms", value.as_millis()).into()),
        reason,
    ))
}

/// A `1`/`0` (or `true`/`false`, `on`/`off`) switch named `name`.
pub(crate) fn parse_switch(name: &'static str, v: &str) -> Result<bool, Error> {
    match v.trim() {
        "1" | "true" | "on" => Ok(true),
        "0" | "false" | "off" => Ok(false),
        _ => Err(bad_var(name, v, "expected 1 or 0")),
    }
}
