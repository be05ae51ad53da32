//! Value parsers shared by the subcommands: sizes with units, bounded durations,
//! `KEY=VALUE` pairs. Each returns a message a user can act on.

use std::time::Duration;

/// Largest size accepted anywhere (1 TiB): keeps every product of sizes in `u64`.
pub const SIZE_MAX_BYTES: u64 = 1 << 40;

/// A byte count such as `4096`, `64K`, `4KiB`, `1M`, `2G` (binary units; `K`, `KB`
/// and `KiB` all mean 1024), from 1 byte to [`SIZE_MAX_BYTES`].
pub fn size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits == 0 {
        return Err(format!(
            "'{text}' is not a size (expected a number with an optional unit: 4096, 64K, 1M, 2G)"
        ));
    }
    let (number, unit) = t.split_at(digits);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => {
            return Err(format!(
                "unknown unit '{other}' in '{text}' (use K, M, G or T)"
            ))
        }
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("'{text}' is too large (at most 1T)"))?;
    let bytes = n
        .checked_mul(1u64 << shift)
        .filter(|&b| b <= SIZE_MAX_BYTES)
        .ok_or_else(|| format!("'{text}' is too large (at most 1T)"))?;
    if bytes == 0 {
        return Err("a size must be at least 1 byte".into());
    }
    Ok(bytes)
}

/// Seconds as a decimal number, more than 0 and at most one day.
pub fn seconds(text: &str) -> Result<Duration, String> {
    let s: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("'{text}' is not a number of seconds"))?;
    if !s.is_finite() || s <= 0.0 {
        return Err(format!("'{text}': the time must be more than 0 seconds"));
    }
    if s > 86_400.0 {
        return Err(format!("'{text}': the time must be at most 86400 seconds"));
    }
    Ok(Duration::from_secs_f64(s))
}

/// A `KEY=VALUE` pair with a non-empty key.
pub fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(format!("'{text}' is not KEY=VALUE")),
    }
}

/// A `HOST:PORT` string (the host may be a name; resolved when used).
pub fn host_port(text: &str) -> Result<String, String> {
    let Some((host, port)) = text.rsplit_once(':') else {
        return Err(format!("'{text}' is not HOST:PORT"));
    };
    if host.is_empty() {
        return Err(format!("'{text}': the host is empty"));
    }
    port.parse::<u16>()
        .map_err(|_| format!("'{text}': the port must be a number from 0 to 65535"))?;
    Ok(text.to_string())
}

/// A byte count for people: `4 KiB`, `64 MiB`, `100 B`.
pub fn human_bytes(bytes: u64) -> String {
    if bytes >= 1 << 30 && bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(size("4096"), Ok(4096));
        assert_eq!(size("64K"), Ok(64 << 10));
        assert_eq!(size("4KiB"), Ok(4 << 10));
        assert_eq!(size("1m"), Ok(1 << 20));
        assert_eq!(size("2G"), Ok(2 << 30));
        for bad in [
            "",
            "-1",
            "0",
            "K",
            "1X",
            "2T1",
            "99999999999999999999",
            "2000T",
        ] {
            assert!(size(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn durations_and_pairs() {
        assert_eq!(seconds("0.5"), Ok(Duration::from_millis(500)));
        for bad in ["-1", "0", "nan", "inf", "1e9", "x"] {
            assert!(seconds(bad).is_err(), "{bad} accepted");
        }
        assert_eq!(key_value("a=b=c"), Ok(("a".into(), "b=c".into())));
        assert!(key_value("=x").is_err());
        assert!(host_port("localhost:29500").is_ok());
        assert!(host_port("localhost:70000").is_err());
        assert!(host_port(":1").is_err());
        assert_eq!(human_bytes(4096), "4 KiB");
        assert_eq!(human_bytes(100), "100 B");
    }
}
