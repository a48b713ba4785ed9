//! Settings as a user of the binary meets them: a TOML file given with
//! `--config`, and start-up refusals that name the setting to fix. (Every
//! setting from every source is covered by gateway/tests/settings_sources.rs.)

use autopush_tests::*;
use hmac::{Hmac, Mac};
use reqwest::Method;
use serde_json::json;
use sha2::Sha256;

/// The `/v1` registration secret as the README documents it:
/// hex HMAC-SHA256(auth key, uaid).
fn registration_secret(key: &str, uaid: &str) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).expect("any key length");
    mac.update(uaid.as_bytes());
    hex_encode(&mac.finalize().into_bytes())
}

#[tokio::test]
async fn auth_key_from_the_config_file_signs_registration_secrets() {
    let config_dir = tempfile::tempdir().expect("temp dir");
    let config = config_dir.path().join("autopush.toml");
    let key = "auth-key-from-the-file";
    std::fs::write(&config, format!("auth_key = \"{key}\"\nmsg_limit = 50\n"))
        .expect("write config");
    let server = Server::start_with(&["--config", &config.display().to_string()]).await;

    let url = format!("{}/v1/webpush/app/registration", server.endpoint_base());
    let body = json!({"token": "t", "channelID": new_channel_id()}).to_string();
    let reply = http::request(
        Method::POST,
        &url,
        &[("content-type", "application/json")],
        Some(body.into_bytes()),
    )
    .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let uaid = reply.json["uaid"].as_str().expect("uaid");
    let secret = reply.json["secret"].as_str().expect("secret");
    assert_eq!(
        secret,
        registration_secret(key, uaid),
        "the secret is not signed with the auth_key of the config file"
    );
    assert!(
        !server.data_dir().join("auth_key").exists(),
        "a key was generated although the file gave one"
    );

    // And the service accepts it back.
    let url = format!(
        "{}/v1/webpush/app/registration/{uaid}/",
        server.endpoint_base()
    );
    let authorization = format!("Bearer {secret}");
    let reply = http::request(
        Method::GET,
        &url,
        &[("authorization", &authorization)],
        None,
    )
    .await;
    assert_eq!(reply.status, 200, "{reply:?}");
}

/// Run `autopush ARGS` expecting a start-up refusal; returns its stderr.
async fn refused(args: &[&str]) -> String {
    let out = server::run_autopush(args).await;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "autopush {args:?} started: {stderr}");
    stderr
}

#[tokio::test]
async fn a_router_api_beyond_loopback_needs_a_router_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().display().to_string();
    let [port, router_port, endpoint_port] = server::free_ports::<3>();
    let (port, router_port, endpoint_port) = (
        port.to_string(),
        router_port.to_string(),
        endpoint_port.to_string(),
    );
    let base = [
        "--host",
        "127.0.0.1",
        "--port",
        &port,
        "--router-port",
        &router_port,
        "--endpoint-port",
        &endpoint_port,
        "--db",
        &db,
    ];
    let stderr = refused(&[&["all", "--router-host", "0.0.0.0"][..], &base].concat()).await;
    assert!(stderr.contains("--router-key"), "{stderr}");
    assert!(stderr.contains("0.0.0.0"), "{stderr}");

    // A connection node of a split deployment has no data dir to keep one in.
    let crypto_key = "Jr2pJ8uOEBwYuSvC2WV8I3SrSZ81nXGeJ7qi5CAjCUA=";
    let stderr = refused(&[&["connection", "--crypto-key", crypto_key][..], &base].concat()).await;
    assert!(stderr.contains("--router-key"), "{stderr}");

    // With a key it starts, listening beyond loopback.
    let key = "a-router-key-of-enough-bytes";
    let server = Server::start_with(&["--router-host", "0.0.0.0", "--router-key", key]).await;
    let reply = http::signed(
        Method::GET,
        &server.router_base(),
        &format!("/user/{}", random_uaid()),
        key,
        None,
    )
    .await;
    assert_eq!(reply.status, 404, "{reply:?}");
}
