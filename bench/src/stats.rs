//! Latency samples and the figures reported from them.

use std::time::Duration;

/// Latencies in microseconds; a run records at most a few hundred thousand.
#[derive(Default)]
pub struct Latencies {
    micros: Vec<u64>,
}

impl Latencies {
    pub fn record(&mut self, latency: Duration) {
        self.micros.push(latency.as_micros() as u64);
    }

    /// Take in another set's samples.
    pub fn extend(&mut self, other: Latencies) {
        self.micros.extend(other.micros);
    }

    pub fn len(&self) -> usize {
        self.micros.len()
    }

    pub fn is_empty(&self) -> bool {
        self.micros.is_empty()
    }

    /// The `p`-th percentile (0..=100) in milliseconds; 0 when empty.
    pub fn percentile_ms(&mut self, p: f64) -> f64 {
        if self.micros.is_empty() {
            return 0.0;
        }
        self.micros.sort_unstable();
        let rank = ((p / 100.0) * (self.micros.len() - 1) as f64).round() as usize;
        self.micros[rank.min(self.micros.len() - 1)] as f64 / 1000.0
    }
}

/// A table's "offered" cell: the rate, or `max` for the closed loop (0).
pub fn offered_cell(offered: u64) -> String {
    match offered {
        0 => "max".to_owned(),
        n => n.to_string(),
    }
}

/// A table's cell for the answers that were not 201, by status (`0`: none).
pub fn refused_cell(refused: &std::collections::BTreeMap<u16, usize>) -> String {
    if refused.is_empty() {
        "0".to_owned()
    } else {
        format!("{refused:?}")
    }
}

/// Events per second.
pub fn rate(count: usize, elapsed: Duration) -> f64 {
    count as f64 / elapsed.as_secs_f64().max(1e-9)
}

/// A table's cell for requests to a store per push: `GetItem 1.00, PutItem
/// 0.50` (operations by name), `0` when there were none.
pub fn per_push_cell(counts: &std::collections::BTreeMap<String, usize>, pushes: usize) -> String {
    if counts.is_empty() {
        return "0".to_owned();
    }
    counts
        .iter()
        .map(|(operation, n)| format!("{operation} {:.2}", *n as f64 / pushes.max(1) as f64))
        .collect::<Vec<_>>()
        .join(", ")
}
