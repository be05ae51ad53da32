//! What recording the agent's metrics costs per request: `record_request` is what the
//! executor adds to one request's life (the post's three counters, the completion's
//! counter, latency bucket and sum); `snapshot` is one reader's copy (a scrape reads
//! one per agent). Single-threaded, as recording is (it runs under the world lock).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ferry::metrics::Metrics;

fn record(c: &mut Criterion) {
    let metrics = Metrics::default();
    metrics.set_backend(0, "LOOPBACK");
    let mut group = c.benchmark_group("metrics");
    group.throughput(Throughput::Elements(1));
    let mut latency = Duration::from_micros(3);
    group.bench_function("record_request", |b| {
        b.iter(|| {
            metrics.posted(black_box(0), black_box(65536), black_box(16));
            latency += Duration::from_nanos(7);
            metrics.completed(black_box(0), black_box(Some(latency)), None);
        })
    });
    group.bench_function("snapshot", |b| b.iter(|| black_box(metrics.snapshot())));
    group.finish();
    let s = metrics.snapshot();
    let b = s.backend("LOOPBACK").expect("named");
    assert!(b.posted > 0 && b.posted == b.completed && b.latency_count() == b.posted);
}

criterion_group!(benches, record);
criterion_main!(benches);
