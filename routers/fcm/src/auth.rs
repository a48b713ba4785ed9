//! OAuth2 access tokens for one service account, shared by every push of a
//! project.
//!
//! `gcp_auth::CustomServiceAccount` signs the JWT-bearer grant and posts it
//! to the key's `token_uri`, and caches the token until 20 s before it
//! expires. It has no way to drop a token FCM refused, and callers that find
//! its token expired at the same moment each fetch a new one. So this keeps
//! the token itself: one fetch at a time (the others wait for it), renewed
//! ahead of expiry (5 minutes before, or at half its life if it is shorter),
//! and [`AccessTokens::refresh`] after a 401. Each fetch asks a fresh
//! `CustomServiceAccount`, whose empty cache guarantees a new token.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use autopush_common::router::RouterError;
use gcp_auth::TokenProvider;
use hyper::header::HeaderValue;
use tokio::time::Instant;

/// What FCM HTTP v1 requires of the token.
pub const SCOPE: &str = "https://www.googleapis.com/auth/firebase.messaging";

/// Renew this long before expiry (or at half-life for shorter tokens).
const RENEW_BEFORE_EXPIRY: Duration = Duration::from_secs(300);

/// An access token, with the `Authorization` header that carries it, built
/// once: a Google token is about a kilobyte, copied and checked per push
/// otherwise.
#[derive(Clone)]
pub struct Token {
    text: Arc<str>,
    pub(crate) header: HeaderValue,
}

impl Token {
    fn new(text: &str) -> Result<Token, RouterError> {
        let mut header = HeaderValue::try_from(format!("Bearer {text}")).map_err(|_| {
            RouterError::Upstream("the OAuth token endpoint sent an unusable token".into())
        })?;
        header.set_sensitive(true);
        Ok(Token {
            text: Arc::from(text),
            header,
        })
    }
}

#[derive(Clone)]
struct Current {
    token: Token,
    renew_at: Instant,
    expires_at: Instant,
}

pub struct AccessTokens {
    /// The service-account JSON (a secret: never logged).
    key: String,
    current: RwLock<Option<Current>>,
    /// Held while fetching, so one fetch serves every waiting push.
    fetching: tokio::sync::Mutex<()>,
}

impl AccessTokens {
    /// Check that `key` is a usable service-account JSON (no network).
    pub fn new(key: String) -> Result<Self, String> {
        gcp_auth::CustomServiceAccount::from_json(&key)
            .map_err(|e| format!("not a usable service-account key: {e}"))?;
        Ok(AccessTokens {
            key,
            current: RwLock::new(None),
            fetching: tokio::sync::Mutex::new(()),
        })
    }

    /// A token good for now, fetched only when there is none or it is due
    /// for renewal.
    pub async fn get(&self) -> Result<Token, RouterError> {
        if let Some(token) = self.fresh(None) {
            return Ok(token);
        }
        let _fetching = self.fetching.lock().await;
        if let Some(token) = self.fresh(None) {
            return Ok(token);
        }
        self.fetch().await
    }

    /// FCM refused `refused`: fetch a new token, unless another push did
    /// since.
    pub async fn refresh(&self, refused: &Token) -> Result<Token, RouterError> {
        let _fetching = self.fetching.lock().await;
        if let Some(token) = self.fresh(Some(&refused.text)) {
            return Ok(token);
        }
        self.fetch().await
    }

    /// The current token unless it is due for renewal or is `except`.
    fn fresh(&self, except: Option<&str>) -> Option<Token> {
        let current = self.current.read().ok()?.clone()?;
        (Instant::now() < current.renew_at && except != Some(&*current.token.text))
            .then_some(current.token)
    }

    async fn fetch(&self) -> Result<Token, RouterError> {
        let started = Instant::now();
        let result = match gcp_auth::CustomServiceAccount::from_json(&self.key) {
            Ok(account) => account.token(&[SCOPE]).await,
            Err(e) => Err(e),
        };
        let token = match result {
            Ok(token) => token,
            Err(e) => return self.fetch_failed(e),
        };
        let lifetime = seconds_until(token.expires_at().timestamp_millis());
        let renew_in = lifetime
            .saturating_sub(RENEW_BEFORE_EXPIRY)
            .max(lifetime / 2);
        let current = Current {
            token: Token::new(token.as_str())?,
            renew_at: started + renew_in,
            expires_at: started + lifetime,
        };
        tracing::debug!(
            lifetime_secs = lifetime.as_secs(),
            "FCM access token fetched"
        );
        let fresh = current.token.clone();
        if let Ok(mut slot) = self.current.write() {
            *slot = Some(current);
        }
        Ok(fresh)
    }

    /// The token endpoint failed: keep using a token that has not expired
    /// yet, if there is one; else tell why.
    fn fetch_failed(&self, error: gcp_auth::Error) -> Result<Token, RouterError> {
        let current = self.current.read().ok().and_then(|c| c.clone());
        if let Some(current) = current.filter(|c| Instant::now() < c.expires_at) {
            tracing::warn!(error = %error, "could not renew the FCM access token; using the current one until it expires");
            return Ok(current.token);
        }
        Err(match error {
            // The token endpoint answered, and not with a token: it refused the key.
            gcp_auth::Error::Str(_) => RouterError::Authentication,
            gcp_auth::Error::Json(..) => {
                RouterError::Upstream(format!("the OAuth token endpoint: {error}"))
            }
            other => RouterError::Connect(format!("the OAuth token endpoint: {other}")),
        })
    }
}

/// From now until `unix_millis` (zero if that has passed).
fn seconds_until(unix_millis: i64) -> Duration {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as i64;
    Duration::from_millis(unix_millis.saturating_sub(now).max(0) as u64)
}
