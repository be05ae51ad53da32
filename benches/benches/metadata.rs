//! Metadata codec benchmarks: encode, validate + load and look up the metadata of an
//! agent with 15,000 registered regions (in the codec, and through two agents);
//! encode and decode a 15,000-descriptor list.
//!
//! Run: `cargo bench -p ferry-benches --bench metadata -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use ferry_metadata::{decode_descs, encode_descs, MdWriter, PeerMd};
use ferry_storage::{Desc, MemKind};
use ferry_testkit::Rng;
use ferry_tests::{loopback_agent, try_register, Buffer};

/// Regions (and descriptors) per agent, the size of the reference system's worst case.
const REGION_COUNT: usize = 15_000;
/// Lookups per `find` iteration.
const LOOKUP_COUNT: usize = 1_000;

/// One registered region and its public metadata.
struct Region {
    desc: Desc,
    public_md: Vec<u8>,
}

/// 15,000 KV-cache-block-sized regions 2 MiB apart on two GPUs (metadata only: the
/// codec encodes any memory kind, though no backend registers VRAM yet), in shuffled order
/// (the writer has to sort), each with 16..32 bytes of public metadata.
fn regions() -> Vec<Region> {
    let mut rng = Rng::new(1);
    let mut regions: Vec<Region> = (0..REGION_COUNT as u64)
        .map(|i| Region {
            desc: Desc::new(0x7f00_0000_0000 + (i / 2) * (2 << 20), 1 << 20, i % 2),
            public_md: (0..16 + rng.next_u64() % 17)
                .map(|b| (b ^ i) as u8)
                .collect(),
        })
        .collect();
    for i in (1..regions.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        regions.swap(i, j);
    }
    regions
}

/// The public metadata Ferry's UCX backend publishes for a DRAM region on this
/// machine: its 8-byte frame and the rkey UCX 1.23 (NIXL 1.5.1's wheel) packs with the
/// shared-memory and TCP transports. UCX 1.13 packs 20 bytes of the same kind. It is
/// the same for every region (these memory domains put nothing per region in it).
const UCX_RKEY: [u8; 27] = [
    0x46, 0x52, 0x4b, 0x31, 0x0b, 0x00, 0x00, 0x00, 0xc1, 0x94, 0x6f, 0xe2, 0xe3, 0xe1, 0xcc, 0x97,
    0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff,
];

/// 15,000 DRAM regions of 1 MiB, 2 MiB apart, registered in address order, each with
/// the UCX rkey above: what the UCX backend publishes for a KV cache in host memory.
fn ucx_regions() -> Vec<Region> {
    (0..REGION_COUNT as u64)
        .map(|i| Region {
            desc: Desc::new(0x7f00_0000_0000 + i * (2 << 20), 1 << 20, 0),
            public_md: UCX_RKEY.to_vec(),
        })
        .collect()
}

fn encode(regions: &[Region]) -> Vec<u8> {
    encode_kind(regions, MemKind::Vram)
}

fn encode_kind(regions: &[Region], kind: MemKind) -> Vec<u8> {
    let mut writer = MdWriter::new("prefill-worker-0", 1);
    let ucx = writer.backend("UCX", Some(&[0xab; 64]));
    // The engine knows its region count and metadata size, and says so.
    let public_md_len_bytes = regions.iter().map(|r| r.public_md.len()).sum();
    writer.reserve(ucx, kind, regions.len(), public_md_len_bytes);
    for region in regions {
        writer.region(ucx, kind, region.desc, &region.public_md);
    }
    writer.finish().expect("valid metadata")
}

