//! Mutated inputs for parser property tests: start from valid encodings (a seed
//! corpus), derive a few thousand near-misses, and run a parser on each, catching
//! panics so a failure names the input that caused it.
//!
//! Besides random mutations (bit flips, interesting byte and word values, cuts,
//! insertions, deletions, duplications, splices of two seeds), every seed also gets
//! systematic ones: truncations, and *length-field inflation* — every little-endian
//! `u16`/`u32`/`u64` whose value could be a length, count or offset in the input is
//! replaced by one past it, twice it and the type's maximum.
//!
//! ```
//! use ferry_testkit::mutate;
//!
//! /// A toy format: a length byte, then that many bytes.
//! fn parse(bytes: &[u8]) -> Result<&[u8], String> {
//!     let (&len, rest) = bytes.split_first().ok_or("empty")?;
//!     rest.get(..usize::from(len)).ok_or_else(|| format!("{len} bytes announced"))
//! }
//!
//! let seeds = vec![b"\x03abc".to_vec(), b"\x00".to_vec()];
//! let tally = mutate::check("toy", &mutate::mutants(&seeds, 3000, 1), |bytes| {
//!     match parse(bytes) {
//!         Ok(body) => {
//!             assert_eq!(body.len(), usize::from(bytes[0]));
//!             true
//!         }
//!         Err(why) => {
//!             assert!(!why.is_empty());
//!             false
//!         }
//!     }
//! });
//! assert!(tally.accepted > 0 && tally.refused > 0);
//! ```

use std::fmt::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::Rng;

/// One derived input and how it was made.
#[derive(Clone, Debug)]
pub struct Mutant {
    /// The input bytes.
    pub bytes: Vec<u8>,
    /// The mutations applied, for the failure message (e.g. `seed 2: flip bit 3 of 17`).
    pub how: String,
}

/// Truncations kept per seed: every cut for short seeds, evenly spaced ones beyond.
const CUTS_PER_SEED_MAX: usize = 256;
/// Length-field inflations kept per seed.
const INFLATIONS_PER_SEED_MAX: usize = 512;

/// The seeds themselves, their systematic mutations, and `random_count` random ones
/// (deterministic for a given `rng_seed`).
pub fn mutants(seeds: &[Vec<u8>], random_count: usize, rng_seed: u64) -> Vec<Mutant> {
    let mut out = Vec::new();
    for (s, seed) in seeds.iter().enumerate() {
        out.push(Mutant {
            bytes: seed.clone(),
            how: format!("seed {s} as is"),
        });
        truncations(s, seed, &mut out);
        inflations(s, seed, &mut out);
    }
    if seeds.is_empty() {
        return out;
    }
    let mut rng = Rng::new(rng_seed);
    for _ in 0..random_count {
        let s = rng.index(seeds.len());
        let mut bytes = seeds[s].clone();
        let mut how = format!("seed {s}:");
        for _ in 0..1 + rng.index(4) {
            mutate_once(&mut rng, seeds, &mut bytes, &mut how);
        }
        out.push(Mutant { bytes, how });
    }
    out
}

fn truncations(s: usize, seed: &[u8], out: &mut Vec<Mutant>) {
    let step = seed.len().div_ceil(CUTS_PER_SEED_MAX).max(1);
    let mut cuts: Vec<usize> = (0..seed.len()).step_by(step).collect();
    // The last bytes matter most (trailing fields, checksums): keep every such cut.
    cuts.extend(seed.len().saturating_sub(16)..seed.len());
    cuts.sort_unstable();
    cuts.dedup();
    for cut in cuts {
        out.push(Mutant {
            bytes: seed[..cut].to_vec(),
            how: format!("seed {s}: first {cut} of {} bytes", seed.len()),
        });
    }
}

fn inflations(s: usize, seed: &[u8], out: &mut Vec<Mutant>) {
    let len = seed.len() as u64;
    let mut kept = 0;
    for width in [2usize, 4, 8] {
        let max = if width == 8 {
            u64::MAX
        } else {
            (1u64 << (8 * width)) - 1
        };
        for at in 0..seed.len().saturating_sub(width - 1) {
            let value = read_le(&seed[at..at + width]);
            // Plausibly a length, count or offset into this input.
            if value == 0 || value > len.saturating_mul(4) {
                continue;
            }
            for new in [value + 1, value.saturating_mul(2).min(max), max] {
                if kept == INFLATIONS_PER_SEED_MAX {
                    return;
                }
                kept += 1;
                let mut bytes = seed.to_vec();
                write_le(&mut bytes[at..at + width], new);
                out.push(Mutant {
                    bytes,
                    how: format!("seed {s}: u{} at {at} from {value} to {new}", width * 8),
                });
            }
        }
    }
}

