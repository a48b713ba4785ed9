//! What the rate limiter costs a push, and its memory at its key cap.
//!
//! Every accepted push takes one token from one limiter (its sender's, or
//! for an unsigned push its subscription's and its address's). This times
//! that check for a sender seen before (the common case) and for a fresh
//! sender each time (a flood of new keys past the cap, the worst case), and
//! reads the process's resident memory before and after filling a limiter
//! of 32-byte keys (VAPID key hashes) to its cap.
//!
//! Run with `cargo run --release -p autopush-bench --bin limiter [max_keys]`.

use std::hint::black_box;
use std::time::Instant;

use autopush_common::limit::{Limiter, Rate};

const DEFAULT_MAX_KEYS: usize = 100_000;
const CHECKS: u64 = 2_000_000;

fn main() {
    let max_keys = autopush_bench::count_argument("limiter [max_keys > 0]", DEFAULT_MAX_KEYS);
    // Never reached: every check passes, as for senders within their limit.
    let rate = Rate::new(1e9, 1e9).expect("a rate");

    let hot: Limiter<[u8; 32]> = Limiter::new(rate, max_keys);
    let hot_ns = ns_per_check(CHECKS, |i| {
        let key = key((i % 1000) as usize);
        black_box(hot.check(&key)).is_ok()
    });

    let rss_before = rss_kib();
    let fresh: Limiter<[u8; 32]> = Limiter::new(rate, max_keys);
    let fresh_ns = ns_per_check(CHECKS, |i| {
        let key = key(i as usize);
        black_box(fresh.check(&key)).is_ok()
    });
    let rss_after = rss_kib();

    println!("| check | ns per push |");
    println!("|---|---:|");
    println!("| a sender seen before (1 000 senders) | {hot_ns:.0} |");
    println!("| a new sender every push, past the cap | {fresh_ns:.0} |");
    println!();
    println!(
        "{} keys tracked (cap {max_keys}): {} KiB resident, {:.0} bytes per key",
        fresh.len(),
        rss_after.saturating_sub(rss_before),
        (rss_after.saturating_sub(rss_before) * 1024) as f64 / fresh.len().max(1) as f64
    );
}

/// A 32-byte key from `i` (as a VAPID key hash is).
fn key(i: usize) -> [u8; 32] {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&(i as u64).to_le_bytes());
    key
}

fn ns_per_check(n: u64, mut check: impl FnMut(u64) -> bool) -> f64 {
    let started = Instant::now();
    let mut passed = 0u64;
    for i in 0..n {
        passed += u64::from(check(i));
    }
    assert_eq!(passed, n, "a check within the rate was refused");
    started.elapsed().as_nanos() as f64 / n as f64
}

/// This process's resident memory, from /proc (0 where there is none).
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}
