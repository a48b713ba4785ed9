//! The real binary with APNs settings: it builds its a2 clients from the
//! test key material in `certs/` at start-up, serves registrations for the
//! configured channels only, refuses bad settings naming the channel and the
//! field, and `diagnose` shows a bridge user with its token masked. (Pushes
//! through the binary would go to Apple; `tests/apns.rs` covers them with a
//! double in the gateway's place.)

use autopush_tests::apns::device_token;
use autopush_tests::http::{self, HttpReply};
use autopush_tests::server::run_autopush;
use autopush_tests::*;
use reqwest::Method;
use serde_json::{Value, json};

fn channels() -> String {
    json!({
        "firefox": {
            "topic": "org.example.firefox",
            "sandbox": true,
            "key": cert_file("apns-token-key.p8"),
            "key_id": "TESTKEYID1",
            "team_id": "TESTTEAM01",
        },
        "beta": {
            "topic": "org.example.beta",
            "cert": cert_file("apns-cert.pem"),
            "key": cert_file("apns-cert-key.pem"),
        },
    })
    .to_string()
}

async fn register(server: &Server, channel: &str, body: Value) -> HttpReply {
    http::request(
        Method::POST,
        &format!("{}/v1/apns/{channel}/registration", server.endpoint_base()),
        &[("content-type", "application/json")],
        Some(body.to_string().into_bytes()),
    )
    .await
}

#[tokio::test]
async fn configured_channels_are_served_and_diagnose_masks_the_token() {
    let mut server = Server::start_with(&["--apns-channels", &channels()]).await;
    let log = server.stderr();
    let listed = log.lines().find(|l| l.contains("bridges:")).unwrap_or("");
    assert!(
        listed.contains("apns channels: beta, firefox") && listed.contains("fcm apps: none"),
        "no start-up line lists the channels:\n{log}"
    );
    assert!(!log.contains("PRIVATE KEY"), "{log}");
    let token = device_token();
    for channel in ["firefox", "beta"] {
        let reply = register(&server, channel, json!({"token": token})).await;
        assert_eq!(reply.status, 200, "{channel}: {}", reply.text);
    }
    register(&server, "nightly", json!({"token": token}))
        .await
        .assert_error(400, 108);
    register(&server, "firefox", json!({"token": "not-a-device-token"}))
        .await
        .assert_error(400, 110);

    let reply = register(&server, "beta", json!({"token": token})).await;
    let endpoint = reply.json["endpoint"].as_str().unwrap().to_owned();
    server.kill9();
    let db = server.data_dir().display().to_string();
    let out = run_autopush(&["diagnose", &endpoint, "--db", &db]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "diagnose: {stdout}");
    assert!(
        !stdout.contains(&token),
        "the full device token is shown: {stdout}"
    );
    let start = stdout.find('{').unwrap();
    let info: Value = serde_json::from_str(&stdout[start..]).unwrap();
    let user = &info["user"];
    assert_eq!(user["router_type"], "apns", "{info}");
    assert_eq!(user["router_data"]["rel_channel"], "beta", "{info}");
    let shown = user["router_data"]["token"].as_str().unwrap();
    assert!(
        shown.starts_with(&token[..4]) && shown.contains(&token[token.len() - 4..]),
        "{shown}"
    );
}

#[tokio::test]
async fn without_channels_apns_is_not_served() {
    let server = Server::start().await;
    register(&server, "firefox", json!({"token": device_token()}))
        .await
        .assert_error(400, 108);
}

#[tokio::test]
async fn bad_apns_settings_stop_the_start_up_naming_channel_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("db").display().to_string();
    let p8 = cert_file("apns-token-key.p8");
    let rsa = cert_file("apns-cert-key.pem");
    let token = |key: &std::path::Path| {
        json!({"firefox": {"topic": "t", "key": key, "key_id": "K", "team_id": "T"}}).to_string()
    };
    let toml = dir.path().join("autopush.toml");
    std::fs::write(
        &toml,
        format!(
            "[apns.channels.beta]\ntopic = \"t\"\ncert = \"{}\"\nkey = \"{}\"\nsandbx = true\n",
            cert_file("apns-cert.pem").display(),
            rsa.display()
        ),
    )
    .unwrap();
    let inline_secret = std::fs::read_to_string(&rsa).unwrap();
    let cases: Vec<(Vec<String>, &str, &str)> = vec![
        (
            vec!["--apns-channels".into(), token(&dir.path().join("missing.p8"))],
            "\"firefox\"",
            "key: cannot read",
        ),
        (
            vec!["--apns-channels".into(), token(&rsa)],
            "\"firefox\"",
            "key: not a P-256",
        ),
        (
            vec![
                "--apns-channels".into(),
                json!({"firefox": {"topic": "t", "key": inline_secret, "key_id": "K", "team_id": "T", "sandbox": "yes"}})
                    .to_string(),
            ],
            "\"firefox\"",
            "invalid type",
        ),
        (
            vec![
                "--apns-channels".into(),
                json!({"firefox": {"topic": "t", "key": p8, "key_id": "K"}}).to_string(),
            ],
            "\"firefox\"",
            "team_id",
        ),
        (
            vec![
                "--apns-channels".into(),
                json!({"beta": {"topic": "t", "cert": cert_file("apns-cert.pem"), "key": cert_file("apns-other-key.pem")}})
                    .to_string(),
            ],
            "\"beta\"",
            "key: does not match the certificate",
        ),
        (
            vec!["--config".into(), toml.display().to_string()],
            "beta",
            "sandbx",
        ),
    ];
    for (args, channel, field) in cases {
        let mut argv: Vec<&str> = vec!["all", "--db", &db];
        argv.extend(args.iter().map(String::as_str));
        let out = run_autopush(&argv).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert!(
            stderr.contains(channel) && stderr.contains(field),
            "{args:?}: {stderr}"
        );
        assert!(
            !stderr.contains("PRIVATE KEY"),
            "key material in the error: {stderr}"
        );
    }
}
