//! `--plot FILE.png`: GB/s and latency (average, and p99 of post to completion dashed)
//! against block size, one line per series (op and scheme, plus whatever else the sweep
//! varied besides block size). The block axis is a log scale with binary ticks (4 KiB,
//! 64 KiB, 1 MiB …), the sizes the sweep steps through.
//!
//! plotters draws text through ab_glyph with a TrueType font read at run time:
//! `FERRY_PLOT_FONT`, else DejaVu Sans or Liberation Sans where Debian puts them
//! (package `fonts-dejavu-core`). No font, no plot: a clear error, nothing else fails.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;

use super::sweep::{Row, SweepRun};
use super::Plan;

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Register a font under "sans-serif" once per process.
pub(super) fn font() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let candidates: Vec<String> = match std::env::var("FERRY_PLOT_FONT") {
            Ok(p) if !p.is_empty() => vec![p],
            _ => FONT_PATHS.iter().map(|s| s.to_string()).collect(),
        };
        for path in &candidates {
            if let Ok(bytes) = std::fs::read(path) {
                // plotters keeps fonts for the life of the process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                return plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                    .map_err(|_| format!("{path} is not a TrueType font plotters can read"));
            }
        }
        Err(format!(
            "--plot needs a TrueType font: none of {} exists (install fonts-dejavu-core, or set FERRY_PLOT_FONT to a .ttf file)",
            candidates.join(", ")
        ))
    })
    .clone()
}

fn series_name(plan: &Plan, r: &Row) -> String {
    let mut name = r.op.to_string();
    if plan.args.threads > 1 || plan.args.scheme.len() > 1 {
        name.push(' ');
        name.push_str(r.scheme);
    }
    if plan.args.request.len() > 1 {
        name.push(' ');
        name.push_str(r.request);
    }
    if plan.args.layout.len() > 1 {
        name.push(' ');
        name.push_str(r.layout);
    }
    if plan.batches.len() > 1 {
        name.push_str(&format!(" ×{}", r.batch));
    }
    name
}

/// A byte count in binary units (the sweep's sizes are powers of two): 4 KiB, 1 MiB.
fn binary_bytes(v: f64) -> String {
    let (x, unit) = if v >= (1u64 << 30) as f64 {
        (v / (1u64 << 30) as f64, "GiB")
    } else if v >= (1u64 << 20) as f64 {
        (v / (1u64 << 20) as f64, "MiB")
    } else if v >= 1024.0 {
        (v / 1024.0, "KiB")
    } else {
        (v, "B")
    };
    format!("{} {unit}", (x * 10.0).round() / 10.0)
}

/// Tick positions for the block axis: powers of two from `min` to `max`, thinned to
/// at most `most` of them by taking every 2nd, 4th … power.
fn binary_ticks(min: f64, max: f64, most: usize) -> Vec<f64> {
    let lo = min.max(1.0).log2().floor() as i32;
    let hi = max.max(1.0).log2().ceil() as i32;
    let all: Vec<f64> = (lo..=hi)
        .map(|e| 2f64.powi(e))
        .filter(|&v| v >= min * 0.999 && v <= max * 1.001)
        .collect();
    let step = all.len().div_ceil(most.max(1)).max(1);
    all.into_iter().step_by(step).collect()
}

/// Per series: (block bytes, GB/s, average latency µs, p99 post-to-completion µs).
type Series = BTreeMap<String, Vec<(f64, f64, f64, f64)>>;

/// Draw the plot of `run` to `path` (PNG).
pub fn draw(path: &Path, plan: &Plan, run: &SweepRun) -> Result<(), String> {
    font()?;
    let mut series: Series = BTreeMap::new();
    for r in &run.rows {
        series.entry(series_name(plan, r)).or_default().push((
            r.block_bytes as f64,
            r.gbps,
            r.lat_avg_us,
            r.xfer_p99_us,
        ));
    }
    let title = format!(
        "ferry bench xfer: {} {} → {}, {} worker(s), batch {}",
        plan.args.backend.name(),
        "DRAM",
        plan.target_kind.name(),
        plan.args.threads,
        if plan.batches.len() == 1 {
            plan.batches[0].to_string()
        } else {
            "varied".into()
        }
    );
    draw_inner(path, &title, &series).map_err(|e| format!("drawing {}: {e}", path.display()))
}