fn read_le(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .rev()
        .fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

fn write_le(bytes: &mut [u8], value: u64) {
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (value >> (8 * i)) as u8;
    }
}

fn mutate_once(rng: &mut Rng, seeds: &[Vec<u8>], bytes: &mut Vec<u8>, how: &mut String) {
    let len = bytes.len();
    match rng.below(10) {
        0 | 1 if len > 0 => {
            let at = rng.index(len);
            let bit = rng.below(8);
            bytes[at] ^= 1 << bit;
            let _ = write!(how, " flip bit {bit} of {at};");
        }
        2 if len > 0 => {
            let at = rng.index(len);
            let value = [0u8, 1, 0x7f, 0x80, 0xff][rng.index(5)];
            bytes[at] = value;
            let _ = write!(how, " byte {at} = {value:#x};");
        }
        3 if len >= 4 => {
            let at = rng.index(len - 3);
            let value = [0u32, 1, len as u32, len as u32 + 1, 0x7fff_ffff, u32::MAX][rng.index(6)];
            bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
            let _ = write!(how, " u32 at {at} = {value:#x};");
        }
        4 if len >= 8 => {
            let at = rng.index(len - 7);
            let value = [0u64, len as u64 + 1, 1 << 40, i64::MAX as u64, u64::MAX][rng.index(5)];
            bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
            let _ = write!(how, " u64 at {at} = {value:#x};");
        }
        5 => {
            let cut = rng.index(len + 1);
            bytes.truncate(cut);
            let _ = write!(how, " cut to {cut};");
        }
        6 if len > 0 => {
            let at = rng.index(len);
            let n = 1 + rng.index((len - at).min(16));
            bytes.drain(at..at + n);
            let _ = write!(how, " delete {n} at {at};");
        }
        7 => {
            let at = rng.index(len + 1);
            let mut extra = vec![0u8; 1 + rng.index(16)];
            rng.fill(&mut extra);
            let n = extra.len();
            bytes.splice(at..at, extra);
            let _ = write!(how, " insert {n} random at {at};");
        }
        8 if len > 0 => {
            let at = rng.index(len);
            let n = 1 + rng.index((len - at).min(64));
            let chunk = bytes[at..at + n].to_vec();
            let to = rng.index(len + 1);
            bytes.splice(to..to, chunk);
            let _ = write!(how, " copy {n} from {at} to {to};");
        }
        _ => {
            let other = rng.index(seeds.len());
            let donor = &seeds[other];
            let keep = rng.index(len + 1);
            let from = rng.index(donor.len() + 1);
            bytes.truncate(keep);
            bytes.extend_from_slice(&donor[from..]);
            let _ = write!(how, " first {keep} + seed {other} from {from};");
        }
    }
}

/// How a run of [`check`] went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Inputs run.
    pub total: usize,
    /// Inputs the parser accepted (the closure returned `true`).
    pub accepted: usize,
    /// Inputs the parser refused (the closure returned `false`).
    pub refused: usize,
}

/// Run `parse` on every mutant. It returns whether the input was accepted, and panics
/// (an assertion) on anything wrong: a panic of the parser or of an assertion is
/// caught and re-raised naming `what`, the mutant, how it was made and its bytes.
#[track_caller]
pub fn check(what: &str, mutants: &[Mutant], mut parse: impl FnMut(&[u8]) -> bool) -> Tally {
    let mut tally = Tally::default();
    for (i, mutant) in mutants.iter().enumerate() {
        match catch_unwind(AssertUnwindSafe(|| parse(&mutant.bytes))) {
            Ok(true) => tally.accepted += 1,
            Ok(false) => tally.refused += 1,
            Err(panic) => {
                let message = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)");
                panic!(
                    "{what}: mutant #{i} ({}) panicked: {message}\ninput ({} bytes): {}",
                    mutant.how,
                    mutant.bytes.len(),
                    hex(&mutant.bytes)
                );
            }
        }
        tally.total += 1;
    }
    tally
}