fn bench_metadata(c: &mut Criterion) {
    let regions = regions();
    let blob = encode(&regions);
    let public_md_bytes: usize = regions.iter().map(|r| r.public_md.len()).sum();
    println!(
        "metadata of {REGION_COUNT} regions: {} bytes ({public_md_bytes} of them public md, {:.1} bytes/region)",
        blob.len(),
        blob.len() as f64 / REGION_COUNT as f64
    );

    let ucx = ucx_regions();
    let ucx_blob = encode_kind(&ucx, MemKind::Dram);
    println!(
        "metadata of {REGION_COUNT} DRAM regions with UCX rkeys: {} bytes ({:.1} bytes/region)",
        ucx_blob.len(),
        ucx_blob.len() as f64 / REGION_COUNT as f64
    );
    c.bench_function("metadata/ucx_rkeys_encode_load_15k", |b| {
        b.iter(|| {
            let blob = encode_kind(black_box(&ucx), MemKind::Dram);
            PeerMd::from_bytes(&blob).expect("valid")
        })
    });

    // The same through the engine: agent `a` (loopback backend) with 15,000
    // registered 64-byte DRAM regions publishes its metadata (`Agent::local_md`) and
    // agent `b` loads it as a new peer (`Agent::load_remote_md`: validation, the peer
    // view, each backend's `load_remote`); forgetting the peer again is not timed.
    let memory = Buffer::zeroed(REGION_COUNT * 64);
    let (a, b) = (loopback_agent("md-a"), loopback_agent("md-b"));
    for i in 0..REGION_COUNT {
        try_register(&a, MemKind::Dram, memory.desc(i * 64, 64)).expect("register");
    }
    c.bench_function("metadata/engine_local_md_load_15k", |bench| {
        bench.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                let blob = a.local_md().expect("local md");
                let peer = b.load_remote_md(&blob).expect("load");
                timed += start.elapsed();
                b.invalidate_remote_md(peer).expect("forget");
            }
            timed
        })
    });
    drop((a, b));

    c.bench_function("metadata/encode_15k_regions", |b| {
        b.iter(|| encode(black_box(&regions)))
    });
    // The usual case: regions registered in address order, so nothing is sorted.
    let mut sorted_regions: Vec<Region> = regions
        .iter()
        .map(|r| Region {
            desc: r.desc,
            public_md: r.public_md.clone(),
        })
        .collect();
    sorted_regions.sort_by_key(|r| (r.desc.dev, r.desc.addr));
    c.bench_function("metadata/encode_15k_regions_sorted_input", |b| {
        b.iter(|| encode(black_box(&sorted_regions)))
    });
    c.bench_function("metadata/validate_load_15k_regions", |b| {
        b.iter(|| PeerMd::from_bytes(black_box(&blob)).expect("valid"))
    });

    let peer = PeerMd::from_bytes(&blob).expect("valid");
    let mut rng = Rng::new(7);
    let queries: Vec<Desc> = (0..LOOKUP_COUNT)
        .map(|_| {
            let r = &regions[(rng.next_u64() % REGION_COUNT as u64) as usize].desc;
            let offset = rng.next_u64() % (r.len / 2);
            Desc::new(r.addr + offset, 4096, r.dev)
        })
        .collect();
    c.bench_function("metadata/find_x1000", |b| {
        b.iter(|| {
            let mut hits = 0u32;
            for q in &queries {
                hits += u32::from(peer.find(0, MemKind::Vram, black_box(*q)).is_some());
            }
            assert_eq!(hits as usize, LOOKUP_COUNT);
            hits
        })
    });

    let descs: Vec<Desc> = regions.iter().map(|r| r.desc).collect();
    let list = encode_descs(MemKind::Vram, &descs).expect("encodable");
    println!(
        "descriptor list of {REGION_COUNT} descriptors: {} bytes ({:.1} bytes/descriptor)",
        list.len(),
        list.len() as f64 / REGION_COUNT as f64
    );
    c.bench_function("descs/encode_15k", |b| {
        b.iter(|| encode_descs(MemKind::Vram, black_box(&descs)).expect("encodable"))
    });
    c.bench_function("descs/decode_15k", |b| {
        b.iter(|| decode_descs(black_box(&list)).expect("valid"))
    });
    c.bench_function("descs/encode_decode_15k", |b| {
        b.iter(|| {
            let bytes = encode_descs(MemKind::Vram, black_box(&descs)).expect("encodable");
            decode_descs(&bytes).expect("valid")
        })
    });
}

criterion_group!(benches, bench_metadata);
criterion_main!(benches);
