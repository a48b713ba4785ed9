//! How much the VAPID verification cache saves.
//!
//! Application servers mint one VAPID JWT and reuse it for hours, so in production
//! nearly every push repeats a token the endpoint has already verified. This measures
//! one token verified over and over, without the cache (an ECDSA P-256 verification
//! each time) and with it (a header parse, a SHA-256 and a map lookup).
//!
//! Run with `cargo run --release -p autopush-bench --bin vapid [iterations]
//! [cold|cached]` (the second argument runs one path alone, e.g. under
//! callgrind); a debug build measures the unoptimised elliptic-curve code and
//! means little.

use std::hint::black_box;
use std::time::{Duration, Instant};

use autopush_bench::app_server::AppServer;
use autopush_gateway::vapid::VapidVerifier;

const AUDIENCE: &str = "http://localhost:8082";
const DEFAULT_ITERATIONS: u32 = 20_000;
const WARM_UP: u32 = 200;

fn main() {
    let iterations = autopush_bench::count_argument("vapid [iterations > 0]", DEFAULT_ITERATIONS);
    let authorization = AppServer::new(AUDIENCE).authorization().to_owned();
    let cold = VapidVerifier::without_cache(AUDIENCE.to_owned());
    let cached = VapidVerifier::new(AUDIENCE.to_owned(), 1024);

    match std::env::args().nth(2).as_deref() {
        None => {}
        Some("cold") => return report("cold", ns_per_verify(&cold, &authorization, iterations)),
        Some("cached") => {
            return report("cached", ns_per_verify(&cached, &authorization, iterations));
        }
        Some(_) => {
            eprintln!("usage: vapid [iterations > 0] [cold|cached]");
            std::process::exit(2);
        }
    }
    let cold_ns = ns_per_verify(&cold, &authorization, iterations);
    let cached_ns = ns_per_verify(&cached, &authorization, iterations);
    println!("{iterations} verifications of one token");
    println!("cold   (without_cache): {cold_ns:>10.0} ns/verify");
    println!("cached (new):           {cached_ns:>10.0} ns/verify");
    println!("speed-up: {:.0}x", cold_ns / cached_ns);
}

fn report(path: &str, ns: f64) {
    println!("{path}: {ns:>10.0} ns/verify");
}

/// Mean wall-clock time per `verify`, after a short warm-up (which also fills the
/// cache, so the cached run measures hits only). Exits if the token is refused: timing
/// a failure path would be meaningless.
fn ns_per_verify(verifier: &VapidVerifier, authorization: &str, iterations: u32) -> f64 {
    let run = |count: u32| -> Duration {
        let start = Instant::now();
        for _ in 0..count {
            match verifier.verify(black_box(Some(authorization)), None) {
                Ok(Some(identity)) => {
                    black_box(identity);
                }
                other => {
                    eprintln!("benchmark token refused: {other:?}");
                    std::process::exit(1);
                }
            }
        }
        start.elapsed()
    };
    run(WARM_UP);
    run(iterations).as_nanos() as f64 / f64::from(iterations)
}
