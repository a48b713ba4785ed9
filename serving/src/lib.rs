//! HTTP serving shared by every port of the service (websocket, internal
//! router API, public endpoint, metrics), so that no role depends on
//! another's crate to serve:
//!
//! * [`http`] serves HTTP/1.1 with timeouts and a connection cap, and says
//!   who the client is.
//! * [`health`] is the health and version routes of every public port.
//! * [`tls`] is the certificate of the public ports, and its reloads;
//!   [`tls_stream`] the connections over it.
//! * [`upgraded`] is a websocket's connection, back from hyper.

pub mod health;
pub mod http;
pub mod tls;
mod tls_record;
pub mod tls_stream;
pub mod upgraded;

/// The TLS tests' certificates and client, shared with the integration tests.
#[cfg(test)]
#[path = "../tests/support/mod.rs"]
mod test_support;
