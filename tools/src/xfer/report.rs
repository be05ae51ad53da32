//! Output of `ferry bench xfer`: a table on stdout, CSV and JSON files.

use std::path::Path;

use serde_json::json;

use super::sweep::{Row, SweepRun};
use super::Plan;
use crate::args::human_bytes;

/// CSV header; the JSON rows carry the same keys.
pub const COLUMNS: &[&str] = &[
    "scheme",
    "op",
    "request",
    "layout",
    "block_bytes",
    "batch",
    "workers",
    "requests_per_iter",
    "iters",
    "gbps",
    "lat_avg_us",
    "prep_avg_us",
    "prep_p99_us",
    "post_avg_us",
    "post_p99_us",
    "xfer_avg_us",
    "xfer_p99_us",
    "descs_per_s",
    "ranges",
    "est_us",
    "est_margin_us",
    "est_method",
    "via",
    "check",
];

fn check_text(c: Option<bool>) -> &'static str {
    match c {
        None => "",
        Some(true) => "ok",
        Some(false) => "FAILED",
    }
}

fn opt_us(v: Option<f64>) -> String {
    v.map_or_else(String::new, |v| format!("{v:.3}"))
}

fn cells(r: &Row) -> Vec<String> {
    vec![
        r.scheme.to_string(),
        r.op.to_string(),
        r.request.to_string(),
        r.layout.to_string(),
        r.block_bytes.to_string(),
        r.batch.to_string(),
        r.workers.to_string(),
        r.requests_per_iter.to_string(),
        r.iters.to_string(),
        format!("{:.4}", r.gbps),
        format!("{:.3}", r.lat_avg_us),
        format!("{:.3}", r.prep_avg_us),
        format!("{:.3}", r.prep_p99_us),
        format!("{:.3}", r.post_avg_us),
        format!("{:.3}", r.post_p99_us),
        format!("{:.3}", r.xfer_avg_us),
        format!("{:.3}", r.xfer_p99_us),
        format!("{:.0}", r.descs_per_s),
        r.ranges.to_string(),
        opt_us(r.est_us),
        opt_us(r.est_margin_us),
        r.est_method.to_string(),
        r.via.to_string(),
        check_text(r.check).to_string(),
    ]
}

/// Print the configuration and one line per row.
pub fn print_table(plan: &Plan, run: &SweepRun) {
    let cfg: Vec<String> = run
        .config
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect();
    println!("ferry bench xfer — {}", cfg.join("; "));
    let vary_scheme = plan.args.scheme.len() > 1;
    let vary_req = plan.args.request.len() > 1;
    let vary_layout = plan.args.layout.len() > 1;
    println!(
        "{:<5} {}{}{}{:>9} {:>6} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>7} {:>11} {:<10} {:<8}{}",
        "op",
        if vary_scheme {
            format!("{:<12}", "scheme")
        } else {
            String::new()
        },
        if vary_req {
            format!("{:<9}", "request")
        } else {
            String::new()
        },
        if vary_layout {
            format!("{:<11}", "layout")
        } else {
            String::new()
        },
        "block",
        "batch",
        "GB/s",
        "lat µs",
        "prep µs",
        "prep p99",
        "post µs",
        "post p99",
        "xfer µs",
        "xfer p99",
        "desc/s",
        "ranges",
        "est µs",
        "est by",
        "via",
        if plan.args.check { "  check" } else { "" }
    );
    for r in &run.rows {
        println!(
            "{:<5} {}{}{}{:>9} {:>6} {:>9.3} {:>10.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10.2} {:>10.2} {:>10.3e} {:>7} {:>11} {:<10} {:<8}{}",
            r.op,
            if vary_scheme { format!("{:<12}", r.scheme) } else { String::new() },
            if vary_req { format!("{:<9}", r.request) } else { String::new() },
            if vary_layout { format!("{:<11}", r.layout) } else { String::new() },
            human_bytes(r.block_bytes),
            r.batch,
            r.gbps,
            r.lat_avg_us,
            r.prep_avg_us,
            r.prep_p99_us,
            r.post_avg_us,
            r.post_p99_us,
            r.xfer_avg_us,
            r.xfer_p99_us,
            r.descs_per_s,
            r.ranges,
            r.est_us.map_or_else(|| "-".to_string(), |v| format!("{v:.2}")),
            if r.est_method.is_empty() { "-" } else { r.est_method },
            r.via,
            if plan.args.check { format!("  {}", check_text(r.check)) } else { String::new() }
        );
    }
}

/// Write the rows as CSV (header: [`COLUMNS`]).
pub fn write_csv(path: &Path, run: &SweepRun) -> Result<(), String> {
    let mut out = COLUMNS.join(",");
    out.push('\n');
    for r in &run.rows {
        out.push_str(&cells(r).join(","));
        out.push('\n');
    }
    std::fs::write(path, out).map_err(|e| format!("{}: {e}", path.display()))
}

/// Write `{"config": {...}, "rows": [...], "metrics": {agent: {...}}}` (the metrics:
/// each initiator agent's at the end, in [`crate::metrics::compact`] form).
pub fn write_json(path: &Path, plan: &Plan, run: &SweepRun) -> Result<(), String> {
    let config: serde_json::Map<String, serde_json::Value> = run
        .config
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    let rows: Vec<_> = run
        .rows
        .iter()
        .map(|r| {
            json!({
                "scheme": r.scheme,
                "op": r.op,
                "request": r.request,
                "layout": r.layout,
                "block_bytes": r.block_bytes,
                "batch": r.batch,
                "workers": r.workers,
                "requests_per_iter": r.requests_per_iter,
                "iters": r.iters,
                "gbps": r.gbps,
                "lat_avg_us": r.lat_avg_us,
                "prep_avg_us": r.prep_avg_us,
                "prep_p99_us": r.prep_p99_us,
                "post_avg_us": r.post_avg_us,
                "post_p99_us": r.post_p99_us,
                "xfer_avg_us": r.xfer_avg_us,
                "xfer_p99_us": r.xfer_p99_us,
                "descs_per_s": r.descs_per_s,
                "ranges": r.ranges,
                "est_us": r.est_us,
                "est_margin_us": r.est_margin_us,
                "est_method": (!r.est_method.is_empty()).then_some(r.est_method),
                "via": r.via,
                "check": r.check,
            })
        })
        .collect();
    let metrics: serde_json::Map<String, serde_json::Value> = run
        .metrics
        .iter()
        .map(|(name, m)| (name.clone(), crate::metrics::compact(m)))
        .collect();
    let doc = json!({
        "tool": "ferry bench xfer",
        "version": env!("CARGO_PKG_VERSION"),
        "threads": plan.args.threads,
        "config": config,
        "rows": rows,
        "metrics": metrics,
    });
    let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))
}