fn draw_inner(path: &Path, title: &str, series: &Series) -> Result<(), Box<dyn std::error::Error>> {
    let xs = series.values().flatten().map(|p| p.0);
    let x_min = xs.clone().fold(f64::INFINITY, f64::min).max(1.0);
    let x_max = xs.fold(0.0, f64::max).max(x_min * 2.0);
    let gb_max = series.values().flatten().map(|p| p.1).fold(0.0, f64::max);
    let lats = series.values().flatten().flat_map(|p| [p.2, p.3]);
    let lat_min = lats.clone().fold(f64::INFINITY, f64::min).max(0.01);
    let lat_max = lats.fold(0.0, f64::max).max(lat_min * 10.0);

    let root = BitMapBackend::new(path, (960, 860)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 20))?;
    let (top, bottom) = root.split_vertically(410);
    let x_fmt = |v: &f64| binary_bytes(*v);
    // plotters puts a log axis's labels on powers of ten; the sweep's sizes are powers
    // of two, so the axis gets them as explicit ticks instead.
    let ticks = binary_ticks(x_min, x_max, 10);
    let x_axis = || (x_min..x_max).log_scale().with_key_points(ticks.clone());

    let mut gb = ChartBuilder::on(&top)
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(72)
        .build_cartesian_2d(x_axis(), 0.0..(gb_max * 1.1).max(0.001))?;
    gb.configure_mesh()
        .x_desc("block size")
        .y_desc("GB/s")
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&|v: &f64| match gb_max {
            m if m >= 10.0 => format!("{v:.0}"),
            m if m >= 1.0 => format!("{v:.1}"),
            _ => format!("{v:.2}"),
        })
        .label_style(("sans-serif", 13))
        .draw()?;
    for (i, (name, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        gb.draw_series(
            points
                .iter()
                .map(|p| Circle::new((p.0, p.1), 3, color.filled())),
        )?;
        gb.draw_series(LineSeries::new(
            points.iter().map(|p| (p.0, p.1)),
            color.stroke_width(2),
        ))?
        .label(name.clone())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    gb.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()?;

    let mut lat = ChartBuilder::on(&bottom)
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(72)
        .build_cartesian_2d(x_axis(), (lat_min * 0.8..lat_max * 1.25).log_scale())?;
    lat.configure_mesh()
        .x_desc("block size")
        .y_desc("latency (µs): average, p99 dashed")
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&|v: &f64| format!("{v:.0}"))
        .label_style(("sans-serif", 13))
        .draw()?;
    for (i, (name, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        lat.draw_series(
            points
                .iter()
                .map(|p| Circle::new((p.0, p.2), 3, color.filled())),
        )?;
        lat.draw_series(LineSeries::new(
            points.iter().map(|p| (p.0, p.2)),
            color.stroke_width(2),
        ))?
        .label(name.clone())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        // p99 of post to completion, dashed, same colour.
        lat.draw_series(DashedLineSeries::new(
            points.iter().map(|p| (p.0, p.3)),
            6,
            4,
            color.stroke_width(1),
        ))?;
    }
    lat.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_ticks_are_powers_of_two_in_binary_units() {
        assert_eq!(binary_bytes(4096.0), "4 KiB");
        assert_eq!(binary_bytes((1u64 << 20) as f64), "1 MiB");
        assert_eq!(binary_bytes((64u64 << 20) as f64), "64 MiB");
        assert_eq!(binary_bytes((2u64 << 30) as f64), "2 GiB");
        assert_eq!(binary_bytes(512.0), "512 B");
        // 4 KiB .. 64 MiB: 15 powers of two, thinned to every 2nd.
        let t = binary_ticks(4096.0, (64u64 << 20) as f64, 10);
        assert_eq!(t.first(), Some(&4096.0));
        assert!(t.len() <= 10, "{t:?}");
        for w in t.windows(2) {
            assert_eq!(w[1] / w[0], 4.0, "{t:?}");
        }
        assert_eq!(binary_ticks(4096.0, 8192.0, 10), vec![4096.0, 8192.0]);
    }
}
