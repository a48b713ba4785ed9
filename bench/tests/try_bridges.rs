//! `autopush-bench try-bridges` as docs/try-bridges.md uses it: the service
//! started with the settings file it printed takes an FCM registration with
//! a mailbox through `/v1`, a push to it reaches the Google stand-in (which
//! prints it and counts it), and the mailbox and the receipt tell the rest.
//!
//! Needs the autopush binary (`AUTOPUSH_BIN`, else target/debug/autopush).

use std::process::Stdio;
use std::time::Duration;

use autopush_tests::Server;
use autopush_tests::http::{self, HttpReply};
use autopush_tests::receipt;
use reqwest::Method;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

/// Generous: the first token fetch and the push take milliseconds.
const HANG_GUARD: Duration = Duration::from_secs(30);

struct TryBridges {
    _child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    printed: String,
    _dir: tempfile::TempDir,
}

impl TryBridges {
    async fn start() -> TryBridges {
        let dir = tempfile::tempdir().expect("a scratch dir");
        let mut child = Command::new(env!("CARGO_BIN_EXE_autopush-bench"))
            .args(["try-bridges", "--port", "0", "--dir"])
            .arg(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("autopush-bench try-bridges starts");
        let stdout = child.stdout.take().expect("its stdout");
        let mut try_bridges = TryBridges {
            _child: child,
            lines: BufReader::new(stdout).lines(),
            printed: String::new(),
            _dir: dir,
        };
        let intro = try_bridges.read_until("Ctrl-C stops").await;
        try_bridges.printed = intro;
        try_bridges
    }

    /// Read what it prints up to the line containing `marker`.
    async fn read_until(&mut self, marker: &str) -> String {
        let mut text = String::new();
        let read = async {
            while let Ok(Some(line)) = self.lines.next_line().await {
                text.push_str(&line);
                text.push('\n');
                if line.contains(marker) {
                    return true;
                }
            }
            false
        };
        let found = tokio::time::timeout(HANG_GUARD, read).await;
        assert!(
            matches!(found, Ok(true)),
            "try-bridges never printed {marker:?}; it printed:\n{}{text}",
            self.printed
        );
        text
    }

    /// The word after `before` in what it printed first.
    fn printed_after(&self, before: &str) -> String {
        self.printed
            .split(before)
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("no {before:?} in:\n{}", self.printed))
            .to_owned()
    }
}

async fn post_json(url: &str, body: serde_json::Value) -> HttpReply {
    http::request(
        Method::POST,
        url,
        &[("content-type", "application/json")],
        Some(body.to_string().into_bytes()),
    )
    .await
}

#[tokio::test]
async fn an_fcm_push_reaches_the_stand_in_and_its_mailbox_and_receipt_tell_the_rest() {
    let mut stand_in = TryBridges::start().await;
    let settings = stand_in.printed_after("--config ");
    let google = stand_in.printed_after("FCM HTTP v1) on ");
    assert!(
        stand_in.printed.contains("Apple: not available"),
        "{}",
        stand_in.printed
    );
    // The settings file as printed; Server picks free ports and a scratch store.
    let server = Server::start_with(&["--config", &settings]).await;
    let registration_url = format!("{}/v1/fcm/try/registration", server.endpoint_base());

    let token = "try-device-1";
    let registered = post_json(&registration_url, json!({"token": token, "mailbox": true})).await;
    assert_eq!(registered.status, 200, "{registered:?}");
    let (uaid, secret) = (registered.field("uaid"), registered.field("secret"));
    let pushed = http::request(
        Method::POST,
        &registered.field("endpoint"),
        &[("ttl", "60")],
        None,
    )
    .await;
    pushed.assert_created();
    let location = pushed.header("location").expect("Location").to_owned();

    let shown = stand_in.read_until("FCM received").await;
    assert!(
        shown.contains(&format!("project try-bridges token {token}")),
        "{shown}"
    );
    let stats = http::get(&format!("{google}/stats")).await;
    assert_eq!(stats.json["received"], 1, "{stats:?}");
    assert_eq!(stats.json["token_fetches"], 1, "{stats:?}");

    assert_eq!(receipt::state_of(&location).await, "bridged");
    let bearer = format!("Bearer {secret}");
    let messages_url = format!("{registration_url}/{uaid}/messages");
    let mailbox = http::request(
        Method::GET,
        &messages_url,
        &[("authorization", &bearer)],
        None,
    )
    .await;
    assert_eq!(mailbox.status, 200, "{mailbox:?}");
    let messages = mailbox.json["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 1, "{mailbox:?}");
    let version = messages[0]["ver"].as_str().expect("ver");
    assert_eq!(receipt::id_of(&location), version, "{mailbox:?}");

    let acked = http::request(
        Method::DELETE,
        &format!("{messages_url}/{version}"),
        &[("authorization", &bearer)],
        None,
    )
    .await;
    assert_eq!(acked.status, 200, "{acked:?}");
    assert_eq!(receipt::state_of(&location).await, "fetched");
}
