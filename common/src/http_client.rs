//! Every HTTP client the service (and its tests and load generator) builds.
//!
//! The reqwest clients (the node router, `autopush check`, the tests) speak
//! plain HTTP. FCM's client (`autopush-fcm`) speaks TLS through rustls on
//! the process's default crypto provider, which must be installed before it
//! is built: [`install_crypto_provider`] installs ring, once. [`builder`]
//! calls it too, so a reqwest client given TLS later needs nothing more.

use std::sync::Once;

/// A reqwest client builder, with ring installed as the process's rustls
/// crypto provider.
#[cfg(feature = "http-client")]
pub fn builder() -> reqwest::ClientBuilder {
    install_crypto_provider();
    reqwest::Client::builder()
}

/// Make ring the process's rustls crypto provider (a no-op after the first
/// call, or if the process installed one already).
pub fn install_crypto_provider() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // Err only when a provider is installed already: that one stays.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// A client's error with its causes, for the log: the cause that says it
/// best ("Connection refused", a certificate refused) sits deep, and the
/// clients' own text says only "error sending request" or "client error
/// (Connect)".
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(all(test, feature = "http-client"))]
mod tests {
    /// reqwest panics at `build` when no provider is installed: the builder
    /// must make one available.
    #[test]
    fn clients_build() {
        super::builder().build().expect("a client");
        assert!(rustls::crypto::CryptoProvider::get_default().is_some());
    }
}
