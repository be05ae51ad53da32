//! Output of `ferry bench xfer`: a table on stdout, CSV, JSON-lines and JSON files,
//! rows streamed as they are measured.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

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

/// Where the rows go while the sweep runs: the table on stdout, the CSV and JSON-lines
/// files (each row written and flushed as soon as its case is measured, so an
/// interrupted or failed sweep keeps every finished row), and the paths of the JSON
/// document and the plot, written at the end from the rows there are.
///
/// [`Outputs::open`] runs before anything else: an unwritable path is refused before
/// the target process starts or a case runs.
pub struct Outputs {
    csv: Option<(PathBuf, BufWriter<File>)>,
    jsonl: Option<(PathBuf, BufWriter<File>)>,
    json: Option<PathBuf>,
    plot: Option<PathBuf>,
    check: bool,
    vary_scheme: bool,
    vary_request: bool,
    vary_layout: bool,
}

fn create(path: &Path, what: &str) -> Result<File, String> {
    File::create(path).map_err(|e| format!("{what} {}: {e}", path.display()))
}

impl Outputs {
    /// Create every output file `plan` names (the CSV gets its header now), and check
    /// that a plot can be drawn (a font is there).
    pub fn open(plan: &Plan) -> Result<Outputs, String> {
        let a = &plan.args;
        let mut csv = match &a.csv {
            Some(p) => Some((p.clone(), BufWriter::new(create(p, "--csv")?))),
            None => None,
        };
        if let Some((p, w)) = &mut csv {
            writeln!(w, "{}", COLUMNS.join(","))
                .and_then(|()| w.flush())
                .map_err(|e| format!("--csv {}: {e}", p.display()))?;
        }
        let jsonl = match &a.jsonl {
            Some(p) => Some((p.clone(), BufWriter::new(create(p, "--jsonl")?))),
            None => None,
        };
        // Written at the end; created now so that a bad path stops us before the run.
        if let Some(p) = &a.json {
            create(p, "--json")?;
        }
        if let Some(p) = &a.plot {
            create(p, "--plot")?;
            super::plot::font()?;
        }
        Ok(Outputs {
            csv,
            jsonl,
            json: a.json.clone(),
            plot: a.plot.clone(),
            check: a.check,
            vary_scheme: a.scheme.len() > 1,
            vary_request: a.request.len() > 1,
            vary_layout: a.layout.len() > 1,
        })
    }

    /// Print the configuration and the table's header (once the set-up is done).
    pub fn begin(&mut self, config: &[(String, String)]) {
        let cfg: Vec<String> = config.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        println!("ferry bench xfer — {}", cfg.join("; "));
        println!(
            "{:<5} {}{}{}{:>9} {:>6} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>7} {:>11} {:<10} {:<8}{}",
            "op",
            pad(self.vary_scheme, "scheme", 12),
            pad(self.vary_request, "request", 9),
            pad(self.vary_layout, "layout", 11),
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
            if self.check { "  check" } else { "" }
        );
    }

    /// One measured row: a table line, a CSV line, a JSON line, each flushed.
    pub fn row(&mut self, r: &Row) -> Result<(), String> {
        println!(
            "{:<5} {}{}{}{:>9} {:>6} {:>9.3} {:>10.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10.2} {:>10.2} {:>10.3e} {:>7} {:>11} {:<10} {:<8}{}",
            r.op,
            pad(self.vary_scheme, r.scheme, 12),
            pad(self.vary_request, r.request, 9),
            pad(self.vary_layout, r.layout, 11),
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
            if self.check { format!("  {}", check_text(r.check)) } else { String::new() }
        );
        if let Some((p, w)) = &mut self.csv {
            writeln!(w, "{}", cells(r).join(","))
                .and_then(|()| w.flush())
                .map_err(|e| format!("--csv {}: {e}", p.display()))?;
        }
        if let Some((p, w)) = &mut self.jsonl {
            writeln!(w, "{}", row_json(r))
                .and_then(|()| w.flush())
                .map_err(|e| format!("--jsonl {}: {e}", p.display()))?;
        }
        Ok(())
    }

    /// The run failed before its first case (set-up): remove the JSON and plot files
    /// created empty by [`Outputs::open`] (the CSV and JSON lines keep their header /
    /// stay empty: no rows were measured).
    pub fn abandon(self) {
        for p in [&self.json, &self.plot].into_iter().flatten() {
            let _ = std::fs::remove_file(p);
        }
    }

    /// The end of the run, complete or not: the JSON document and the plot of the rows
    /// there are.
    pub fn finish(self, plan: &Plan, run: &SweepRun) -> Result<(), String> {
        if let Some(path) = &self.json {
            write_json(path, plan, run)?;
        }
        if let Some(path) = &self.plot {
            if run.rows.is_empty() {
                // Nothing to draw: leave no empty file that looks like a plot.
                let _ = std::fs::remove_file(path);
            } else {
                super::plot::draw(path, plan, run)?;
            }
        }
        Ok(())
    }
}

fn pad(on: bool, text: &str, width: usize) -> String {
    if on {
        format!("{text:<width$}")
    } else {
        String::new()
    }
}

fn row_json(r: &Row) -> serde_json::Value {
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
}

/// Write `{"config": {...}, "rows": [...], "metrics": {agent: {...}}}` (the metrics:
/// each initiator agent's at the end, in [`crate::metrics::compact`] form).
fn write_json(path: &Path, plan: &Plan, run: &SweepRun) -> Result<(), String> {
    let config: serde_json::Map<String, serde_json::Value> = run
        .config
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    let rows: Vec<_> = run.rows.iter().map(row_json).collect();
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
        "cases": run.cases,
        "stopped": run.stopped,
        "rows": rows,
        "metrics": metrics,
    });
    let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))
}
