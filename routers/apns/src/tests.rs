//! The router against the double: every answer Apple can give, as the
//! application server sees it.

use autopush_common::bridge::AppLimits;
use autopush_common::limit::Rate;
use autopush_common::router::{Router, RouterDataInput};
use autopush_common::{ApiError, Notification, RouterType, User};
use serde_json::json;
use uuid::Uuid;

use crate::double::{ApnsDouble, Outcome};
use crate::sender::TransportError;
use crate::settings::ApnsSettings;
use crate::{ApnsRouter, UPSTREAM_RETRY_AFTER};

const TOKEN: &str = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9";
const OTHER: &str = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

fn settings(timeout: f64, max_in_flight: usize) -> ApnsSettings {
    let channel = |topic: &str| {
        json!({"cert": "c.pem", "key": "k.pem", "topic": topic,
               "timeout": timeout, "max_in_flight": max_in_flight})
    };
    ApnsSettings::from_json(
        &json!({"firefox": channel("org.example.firefox"), "beta": channel("org.example.beta")})
            .to_string(),
    )
    .unwrap()
}

fn router(double: &std::sync::Arc<ApnsDouble>) -> ApnsRouter {
    double
        .router(&settings(5.0, 100), &AppLimits::default())
        .unwrap()
}

fn user(router: &ApnsRouter, token: &str, channel: &str) -> User {
    let input = RouterDataInput {
        token: Some(token.into()),
        ..Default::default()
    };
    User {
        uaid: Uuid::new_v4(),
        router_type: RouterType::Apns,
        router_data: Some(router.register(&input, channel).unwrap()),
        node_id: None,
        connected_at: 0,
        last_connect: 0,
        over_msg_limit: false,
        current_month: None,
        min_urgency: autopush_common::Urgency::VeryLow,
        wake_route: None,
        last_wake: 0,
    }
}

fn notification() -> Notification {
    Notification {
        channel_id: Uuid::new_v4(),
        version: "v1".into(),
        ttl: 60,
        timestamp: 1_000,
        topic: None,
        sortkey_timestamp: None,
        data: None,
        headers: None,
        urgency: None,
        durable: false,
    }
}

async fn push(router: &ApnsRouter, user: &User) -> Result<(), ApiError> {
    router
        .route_notification(notification(), user)
        .await
        .map(|_| ())
}

#[tokio::test]
async fn accepted_goes_to_the_channel_topic() {
    let double = ApnsDouble::new();
    let router = router(&double);
    push(&router, &user(&router, TOKEN, "beta")).await.unwrap();
    let recorded = double.recorded();
    assert_eq!(recorded.len(), 1);
    assert_eq!(recorded[0].channel, "beta");
    assert_eq!(recorded[0].request.headers.topic, "org.example.beta");
    assert_eq!(recorded[0].request.device_token, TOKEN);
}

#[tokio::test]
async fn unknown_channels_are_not_served() {
    let double = ApnsDouble::new();
    let router = router(&double);
    let input = RouterDataInput {
        token: Some(TOKEN.into()),
        ..Default::default()
    };
    let err = ApiError::from(router.register(&input, "nightly").unwrap_err());
    assert_eq!((err.status().as_u16(), err.errno()), (400, 108));
}

#[tokio::test]
async fn each_answer_maps_to_what_the_sender_is_told() {
    let cases: Vec<(Outcome, u16, u16)> = vec![
        (Outcome::refused(400, "BadDeviceToken"), 410, 106),
        (Outcome::refused(410, "Unregistered"), 410, 106),
        (Outcome::refused(400, "DeviceTokenNotForTopic"), 410, 106),
        (Outcome::refused(403, "ExpiredProviderToken"), 502, 901),
        (Outcome::refused(403, "InvalidProviderToken"), 502, 901),
        (Outcome::refused(403, "BadCertificate"), 502, 901),
        (Outcome::refused(403, "BadCertificateEnvironment"), 502, 901),
        (Outcome::refused(400, "BadTopic"), 502, 902),
        (Outcome::refused(400, "SomethingAppleAddedLater"), 502, 902),
        (Outcome::Fail(TransportError::Timeout), 502, 903),
        (
            Outcome::Fail(TransportError::Request("bad".into())),
            502,
            902,
        ),
    ];
    for (outcome, status, errno) in cases {
        let double = ApnsDouble::new();
        let router = router(&double);
        double.script(TOKEN, [outcome.clone()]);
        let err = push(&router, &user(&router, TOKEN, "firefox"))
            .await
            .unwrap_err();
        assert_eq!(
            (err.status().as_u16(), err.errno()),
            (status, errno),
            "{outcome:?}: {err}"
        );
        assert_eq!(double.recorded().len(), 1, "{outcome:?} is not retried");
    }
}

