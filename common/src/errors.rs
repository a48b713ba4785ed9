//! The error table of the public HTTP API: every failure a user can see, with
//! its HTTP status and its stable `errno` (see the autopush "Error Codes").

use http::StatusCode;
use serde::Serialize;

use crate::limit_headers::RateLimit;

/// Where the errno table is documented for senders.
pub const ERROR_URL: &str = "http://autopush.readthedocs.io/en/latest/http.html#error-codes";

pub type ApiResult<T> = Result<T, ApiError>;

/// Whole seconds to wait, rounded up: `Retry-After: 0` would invite a storm.
pub fn retry_after_secs(wait: std::time::Duration) -> u64 {
    (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1)
}

/// Seconds a sender to a full mailbox is asked to wait.
pub const MAILBOX_FULL_RETRY_AFTER: u64 = 60;

/// Seconds a sender is asked to wait when its subscription holds the most
/// of a full hold (messages below the user agent's minimum urgency).
pub const HOLD_FULL_RETRY_AFTER: u64 = 60;

/// A failure of an API call, rendered as `{code, errno, error, message, more_info}`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    #[error("Invalid endpoint token")]
    InvalidToken,
    #[error("Invalid message id")]
    InvalidMessageId,
    #[error("No such user (the subscription has expired)")]
    NoUser,
    #[error("Data payload too large: at most {0} bytes")]
    PayloadTooLarge(usize),
    #[error(
        "Data payload too large for this subscription's bridge: at most {0} bytes. The device \
         is reached through a bridge (APNs or FCM) whose messages carry the body base64-encoded \
         with the encryption headers, so bridged messages hold less than Web Push ones"
    )]
    BridgePayloadTooLarge(usize),
    #[error("No such subscription")]
    NoSubscription,
    #[error("Invalid router type")]
    InvalidRouterType,
    /// The router type is served, but not for this app (APNs channel, FCM
    /// app, GCM sender id).
    #[error("No app {0:?} is configured for this router type")]
    UnknownApp(String),
    #[error("Invalid authentication: {0}")]
    InvalidAuthentication(String),
    #[error("Invalid encryption headers: {0}")]
    InvalidEncryption(String),
    #[error("Missing TTL header")]
    MissingTtl,
    #[error("Invalid TTL header: {0}")]
    InvalidTtl(String),
    #[error("Invalid Topic header: {0}")]
    InvalidTopic(String),
    #[error("Invalid request: {0}")]
    BadRequest(String),
    #[error("The device is no longer registered with its bridge")]
    DeviceGone,
    #[error("The bridge refused our credentials")]
    BridgeAuthentication,
    /// The detail, for the log only.
    #[error("Could not reach the bridge: {0}")]
    BridgeConnect(String),
    #[error("The bridge did not answer in time")]
    BridgeTimeout,
    #[error("The bridge is busy; retry after {retry_after} seconds")]
    BridgeUnavailable { retry_after: u64 },
    #[error("Not found")]
    NotFound,
    /// A receipt asked of a service that keeps none (`--receipt-retention 0`).
    #[error(
        "Receipts are off on this service (receipt_retention is 0): the push was accepted, \
         but what became of it is not kept"
    )]
    ReceiptsOff,
    /// A known path asked with a method it does not take (`allowed`).
    #[error("Method not allowed: this path takes {allowed} only")]
    MethodNotAllowed { allowed: &'static str },
    /// Over a rate limit (`what` names it: "sender", "subscription",
    /// "source address", "bridge app", "bridge"); `limit` is the one that
    /// refused, and its `reset` the seconds to back off.
    #[error("Too many requests for this {what}; retry after {} seconds", .limit.reset)]
    TooManyRequests {
        what: &'static str,
        limit: RateLimit,
    },
    /// A bridge registration's mailbox holds its most messages: the app
    /// has not fetched them yet.
    #[error(
        "The app's mailbox is full ({0} messages waiting); retry once the app has fetched them"
    )]
    MailboxFull(usize),
    /// The user agent holds its most messages below its minimum urgency
    /// (`held`, of at most `bound`), and this subscription holds the most
    /// of them.
    #[error(
        "The user agent holds {held} messages below its minimum urgency, the most of them for \
         this subscription; retry once it has lowered its minimum and taken them"
    )]
    HoldFull { held: usize, bound: usize },
    /// The backend's detail, for the log only (see [`ApiError::public_message`]).
    #[error("Storage unavailable: {0}")]
    Storage(String),
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        use ApiError::*;
        match self {
            InvalidToken | InvalidMessageId | NotFound | ReceiptsOff => StatusCode::NOT_FOUND,
            NoUser | NoSubscription | DeviceGone => StatusCode::GONE,
            BridgeAuthentication | BridgeConnect(_) | BridgeTimeout => StatusCode::BAD_GATEWAY,
            PayloadTooLarge(_) | BridgePayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            InvalidRouterType | UnknownApp(_) | InvalidEncryption(_) | MissingTtl
            | InvalidTtl(_) | InvalidTopic(_) | BadRequest(_) => StatusCode::BAD_REQUEST,
            InvalidAuthentication(_) => StatusCode::UNAUTHORIZED,
            Storage(_) | BridgeUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            TooManyRequests { .. } | MailboxFull(_) | HoldFull { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
        }
    }

    pub fn errno(&self) -> u16 {
        use ApiError::*;
        match self {
            // "Invalid URL endpoint": the one errno of a 404.
            InvalidToken | InvalidMessageId | NotFound | ReceiptsOff => 102,
            NoUser => 103,
            PayloadTooLarge(_) | BridgePayloadTooLarge(_) => 104,
            NoSubscription | DeviceGone => 106,
            BridgeAuthentication => 901,
            BridgeConnect(_) => 902,
            BridgeTimeout => 903,
            InvalidRouterType | UnknownApp(_) => 108,
            InvalidAuthentication(_) => 109,
            InvalidEncryption(_) | BadRequest(_) => 110,
            MissingTtl => 111,
            InvalidTtl(_) => 112,
            InvalidTopic(_) => 113,
            // "Use exponential back-off for retries".
            Storage(_)
            | BridgeUnavailable { .. }
            | TooManyRequests { .. }
            | MailboxFull(_)
            | HoldFull { .. } => 201,
            MethodNotAllowed { .. } => 999,
        }
    }

    /// Seconds the sender should wait before retrying (`Retry-After`), for
    /// the errors that invite a retry: for a 429, what its
    /// [`ApiError::rate_limit`] says.
    pub fn retry_after(&self) -> Option<u64> {
        if let Some(limit) = self.rate_limit() {
            return Some(limit.reset.max(1));
        }
        match self {
            ApiError::BridgeUnavailable { retry_after } => Some((*retry_after).max(1)),
            ApiError::Storage(_) => Some(120),
            _ => None,
        }
    }

    /// The limit that refused a 429, for its `RateLimit-Policy` and
    /// `RateLimit` headers: every 429 names one.
    pub fn rate_limit(&self) -> Option<RateLimit> {
        match self {
            ApiError::TooManyRequests { limit, .. } => Some(*limit),
            ApiError::MailboxFull(size) => {
                Some(RateLimit::full("mailbox", *size, MAILBOX_FULL_RETRY_AFTER))
            }
            ApiError::HoldFull { bound, .. } => {
                Some(RateLimit::full("hold", *bound, HOLD_FULL_RETRY_AFTER))
            }
            _ => None,
        }
    }

    /// What senders are told. Failures of our own backends (storage, a
    /// bridge we could not reach) say only that: their
    /// detail (error codes, table names, AWS accounts and roles, upstream
    /// answers) is for the log, where the error's `Display` puts it.
    pub fn public_message(&self) -> String {
        match self {
            ApiError::Storage(_) => "Storage unavailable; retry after the Retry-After delay".into(),
            ApiError::BridgeConnect(_) => "Could not reach the bridge".into(),
            other => other.to_string(),
        }
    }

    /// The JSON body senders receive.
    pub fn body(&self) -> ErrorBody {
        let status = self.status();
        ErrorBody {
            code: status.as_u16(),
            errno: self.errno(),
            error: status.canonical_reason().unwrap_or("Error"),
            message: self.public_message(),
            more_info: ERROR_URL,
        }
    }
}