/// Lowercase hex of `bytes` (the form a failing input is reported in; write it to a
/// file with `xxd -r -p` to replay it under the fuzzer).
pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// The files of a committed seed directory (e.g. `metadata/fuzz/seeds/peer_md`), sorted
/// by name; an empty list when the directory does not exist.
pub fn seed_files(dir: &std::path::Path) -> Vec<Vec<u8>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<_> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}

/// The committed seeds of a fuzz target exist and equal what the encoders write now
/// (`valid`: file name → bytes), and `accepts` takes each: a format change that makes
/// them invalid fails here. `FERRY_BLESS_SEEDS=1` rewrites them from `valid` first.
#[track_caller]
pub fn check_committed_seeds(
    dir: &std::path::Path,
    valid: &[(&str, Vec<u8>)],
    mut accepts: impl FnMut(&str, &[u8]) -> bool,
) {
    for (name, bytes) in valid {
        let path = dir.join(name);
        if std::env::var_os("FERRY_BLESS_SEEDS").is_some() {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(&path, bytes).unwrap();
        }
        let committed = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (FERRY_BLESS_SEEDS=1 writes it)", path.display()));
        assert!(accepts(name, &committed), "{} is refused", path.display());
    }
}

/// The generated seeds (`valid`) plus the committed ones in `dir` and `random_count`
/// mutations of them through `parse` (see [`check`]); every seed must be accepted and
/// most mutants refused. Returns the tally for further checks.
#[track_caller]
pub fn check_seed_corpus(
    what: &str,
    dir: &std::path::Path,
    valid: &[(&str, Vec<u8>)],
    random_count: usize,
    rng_seed: u64,
    parse: impl FnMut(&[u8]) -> bool,
) -> Tally {
    let mut seeds: Vec<Vec<u8>> = valid.iter().map(|(_, b)| b.clone()).collect();
    seeds.extend(seed_files(dir));
    let mutants = mutants(&seeds, random_count, rng_seed);
    let tally = check(what, &mutants, parse);
    eprintln!("{what}: {tally:?}");
    assert!(
        tally.total > random_count && tally.accepted >= seeds.len(),
        "{what}: {tally:?}"
    );
    assert!(tally.refused > tally.total / 2, "{what}: {tally:?}");
    tally
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn systematic_and_random_mutants_are_made_deterministically() {
        let seeds = vec![vec![7u8, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7], b"xy".to_vec()];
        let a = mutants(&seeds, 100, 3);
        let b = mutants(&seeds, 100, 3);
        assert_eq!(
            a.iter().map(|m| &m.bytes).collect::<Vec<_>>(),
            b.iter().map(|m| &m.bytes).collect::<Vec<_>>()
        );
        // The u32 length 7 at offset 0 is inflated to 8, 14 and u32::MAX.
        assert!(a
            .iter()
            .any(|m| m.bytes.starts_with(&[8, 0, 0, 0]) && m.bytes.len() == 11));
        assert!(a
            .iter()
            .any(|m| m.bytes.starts_with(&[0xff; 4]) && m.bytes.len() == 11));
        // Every truncation of a short seed is there.
        for cut in 0..seeds[0].len() {
            assert!(a.iter().any(|m| m.bytes == seeds[0][..cut]));
        }
        assert!(a.len() > 100);
    }

    #[test]
    fn check_counts_and_names_the_failing_input() {
        let seeds = vec![b"abcdef".to_vec()];
        let all = mutants(&seeds, 50, 1);
        let tally = check("len", &all, |bytes| bytes.len() == 6);
        assert_eq!(tally.total, all.len());
        assert_eq!(tally.accepted + tally.refused, tally.total);
        assert!(tally.accepted >= 1 && tally.refused >= 1);

        let caught = catch_unwind(|| {
            check("short", &all, |bytes| {
                assert!(bytes.len() > 2, "too short");
                true
            })
        });
        let message = caught.unwrap_err().downcast::<String>().unwrap();
        assert!(message.contains("short: mutant #") && message.contains("too short"));
        assert!(message.contains("input (") && message.contains("seed 0"));
    }
}
