//! The binary's other subcommands: keygen, diagnose, and how `db` reports DynamoDB failures.

use autopush_tests::*;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE;
use serde_json::Value;

/// The first JSON object in `text` (which may hold log lines around it).
fn first_json_object(text: &str) -> Value {
    for (i, _) in text.match_indices('{') {
        let mut stream = serde_json::Deserializer::from_str(&text[i..]).into_iter::<Value>();
        if let Some(Ok(v @ Value::Object(_))) = stream.next() {
            return v;
        }
    }
    panic!("no JSON object in output:\n{text}");
}

async fn keygen() -> String {
    let out = server::run_autopush(&["keygen"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "autopush keygen: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .unwrap_or_else(|| panic!("keygen printed nothing"))
        .to_string()
}

#[tokio::test]
async fn keygen_prints_a_fernet_key() {
    let key = keygen().await;
    assert_eq!(key.len(), 44, "Fernet key is 44 chars: {key:?}");
    let raw = URL_SAFE
        .decode(&key)
        .unwrap_or_else(|e| panic!("Fernet key is base64url ({e}): {key:?}"));
    assert_eq!(raw.len(), 32, "{key:?}");
    assert_ne!(keygen().await, key, "keygen prints a new key each time");
}

#[tokio::test]
async fn diagnose_decodes_an_endpoint() {
    let mut server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let chid = new_channel_id();
    let reply = ws.register(&chid, None).await;
    let endpoint = reply["pushEndpoint"]
        .as_str()
        .expect("pushEndpoint")
        .to_string();
    ws.close().await;
    server.kill9();

    let db = server.data_dir().display().to_string();
    let out = server::run_autopush(&["diagnose", &endpoint, "--db", &db]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "autopush diagnose: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let info = first_json_object(&stdout);
    assert_eq!(
        info["uaid"].as_str().map(|u| u.replace('-', "")),
        Some(uaid),
        "{info}"
    );
    assert_eq!(info["channel_id"], chid.as_str(), "{info}");
}

#[tokio::test]
async fn diagnose_asks_the_running_server_with_its_router_key() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let chid = new_channel_id();
    let reply = ws.register(&chid, None).await;
    let endpoint = reply["pushEndpoint"].as_str().expect("pushEndpoint");

    // The server holds the store: diagnose reads the record over the
    // signed router API, with the key kept in the data dir.
    let db = server.data_dir().display().to_string();
    let node_url = server.router_base();
    let out =
        server::run_autopush(&["diagnose", endpoint, "--db", &db, "--node-url", &node_url]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "autopush diagnose: {stdout}");
    let info = first_json_object(&stdout);
    assert_eq!(info["user"]["uaid"], uaid.as_str(), "{info}");
    assert_eq!(info["channel_subscribed"], true, "{info}");
}

/// `diagnose` takes the service's own settings file, and says where it looked.
#[tokio::test]
async fn diagnose_reads_the_services_config_file() {
    let mut server = Server::start().await;
    let mut ws = server.client().await;
    let chid = new_channel_id();
    let reply = ws.register(&chid, None).await;
    let endpoint = reply["pushEndpoint"]
        .as_str()
        .expect("pushEndpoint")
        .to_string();
    ws.close().await;
    server.kill9();

    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("autopush.toml");
    let db = server.data_dir().display().to_string();
    std::fs::write(&config, format!("db = {db:?}\n")).expect("write config");
    let out = server::run_autopush(&[
        "diagnose",
        &endpoint,
        "--config",
        &config.display().to_string(),
    ])
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "autopush diagnose --config: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let info = first_json_object(&stdout);
    assert_eq!(info["channel_id"], chid.as_str(), "{info}");
    assert_eq!(info["data_dir"], db.as_str(), "{info}");
}

#[tokio::test]
async fn diagnose_names_the_directory_it_looked_in() {
    let cwd = tempfile::tempdir().expect("temp dir");
    let out = server::autopush_command()
        .args(["diagnose", "http://localhost:8082/wpush/v1/gAAAAtoken"])
        .current_dir(cwd.path())
        .output()
        .expect("run autopush diagnose");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let looked_in = cwd.path().join("autopush-data");
    assert!(
        stderr.contains(&format!("no data directory at {}", looked_in.display())),
        "{stderr}"
    );
    assert!(
        stderr.contains("--db DIR") && stderr.contains("--config FILE"),
        "{stderr}"
    );
}

/// Given the settings file alone, `diagnose` says the data directory came
/// from it, and does not ask for the `--config` it was given.
#[tokio::test]
async fn diagnose_with_config_alone_names_the_files_data_directory() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("autopush.toml");
    let missing = dir.path().join("no-such-dir");
    std::fs::write(
        &config,
        format!("db = {:?}\n", missing.display().to_string()),
    )
    .expect("write");
    let config = config.display().to_string();
    let url = "http://localhost:8082/wpush/v1/gAAAAtoken";
    let out = server::run_autopush(&["diagnose", url, "--config", &config]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let expected = format!(
        "no data directory at {} (the data directory is db in {config})",
        missing.display()
    );
    assert!(stderr.contains(&expected), "{stderr}");
    assert!(!stderr.contains("--config FILE"), "{stderr}");
}

/// A base64url key may start with `-` (one in 64 from `autopush keygen`):
/// `--crypto-key KEY` and `--auth-key KEY` take it as written, not as a flag.
#[tokio::test]
async fn keys_that_start_with_a_hyphen_are_taken_as_written() {
    let key = URL_SAFE.encode([0xF8u8; 32]);
    assert!(key.starts_with('-'), "{key}");
    let other = URL_SAFE.encode([0xFBu8; 32]);
    let server = Server::start_with(&[
        "--crypto-key",
        &key,
        "--auth-key",
        &other,
        "--router-key",
        &other,
    ])
    .await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    sub.push_text("hyphenated").await;
    let (_, decrypted) = sub.receive(&mut ws).await;
    assert_eq!(decrypted.text, "hyphenated");
}

/// When the store is held and the running node does not answer, `diagnose`
/// still shows what the token says, but exits non-zero: it could not read
/// the user.
#[tokio::test]
async fn diagnose_fails_when_it_cannot_read_the_user() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let reply = ws.register(&new_channel_id(), None).await;
    let endpoint = reply["pushEndpoint"].as_str().expect("pushEndpoint");
    let db = server.data_dir().display().to_string();
    let [closed] = server::free_ports::<1>();
    let nobody = format!("http://127.0.0.1:{closed}");
    let out =
        server::run_autopush(&["diagnose", endpoint, "--db", &db, "--node-url", &nobody]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "autopush diagnose: {stdout}\n{stderr}"
    );
    let info = first_json_object(&stdout);
    assert!(info["user"]["error"].is_string(), "{info}");
    assert!(stderr.contains("could not read the user"), "{stderr}");
}

/// `--auth-key` and `--router-key` keys shorter than 16 bytes are refused
/// at start-up, naming the setting, without echoing the key; keys made by
/// `autopush keygen` start.
#[tokio::test]
async fn short_auth_and_router_keys_are_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("db").display().to_string();
    let ports = server::port_flags();
    let mut base = vec!["all", "--db", &db];
    base.extend(ports.iter().map(String::as_str));
    let long_enough = "sixteen-bytes-ok";
    for flag in ["--auth-key", "--router-key"] {
        for value in ["x", "fifteen-bytes!!", &format!("{long_enough},short-key")] {
            let out = server::run_autopush(&[&base[..], &[flag, value]].concat()).await;
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{flag} {value:?} started: {stderr}");
            assert!(stderr.contains(flag), "{flag} {value:?}: {stderr}");
            assert!(stderr.contains("16 bytes"), "{flag} {value:?}: {stderr}");
            assert!(!stderr.contains("short-key"), "the key is echoed: {stderr}");
        }
    }
    let (auth, router) = (keygen().await, keygen().await);
    let server = Server::start_with(&["--auth-key", &auth, "--router-key", &router]).await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    sub.push_text("strong keys").await;
    let (_, decrypted) = sub.receive(&mut ws).await;
    assert_eq!(decrypted.text, "strong keys");
    let server = Server::start_with(&["--router-key", long_enough]).await;
    let reply = http::signed(
        reqwest::Method::GET,
        &server.router_base(),
        &format!("/user/{}", random_uaid()),
        long_enough,
        None,
    )
    .await;
    assert_eq!(reply.status, 404, "{reply:?}");
}

