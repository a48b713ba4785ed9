//! The `autopush` gateway: settings, wiring of the nodes, the public endpoint
//! HTTP API, VAPID, and the router registry.

pub mod app;
pub mod bridges;
pub mod check;
pub mod db;
pub mod diagnose;
pub mod endpoint;
/// Test support: the network parsers' properties, for `cargo test` and
/// the `fuzz/` targets (feature `fuzzing`); not in the binary.
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod keys;
pub mod limits;
pub mod logging;
pub mod metrics;
pub mod owner;
pub mod reference;
pub mod secrets;
pub mod settings;
pub mod sources;
pub mod vapid;
