//! Every HTTP client the service (and its tests and load generator) builds.
//!
//! reqwest's TLS comes without a crypto provider of its own (its `rustls`
//! feature would bring aws-lc-rs: a second provider beside ring, and a C
//! build). rustls then takes the process's default provider, which must be
//! installed before the first client is built: [`builder`] installs ring,
//! once, so no caller can forget it.

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
