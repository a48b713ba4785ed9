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

/// A `/v1` webpush registration on `server`: its UAID and secret.
async fn register_v1(server: &Server) -> (String, String) {
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
    let field = |name: &str| reply.json[name].as_str().expect(name).to_owned();
    (field("uaid"), field("secret"))
}

#[tokio::test]
async fn auth_key_from_the_config_file_signs_registration_secrets() {
    let config_dir = tempfile::tempdir().expect("temp dir");
    let config = config_dir.path().join("autopush.toml");
    let key = "auth-key-from-the-file";
    std::fs::write(&config, format!("auth_key = \"{key}\"\nmsg_limit = 50\n"))
        .expect("write config");
    let server = Server::start_with(&["--config", &config.display().to_string()]).await;

    let (uaid, secret) = register_v1(&server).await;
    assert_eq!(
        secret,
        registration_secret(key, &uaid),
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

/// Keys from systemd credentials and from `_file` settings: the service
/// signs with them and generates none; the settings file holds none.
#[tokio::test]
async fn keys_come_from_systemd_credentials_and_key_files() {
    let secrets = tempfile::tempdir().expect("temp dir");
    let credentials = secrets.path().join("credentials");
    std::fs::create_dir(&credentials).expect("mkdir");
    let auth_key = "auth-key-from-a-credential";
    std::fs::write(credentials.join("auth_key"), format!("{auth_key}\n")).expect("write");
    // As the package ships it: empty, so none.
    std::fs::write(credentials.join("router_key"), "").expect("write");
    let crypto_file = secrets.path().join("crypto.key");
    let crypto_key = "Jr2pJ8uOEBwYuSvC2WV8I3SrSZ81nXGeJ7qi5CAjCUA=";
    std::fs::write(&crypto_file, format!("{crypto_key}\n")).expect("write");
    let directory = credentials.display().to_string();
    let server = Server::start_with_env(
        &["--crypto-key-file", &crypto_file.display().to_string()],
        &[("CREDENTIALS_DIRECTORY", &directory)],
    )
    .await;
    let (uaid, secret) = register_v1(&server).await;
    assert_eq!(secret, registration_secret(auth_key, &uaid));
    let kept: Vec<_> = ["crypto_key", "auth_key", "router_key"]
        .into_iter()
        .filter(|key| server.data_dir().join(key).exists())
        .collect();
    // The empty router_key credential is none: that key is generated.
    assert_eq!(kept, ["router_key"]);
    let log = server.stderr();
    assert!(
        !log.contains(auth_key) && !log.contains(crypto_key),
        "{log}"
    );
}

/// A bad key from a credential is refused naming the credential, never
/// the flag it was not given as.
#[tokio::test]
async fn a_short_key_from_a_credential_is_named_as_the_credential() {
    let dir = tempfile::tempdir().expect("temp dir");
    let credentials = dir.path().join("credentials");
    std::fs::create_dir(&credentials).expect("mkdir");
    std::fs::write(credentials.join("router_key"), "short\n").expect("write");
    let db = dir.path().join("db").display().to_string();
    let directory = credentials.display().to_string();
    let out = server::run_autopush_with_env(
        &[&["all", "--db", &db][..], &strs(&server::port_flags())].concat(),
        &[("CREDENTIALS_DIRECTORY", &directory)],
    )
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let named = format!(
        "the credential {}",
        credentials.join("router_key").display()
    );
    assert!(stderr.contains(&named), "{stderr}");
    assert!(
        !stderr.contains("--router-key") && !stderr.contains("short"),
        "{stderr}"
    );
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
    let ports = server::port_flags();
    let base = [&strs(&ports)[..], &["--db", &db]].concat();
    let stderr = refused(&[&["all", "--router-host", "0.0.0.0"][..], &base].concat()).await;
    assert!(stderr.contains("--router-key"), "{stderr}");
    assert!(stderr.contains("0.0.0.0"), "{stderr}");

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

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// The embedded store belongs to one process: a connection or endpoint
/// node on it is refused, pointing at `--db dynamodb`.
#[tokio::test]
async fn split_mode_on_the_embedded_store_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().display().to_string();
    let key = "Jr2pJ8uOEBwYuSvC2WV8I3SrSZ81nXGeJ7qi5CAjCUA=";
    for role in ["connection", "endpoint"] {
        let mut args = vec![role, "--db", &db];
        args.extend(["--crypto-key", key, "--auth-key", key, "--router-key", key]);
        let ports = server::port_flags();
        args.extend(strs(&ports));
        let stderr = refused(&args).await;
        assert!(stderr.contains("--db dynamodb"), "{role}: {stderr}");
        assert!(stderr.contains(role), "{role}: {stderr}");
        assert!(stderr.contains(&db), "{role}: {stderr}");
    }
}

/// A `--db` that is a regular file, or lies under one, or cannot be
/// written, is refused with an error naming the path and what is wrong.
#[tokio::test]
async fn a_data_directory_that_cannot_be_used_is_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let file_db = file.display().to_string();
    let ports = server::port_flags();
    let stderr = refused(&[&["all", "--db", &file_db][..], &strs(&ports)].concat()).await;
    assert!(stderr.contains(&file_db), "{stderr}");
    assert!(stderr.contains("not a directory"), "{stderr}");
    assert!(!stderr.contains("File exists"), "{stderr}");

    let under = file.join("data").display().to_string();
    let stderr = refused(&[&["all", "--db", &under][..], &strs(&ports)].concat()).await;
    assert!(stderr.contains(&under), "{stderr}");

    // A directory without write permission (root writes anyway: then
    // there is nothing to refuse).
    let read_only = dir.path().join("read-only");
    std::fs::create_dir(&read_only).unwrap();
    let mut permissions = std::fs::metadata(&read_only).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o500);
    std::fs::set_permissions(&read_only, permissions).unwrap();
    if std::fs::write(read_only.join("probe"), "").is_err() {
        let read_only = read_only.display().to_string();
        let stderr = refused(&[&["all", "--db", &read_only][..], &strs(&ports)].concat()).await;
        assert!(stderr.contains(&read_only), "{stderr}");
        assert!(stderr.contains("cannot be written"), "{stderr}");
    }
}

/// Two of the ports a process listens on set to the same number are
/// refused, naming both settings.
#[tokio::test]
async fn clashing_ports_are_refused_naming_both_settings() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().display().to_string();
    let [a, b] = server::free_ports::<2>().map(|p| p.to_string());
    for (port, router_port, endpoint_port, settings) in [
        (&a, &b, &a, ["--port", "--endpoint-port"]),
        (&a, &b, &b, ["--router-port", "--endpoint-port"]),
        (&a, &a, &b, ["--port", "--router-port"]),
    ] {
        let args = [
            "all",
            "--db",
            &db,
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "--router-port",
            router_port,
            "--endpoint-port",
            endpoint_port,
        ];
        let stderr = refused(&args).await;
        for setting in settings {
            assert!(stderr.contains(setting), "{args:?}: {stderr}");
        }
        assert!(stderr.contains("clash"), "{args:?}: {stderr}");
    }
}