/// The service names its data directory and says loudly when it makes the
/// keys every endpoint it issues depends on: started from another
/// directory, it would otherwise issue endpoints no earlier server can
/// read, without a word. A restart on the same directory makes none.
#[tokio::test]
async fn the_data_directory_is_named_and_new_keys_are_announced() {
    let generated = |log: &str| {
        log.lines()
            .filter(|l| l.contains("WARN") && l.contains("generated a new one"))
            .count()
    };
    let mut server = Server::start().await;
    let dir = server.data_dir().display().to_string();
    let log = server.stderr();
    assert!(
        log.lines()
            .any(|l| l.contains("embedded store open") && l.contains(&dir)),
        "no line names the data directory {dir}:\n{log}"
    );
    // The endpoint key, the registration secret key and the router key.
    assert_eq!(generated(&log), 3, "{log}");
    server.restart().await;
    assert_eq!(generated(&server.stderr()), 0, "{}", server.stderr());
}

/// DynamoDB and AWS SDK failures reach the operator as one line (the
/// operation, the code or cause, the message), never the SDK's nested
/// causes and debug dump: no credentials, nothing listening, no table.
#[tokio::test]
async fn dynamodb_failures_are_one_line() {
    let home = tempfile::tempdir().unwrap(); // no ~/.aws to find credentials in
    let [port] = server::free_ports::<1>();
    let closed = format!("http://127.0.0.1:{port}");
    let dynalite = &dynamo::dynalite().await.endpoint;
    let cases: [(&str, bool, &[&str], &str); 3] = [
        (
            &closed,
            false,
            &["db", "create-tables"],
            "DynamoDB DescribeTable: no AWS credentials found: set AWS_ACCESS_KEY_ID",
        ),
        (
            &closed,
            true,
            &["db", "create-tables"],
            "DynamoDB DescribeTable: cannot connect: Connection refused",
        ),
        (
            dynalite,
            true,
            &["db", "drop-old-users", "--months", "2"],
            "ResourceNotFoundException: Requested resource not found",
        ),
    ];
    for (endpoint, credentials, args, want) in cases {
        let mut cmd = tokio::process::Command::from(server::autopush_command());
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("AWS_") {
                cmd.env_remove(key);
            }
        }
        cmd.envs(dynamo::aws_env(endpoint))
            .env("HOME", home.path())
            .args(args)
            .args(["--db", "dynamodb", "--router-table", "no_such_router"])
            .kill_on_drop(true);
        if !credentials {
            cmd.env_remove("AWS_ACCESS_KEY_ID")
                .env_remove("AWS_SECRET_ACCESS_KEY");
        }
        let out = tokio::time::timeout(std::time::Duration::from_secs(60), cmd.output())
            .await
            .expect("autopush db did not finish")
            .expect("run autopush db");
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            said.trim().lines().count() == 1 && said.contains(want),
            "{args:?}: {said}"
        );
        assert!(
            !said.contains("DispatchFailure") && !said.contains('{'),
            "a debug dump: {said}"
        );
    }
}