#[tokio::test]
async fn busy_or_failing_apple_is_retried_until_it_answers() {
    for outcome in [
        Outcome::refused(503, "ServiceUnavailable"),
        Outcome::refused(500, "InternalServerError"),
        Outcome::Fail(TransportError::Connect("connection reset".into())),
    ] {
        let double = ApnsDouble::new();
        let router = router(&double);
        double.script(TOKEN, [outcome.clone(), outcome.clone()]);
        push(&router, &user(&router, TOKEN, "firefox"))
            .await
            .unwrap_or_else(|e| panic!("{outcome:?} twice then 200: {e}"));
        assert_eq!(double.recorded().len(), 3, "{outcome:?}");
    }
}

#[tokio::test]
async fn too_many_requests_is_a_429_at_once() {
    let double = ApnsDouble::new();
    let router = router(&double);
    double.script(TOKEN, [Outcome::refused(429, "TooManyRequests")]);
    let err = push(&router, &user(&router, TOKEN, "firefox"))
        .await
        .unwrap_err();
    assert_eq!((err.status().as_u16(), err.errno()), (429, 201));
    assert_eq!(err.retry_after(), Some(30));
    assert_eq!(double.recorded().len(), 1, "not retried");
}

#[tokio::test]
async fn each_channel_has_its_own_rate() {
    let double = ApnsDouble::new();
    let limits = AppLimits::new(Rate::new(0.001, 1.0), 100);
    let router = double.router(&settings(5.0, 100), &limits).unwrap();
    let firefox = user(&router, TOKEN, "firefox");
    push(&router, &firefox).await.unwrap();
    let err = push(&router, &firefox).await.unwrap_err();
    assert_eq!((err.status().as_u16(), err.errno()), (429, 201));
    push(&router, &user(&router, OTHER, "beta")).await.unwrap();
    assert_eq!(double.recorded().len(), 2, "the refused push reached Apple");
}

#[tokio::test]
async fn retries_are_bounded_then_the_sender_is_told() {
    let busy = ApiError::BridgeUnavailable {
        retry_after: UPSTREAM_RETRY_AFTER.as_secs(),
    };
    let cases = [
        (Outcome::refused(503, "ServiceUnavailable"), busy),
        (
            Outcome::refused(500, "InternalServerError"),
            ApiError::BridgeConnect(String::new()),
        ),
        (
            Outcome::Fail(TransportError::Connect("refused".into())),
            ApiError::BridgeConnect(String::new()),
        ),
    ];
    for (outcome, expected) in cases {
        let double = ApnsDouble::new();
        let router = router(&double);
        double.script(TOKEN, std::iter::repeat_n(outcome.clone(), 10));
        let err = push(&router, &user(&router, TOKEN, "firefox"))
            .await
            .unwrap_err();
        assert_eq!(
            (err.status(), err.errno()),
            (expected.status(), expected.errno()),
            "{outcome:?}"
        );
        assert_eq!(err.retry_after(), expected.retry_after(), "{outcome:?}");
        assert_eq!(double.recorded().len(), 3, "{outcome:?}: three attempts");
    }
}

