//! Load generators for autopush: the service under test, the user agents and
//! the application servers that drive it, and one module per scenario.

pub mod app_server;
pub mod client;
pub mod scenario;
pub mod server;
pub mod stats;
