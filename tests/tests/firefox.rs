//! Tier 3: a real browser. Headless Firefox ESR (Debian's `firefox-esr`),
//! driven with marionette_driver through `tests/firefox/drive.py`, lives a
//! whole subscription against the service: subscribe from a page, receive
//! pushes in its service worker in both encodings, quit, receive what was sent
//! while it was away, unsubscribe. Then the same over `wss://`, as a real
//! deployment: Firefox trusts the test CA (imported into its profile with
//! NSS's certutil) and reaches the service through nginx. Fails (never
//! skips) when Firefox, certutil or nginx cannot run.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use std::path::Path;

use autopush_tests::firefox::Firefox;
use autopush_tests::nginx::{Nginx, PublicPorts};
use autopush_tests::*;
use serde_json::Value;

/// Hang guard for Firefox to receive a push and its service worker to report it.
const DELIVERY_GUARD: Duration = Duration::from_secs(60);

/// `GET {router}/user/{uaid}` until `pred` holds (hang guard); returns the record.
async fn wait_for_user(
    server: &Server,
    uaid: &str,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let path = format!("/user/{uaid}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let reply = server.router_call(reqwest::Method::GET, &path, None).await;
        if reply.status == 200 && pred(&reply.json) {
            return reply.json;
        }
        assert!(
            Instant::now() < deadline,
            "the user record never showed {what}: {} {}",
            reply.status,
            reply.text
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn is_connected(user: &Value) -> bool {
    user["node_id"].as_str().is_some_and(|n| !n.is_empty())
}

fn push_texts(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            assert_eq!(e["kind"], "push", "the service worker reported {e}");
            e["text"]
                .as_str()
                .unwrap_or_else(|| panic!("a push without data: {e}"))
                .to_string()
        })
        .collect()
}

/// Send `text` with pywebpush as the app server that holds `vapid`.
async fn send(sub: &Subscription, vapid: &VapidKey, text: &str, encoding: Encoding) -> SendResult {
    // aes128gcm with RFC 8292 VAPID, aesgcm with the older `WebPush` scheme:
    // the pairs senders use in practice.
    let scheme = match encoding {
        Encoding::Aes128Gcm => VapidScheme::Vapid,
        Encoding::AesGcm => VapidScheme::WebPush,
    };
    sub.send(
        &SendOptions::text(text)
            .encoding(encoding)
            .ttl(600)
            .vapid(vapid)
            .vapid_scheme(scheme),
    )
    .await
}

#[tokio::test]
async fn firefox_lives_a_whole_subscription() {
    let server = Server::start().await;
    let vapid = VapidKey::generate().await;
    let mut ff = Firefox::launch(&server.ws_url()).await;
    let started = ff.start().await;
    eprintln!("Firefox {} (pid {})", started["version"], started["pid"]);

    // Firefox drops a subscribe() made before its push service said hello:
    // wait for the UAID the hello reply set, and for the server to agree.
    let uaid = ff.ready().await;
    assert!(is_uaid(&uaid), "Firefox's UAID {uaid:?}");
    wait_for_user(&server, &uaid, "Firefox connected", is_connected).await;

    // 1. The page subscribes with the app server's VAPID key.
    let json = ff.subscribe(&vapid.public_key).await;
    let endpoint = json["endpoint"]
        .as_str()
        .unwrap_or_else(|| panic!("no endpoint in {json}"))
        .to_string();
    assert!(
        endpoint.starts_with(&format!("{}/wpush/v2/", server.endpoint_base())),
        "a subscription with an applicationServerKey gets a restricted endpoint: {endpoint}"
    );
    let sub = Subscription {
        channel_id: String::new(), // Firefox's; the test never needs it
        endpoint,
        keys: Keys {
            private_key: String::new(), // stays in Firefox
            p256dh: json["keys"]["p256dh"].as_str().expect("p256dh").to_string(),
            auth: json["keys"]["auth"].as_str().expect("auth").to_string(),
        },
        vapid: Some(vapid.clone()),
    };
    let user = wait_for_user(&server, &uaid, "one channel", |u| {
        u["channels"].as_array().is_some_and(|c| c.len() == 1)
    })
    .await;
    assert!(is_connected(&user), "{user}");

    // 2. Online: the service worker gets the exact plaintext, both encodings.
    let mut expected = Vec::new();
    for (encoding, text) in [
        (
            Encoding::Aes128Gcm,
            "online, aes128gcm: héllo ✓".to_string(),
        ),
        (Encoding::AesGcm, "online, aesgcm: héllo ✓".to_string()),
        (Encoding::Aes128Gcm, data_pattern(MAX_PLAINTEXT)),
    ] {
        send(&sub, &vapid, &text, encoding).await.assert_created();
        expected.push(text);
        let events = ff.events(expected.len(), DELIVERY_GUARD).await;
        assert_eq!(push_texts(&events), expected, "what the service worker got");
    }
    // Acked: nothing is left stored for Firefox.
    wait_for_user(&server, &uaid, "no stored messages", |u| {
        u["stored_messages"] == 0
    })
    .await;

    // 3. Firefox quits; messages sent meanwhile are stored...
    ff.quit().await;
    let offline = [
        (Encoding::Aes128Gcm, "while away, aes128gcm"),
        (Encoding::AesGcm, "while away, aesgcm"),
    ];
    for (encoding, text) in offline {
        send(&sub, &vapid, text, encoding).await.assert_created();
    }
    wait_for_user(&server, &uaid, "two stored messages", |u| {
        u["stored_messages"] == 2
    })
    .await;

    // ...and delivered when it comes back with the same profile (its own
    // start-up reconnects the push service: no help from the test).
    ff.start().await;
    let events = ff.events(expected.len() + 2, DELIVERY_GUARD).await;
    let texts = push_texts(&events);
    assert_eq!(texts[..expected.len()], expected[..], "{texts:?}");
    let got: BTreeSet<&str> = texts[expected.len()..].iter().map(String::as_str).collect();
    let want: BTreeSet<&str> = offline.iter().map(|(_, t)| *t).collect();
    assert_eq!(got, want, "what the service worker got after the restart");
    expected.extend(texts[expected.len()..].iter().cloned());
    let user = wait_for_user(&server, &uaid, "the stored messages acked", |u| {
        u["stored_messages"] == 0
    })
    .await;
    assert!(is_connected(&user), "same UAID, connected again: {user}");
    // Acked, so not delivered again.
    let events = ff.events(expected.len() + 1, QUIET).await;
    assert_eq!(push_texts(&events), expected, "nothing delivered twice");

    // 4. The page unsubscribes; the old endpoint is gone.
    let reply = ff.unsubscribe().await;
    assert_eq!(reply["unsubscribed"], true, "{reply}");
    assert_eq!(reply["endpoint"], sub.endpoint.as_str(), "{reply}");
    assert!(reply["after"].is_null(), "{reply}");
    wait_for_user(&server, &uaid, "no channels", |u| {
        u["channels"].as_array().is_some_and(Vec::is_empty)
    })
    .await;
    for encoding in Encoding::ALL {
        let res = send(&sub, &vapid, "too late", encoding).await;
        assert_eq!(res.status, 410, "push after unsubscribe: {res:?}");
        let errno = res.json()["errno"].as_u64();
        assert!(matches!(errno, Some(103 | 106)), "errno: {}", res.body);
    }

    ff.exit().await;
}

/// Firefox behind Debian's nginx, configured as the docs show: TLS at nginx
/// with the test CA, the endpoint URL nginx's https one.
#[tokio::test]
async fn firefox_over_wss_through_nginx() {
    let ports = PublicPorts::pick();
    let server = Server::start_with(&["--endpoint-url", &ports.endpoint_url()]).await;
    let nginx = Nginx::start(ports, &server, 330);
    firefox_over_wss(
        &server,
        &nginx.wss_url(),
        &nginx.endpoint_url(),
        &cert_file("tls-ca.pem"),
    )
    .await;
}

#[tokio::test]
async fn firefox_over_the_services_own_tls() {
    let cert = cert_file("tls-127.0.0.1.pem");
    let key = cert_file("tls-127.0.0.1-key.pem");
    let server = Server::start_with(&[
        "--tls-cert",
        &cert.display().to_string(),
        "--tls-key",
        &key.display().to_string(),
    ])
    .await;
    firefox_over_wss(
        &server,
        &server.wss_url(),
        &server.https_endpoint_base(),
        &cert_file("tls-ca.pem"),
    )
    .await;
}

/// Firefox with `dom.push.serverURL = wss_url` and `ca` trusted, and no
/// testing pref for insecure URLs: it subscribes (its endpoint under
/// `endpoint_url`), receives a push sent there with pywebpush, and
/// unsubscribes.
async fn firefox_over_wss(server: &Server, wss_url: &str, endpoint_url: &str, ca: &Path) {
    let vapid = VapidKey::generate().await;
    let mut ff = Firefox::launch_with_ca(wss_url, ca).await;
    ff.start().await;
    let (uaid, prefs) = ff.ready_with_prefs().await;
    assert_eq!(prefs["serverURL"], wss_url, "{prefs}");
    assert_eq!(prefs["allowInsecureServerURL"], false, "{prefs}");
    wait_for_user(server, &uaid, "Firefox connected", is_connected).await;

    let json = ff.subscribe(&vapid.public_key).await;
    let endpoint = json["endpoint"]
        .as_str()
        .unwrap_or_else(|| panic!("no endpoint in {json}"))
        .to_string();
    assert!(
        endpoint.starts_with(&format!("{endpoint_url}/wpush/v2/")),
        "the endpoint Firefox got: {endpoint}"
    );
    let keys = Keys {
        private_key: String::new(), // stays in Firefox
        p256dh: json["keys"]["p256dh"].as_str().expect("p256dh").to_string(),
        auth: json["keys"]["auth"].as_str().expect("auth").to_string(),
    };
    let text = "over wss: héllo ✓";
    let opts = SendOptions::text(text).ttl(600).vapid(&vapid).ca_file(ca);
    autopush_tests::py::send(&endpoint, &keys, &opts)
        .await
        .assert_created();
    let events = ff.events(1, DELIVERY_GUARD).await;
    assert_eq!(push_texts(&events), [text], "what the service worker got");

    let reply = ff.unsubscribe().await;
    assert_eq!(reply["unsubscribed"], true, "{reply}");
    assert_eq!(reply["endpoint"], endpoint.as_str(), "{reply}");
    wait_for_user(server, &uaid, "no channels", |u| {
        u["channels"].as_array().is_some_and(Vec::is_empty)
    })
    .await;
    let gone = autopush_tests::py::send(&endpoint, &keys, &opts).await;
    assert_eq!(gone.status, 410, "push after unsubscribe: {gone:?}");

    ff.exit().await;
}
