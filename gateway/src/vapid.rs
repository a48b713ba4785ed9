//! VAPID (RFC 8292) verification.
