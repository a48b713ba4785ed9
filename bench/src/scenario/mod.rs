//! One module per measurement; each starts its own server and prints a
//! Markdown table.

pub mod apns;
pub mod direct;
pub mod drain;
pub mod fcm;
pub mod handshakes;
pub mod idle;
pub mod requests;