#[tokio::test]
async fn a_silent_apple_ends_at_the_deadline_without_delaying_other_channels() {
    let double = ApnsDouble::new();
    let router = std::sync::Arc::new(
        double
            .router(&settings(0.5, 100), &AppLimits::default())
            .unwrap(),
    );
    double.script(TOKEN, [Outcome::Hang]);
    let slow_user = user(&router, TOKEN, "firefox");
    let slow = tokio::spawn({
        let router = router.clone();
        async move { push(&router, &slow_user).await }
    });
    double.wait_for(1).await;
    // While firefox's push hangs, beta's goes through.
    push(&router, &user(&router, OTHER, "beta")).await.unwrap();
    let err = slow.await.unwrap().unwrap_err();
    assert_eq!((err.status().as_u16(), err.errno()), (502, 903));
}

#[tokio::test]
async fn beyond_the_in_flight_cap_senders_are_asked_to_come_back() {
    let double = ApnsDouble::new();
    let router = std::sync::Arc::new(
        double
            .router(&settings(2.0, 1), &AppLimits::default())
            .unwrap(),
    );
    double.script(TOKEN, [Outcome::Hang]);
    let first = user(&router, TOKEN, "firefox");
    let held = tokio::spawn({
        let router = router.clone();
        async move { push(&router, &first).await }
    });
    double.wait_for(1).await;
    let err = push(&router, &user(&router, OTHER, "firefox"))
        .await
        .unwrap_err();
    assert_eq!((err.status().as_u16(), err.errno()), (503, 201));
    assert_eq!(err.retry_after(), Some(crate::BUSY_RETRY_AFTER.as_secs()));
    // The other channel has its own cap.
    push(&router, &user(&router, OTHER, "beta")).await.unwrap();
    held.abort();
}

#[tokio::test]
async fn a_payload_over_apples_limit_is_never_sent() {
    let double = ApnsDouble::new();
    let router = router(&double);
    let mut n = notification();
    n.data = Some("A".repeat(5000));
    let err = router
        .route_notification(n, &user(&router, TOKEN, "firefox"))
        .await
        .unwrap_err();
    assert_eq!((err.status().as_u16(), err.errno()), (413, 104));
    assert!(double.recorded().is_empty());
}

/// Log lines written while it is alive, on this thread.
struct CapturedLogs {
    lines: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    _guard: tracing::subscriber::DefaultGuard,
}

impl CapturedLogs {
    fn start() -> CapturedLogs {
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .finish();
        CapturedLogs {
            lines,
            _guard: tracing::subscriber::set_default(subscriber),
        }
    }

    fn count(&self, needle: &str) -> usize {
        let text = String::from_utf8_lossy(&self.lines.lock().unwrap()).into_owned();
        text.lines().filter(|l| l.contains(needle)).count()
    }
}

struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn refused_credentials_are_logged_once_per_outage_naming_the_channel() {
    let logs = CapturedLogs::start();
    let double = ApnsDouble::new();
    let router = router(&double);
    let user = user(&router, TOKEN, "firefox");
    let refused = Outcome::refused(403, "ExpiredProviderToken");
    double.script(TOKEN, [refused.clone(), refused.clone(), refused.clone()]);
    for _ in 0..3 {
        push(&router, &user).await.unwrap_err();
    }
    let alarm = "refused our credentials";
    assert_eq!(logs.count(alarm), 1);
    assert_eq!(logs.count("app=\"firefox\""), 1);
    // Accepted again, then refused again: a new outage, a new line.
    push(&router, &user).await.unwrap();
    double.script(TOKEN, [refused]);
    push(&router, &user).await.unwrap_err();
    assert_eq!(logs.count(alarm), 2);
}

#[tokio::test]
async fn unknown_reasons_are_logged_with_the_reason_but_not_the_token() {
    let logs = CapturedLogs::start();
    let double = ApnsDouble::new();
    let router = router(&double);
    double.script(TOKEN, [Outcome::refused(400, "ANewReasonAppleAdded")]);
    push(&router, &user(&router, TOKEN, "beta"))
        .await
        .unwrap_err();
    assert_eq!(logs.count("ANewReasonAppleAdded"), 1);
    assert_eq!(logs.count(TOKEN), 0);
}
