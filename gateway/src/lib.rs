//! The `autopush` gateway: settings, wiring, and the public endpoint HTTP API.

pub mod vapid;