/// The serialized form of an [`ApiError`].
#[derive(Debug, Serialize)]
pub struct ErrorBody {
    pub code: u16,
    pub errno: u16,
    pub error: &'static str,
    pub message: String,
    pub more_info: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_carries_status_and_errno() {
        let body = ApiError::MissingTtl.body();
        assert_eq!(
            (body.code, body.errno, body.error),
            (400, 111, "Bad Request")
        );
        let body = ApiError::NoSubscription.body();
        assert_eq!((body.code, body.errno), (410, 106));
    }

    #[test]
    fn every_429_names_the_limit_that_refused_and_waits_as_it_says() {
        let errors = [
            ApiError::TooManyRequests {
                what: "bridge",
                limit: RateLimit::upstream(30),
            },
            ApiError::MailboxFull(100),
            ApiError::HoldFull {
                held: 101,
                bound: 100,
            },
        ];
        for error in errors {
            assert_eq!(error.status(), StatusCode::TOO_MANY_REQUESTS);
            let limit = error.rate_limit().expect("a 429 names its limit");
            assert_eq!(error.retry_after(), Some(limit.reset), "{error:?}");
        }
        let hold = ApiError::HoldFull {
            held: 101,
            bound: 100,
        };
        assert_eq!(
            hold.rate_limit().map(|l| (l.policy, l.quota)),
            Some(("hold", 100))
        );
        assert!(hold.to_string().contains("holds 101 messages"), "{hold}");
        assert_eq!(ApiError::Storage(String::new()).rate_limit(), None);
    }

    #[test]
    fn backend_detail_is_logged_not_shown() {
        let detail = "DynamoDB GetItem: AccessDeniedException: arn:aws:sts::123456789012:x";
        for error in [
            ApiError::Storage(detail.into()),
            ApiError::BridgeConnect(detail.into()),
        ] {
            let body = error.body();
            assert!(!body.message.contains("arn:aws"), "{}", body.message);
            assert!(error.to_string().contains(detail), "{error}");
        }
        let body = ApiError::Storage(detail.into()).body();
        assert_eq!((body.code, body.errno), (503, 201));
    }
}
