//! Load generators for autopush: the service under test, the user agents and
//! the application servers that drive it, and one module per scenario.

pub mod app_server;
pub mod client;
pub mod delay;
pub mod open_loop;
pub mod scenario;
pub mod server;
pub mod slab;
pub mod stand_in;
pub mod stats;
pub mod tls;
pub mod try_bridges;
pub mod wire;

/// The micro-benchmarks' one optional argument: a count above zero, or
/// `default` when none is given; anything else prints `usage` and exits 2.
pub fn count_argument<T>(usage: &str, default: T) -> T
where
    T: std::str::FromStr + PartialOrd + Default,
{
    match std::env::args().nth(1) {
        None => default,
        Some(arg) => match arg.parse() {
            Ok(n) if n > T::default() => n,
            _ => {
                eprintln!("usage: {usage}");
                std::process::exit(2);
            }
        },
    }
}
