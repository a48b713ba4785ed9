//! Start-up as an operator meets it: every setting, key and address is
//! checked before anything is touched, and every problem is named in one
//! error; `--host` takes names and IPv6 addresses; the first lines of the
//! log give the effective settings; `autopush config` prints them.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use autopush_tests::*;
use reqwest::Method;

/// A key `autopush keygen` could have made (base64url of 32 bytes).
const KEY: &str = "Jr2pJ8uOEBwYuSvC2WV8I3SrSZ81nXGeJ7qi5CAjCUA=";

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// Run `autopush ARGS` expecting a refusal of its settings (exit code 2);
/// returns its stderr.
async fn refused(args: &[&str]) -> String {
    let out = server::run_autopush(args).await;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "autopush {args:?}: {stderr}");
    stderr
}

#[tokio::test]
async fn a_bad_key_is_refused_before_the_data_directory_is_made() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("fresh");
    let db_arg = db.display().to_string();
    let ports = server::port_flags();
    let args = [
        &["all", "--db", &db_arg, "--auth-key", "short"][..],
        &strs(&ports),
    ]
    .concat();
    let stderr = refused(&args).await;
    assert!(stderr.contains("--auth-key"), "{stderr}");
    assert!(!db.exists(), "the data directory was made: {stderr}");
    assert!(!stderr.contains("generated a new one"), "{stderr}");
    assert!(!stderr.contains("listening"), "{stderr}");
}

/// A split node without its keys names every one it needs in one run.
#[tokio::test]
async fn split_mode_names_every_missing_key_at_once() {
    let ports = server::port_flags();
    for (role, needed) in [
        (
            "endpoint",
            &["--crypto-key", "--auth-key", "--router-key"][..],
        ),
        ("connection", &["--crypto-key", "--router-key"][..]),
    ] {
        let args = [&[role, "--db", "dynamodb"][..], &strs(&ports)].concat();
        let stderr = refused(&args).await;
        for flag in needed {
            assert!(stderr.contains(flag), "{role}: {flag} not named: {stderr}");
        }
        assert_eq!(
            stderr.lines().filter(|l| l.contains("autopush:")).count(),
            1,
            "{role}: not one message: {stderr}"
        );
    }
}

#[tokio::test]
async fn every_bad_setting_is_named_in_one_message() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("db").display().to_string();
    let ports = server::port_flags();
    let base = [&["all", "--db", &db][..], &strs(&ports)].concat();
    let cases: [(&[&str], &[&str]); 2] = [
        (
            &["--log-format", "xml", "--max-channels", "0"],
            &["--log-format", "--max-channels"],
        ),
        (
            &[
                "--auth-key",
                "short",
                "--router-host",
                "no-such-host.invalid",
            ],
            &["--auth-key", "no-such-host.invalid"],
        ),
    ];
    for (bad, named) in cases {
        let stderr = refused(&[&base[..], bad].concat()).await;
        assert!(stderr.contains("2 problems"), "{bad:?}: {stderr}");
        for name in named {
            assert!(stderr.contains(name), "{bad:?}: {name} not named: {stderr}");
        }
    }
}

/// A node started by hand on `host` (for --host and --router-host), its
/// public and router ports reached at `reach` (an address as a URL writes
/// it). Killed on drop.
struct HandStarted {
    child: std::process::Child,
    _work: tempfile::TempDir,
    stderr: std::path::PathBuf,
}

impl Drop for HandStarted {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_on(host: &str, reach: &str) -> (HandStarted, [u16; 3]) {
    let work = tempfile::tempdir().expect("temp dir");
    let ports = server::free_ports::<3>();
    let [port, router_port, endpoint_port] = ports.map(|p| p.to_string());
    let db = work.path().join("db").display().to_string();
    let stderr_path = work.path().join("stderr");
    let stderr = std::fs::File::create(&stderr_path).expect("stderr file");
    let child = server::autopush_command()
        .args(["all", "--db", &db, "--host", host, "--router-host", host])
        .args(["--port", &port, "--router-port", &router_port])
        .args(["--endpoint-port", &endpoint_port, "--router-key", KEY])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("spawn autopush");
    let mut node = HandStarted {
        child,
        _work: work,
        stderr: stderr_path,
    };
    let health = format!("http://{reach}:{endpoint_port}/health");
    let client = autopush_common::http_client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("reqwest client");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(Some(status)) = node.child.try_wait() {
            let log = std::fs::read_to_string(&node.stderr).unwrap_or_default();
            panic!("--host {host}: exited ({status}):\n{log}");
        }
        if let Ok(reply) = client.get(&health).send().await
            && reply.status() == 200
        {
            return (node, ports);
        }
        let log = std::fs::read_to_string(&node.stderr).unwrap_or_default();
        assert!(
            Instant::now() < deadline,
            "--host {host}: {health} did not answer:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `--host` and `--router-host` take IPv6 addresses bare and in brackets,
/// and names; a client reaches every port at the address asked for.
#[tokio::test]
async fn hosts_take_ipv6_addresses_and_names() {
    for (host, reach) in [
        ("::1", "[::1]"),
        ("[::1]", "[::1]"),
        ("::", "[::1]"),
        ("[::]", "[::1]"),
        ("localhost", "127.0.0.1"),
    ] {
        let (_node, [port, router_port, _]) = start_on(host, reach).await;
        let mut ws = WsClient::connect_hello(&format!("ws://{reach}:{port}/"), None).await;
        ws.register(&new_channel_id(), None).await;
        let path = format!("/user/{}", random_uaid());
        let base = format!("http://{reach}:{router_port}");
        let reply = http::signed(Method::GET, &base, &path, KEY, None).await;
        assert_eq!(reply.status, 404, "--router-host {host}: {reply:?}");
    }
}

#[tokio::test]
async fn a_host_name_that_does_not_resolve_is_refused_naming_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("db").display().to_string();
    let ports = server::port_flags();
    let args = [
        &["all", "--db", &db][..],
        &strs(&ports),
        &["--router-host", "no-such-host.invalid"],
    ]
    .concat();
    let stderr = refused(&args).await;
    assert!(
        stderr.contains("--router-host no-such-host.invalid"),
        "{stderr}"
    );
}

/// The first lines of the log give every setting's effective value, keys
/// redacted; a key's value is nowhere in the log.
#[tokio::test]
async fn the_log_opens_with_the_effective_settings() {
    let server = Server::start_with(&["--crypto-key", KEY, "--msg-limit", "7"]).await;
    let log = server.stderr();
    let lines: Vec<&str> = log.lines().collect();
    let at = |needle: &str| {
        lines
            .iter()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?}:\n{log}"))
    };
    let port = server
        .ws_url()
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .to_owned();
    at(&format!("setting port = {port}"));
    at("setting msg_limit = 7");
    at("setting max_channels = 1000");
    let key = at("setting crypto_key: set, and left out here");
    assert!(
        key < at("listening on"),
        "settings after the listeners:\n{log}"
    );
    assert!(!log.contains(KEY), "the crypto key is in the log:\n{log}");
}

async fn config(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = server::run_autopush_with_env(&[&["config"][..], args].concat(), env).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "autopush config {args:?}: {stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `autopush config` prints flags over environment over file over
/// defaults, as a file `--config` reads back to the same settings; keys
/// left out, with a comment saying where they go, unless `--show-secrets`.
#[tokio::test]
async fn config_prints_the_effective_settings_as_a_file_it_reads_back() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("autopush.toml");
    std::fs::write(&file, "max_channels = 5\nmsg_limit = 9\nport = 9000\n").unwrap();
    let file = file.display().to_string();
    let secret = "an-auth-key-nobody-may-see";
    let env = [("AUTOPUSH_MSG_LIMIT", "7"), ("AUTOPUSH_PORT", "9001")];
    let args = ["--config", &file, "--port", "7001", "--auth-key", secret];
    let printed = config(&args, &env).await;
    for line in [
        "port = 7001",
        "msg_limit = 7",
        "max_channels = 5",
        "endpoint_port = 8082",
        "# auth_key: set, and left out here: a secret goes in the systemd credential auth_key or in the file auth_key_file names",
    ] {
        assert!(
            printed.lines().any(|l| l == line),
            "no {line:?} in\n{printed}"
        );
    }
    assert!(!printed.contains(secret), "{printed}");

    let round_trip = |text: &str, name: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    // Read back, it gives the same settings but the secret it leaves out.
    let printed_file = round_trip(&printed, "printed.toml");
    let left_out = printed
        .lines()
        .find(|l| l.starts_with("# auth_key: set"))
        .expect("the auth_key comment");
    assert_eq!(
        config(&["--config", &printed_file], &[]).await,
        printed.replace(left_out, "# auth_key: not set")
    );

    let shown = config(&[&args[..], &["--show-secrets"]].concat(), &env).await;
    assert!(
        shown.contains(&format!("auth_key = \"{secret}\"")),
        "{shown}"
    );
    let shown_file = round_trip(&shown, "shown.toml");
    let again = config(&["--config", &shown_file, "--show-secrets"], &[]).await;
    assert_eq!(again, shown);
}

/// The packaged example file (every setting commented out but the data
/// directory) parses, and changes nothing else.
#[tokio::test]
async fn the_example_config_file_is_read() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/autopush.toml");
    let example = example.display().to_string();
    assert_eq!(
        config(&["--config", &example], &[]).await,
        config(&["--db", "/var/lib/autopush"], &[]).await
    );
}

/// A port another process holds is found before anything is made, and
/// named with the other problems in one error (exit 2).
#[tokio::test]
async fn a_busy_port_is_named_with_the_other_problems_before_anything_is_made() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("fresh");
    let db_arg = db.display().to_string();
    let holder = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let busy = holder.local_addr().expect("address").port().to_string();
    let [port, router_port] = server::free_ports::<2>().map(|p| p.to_string());
    let args = [
        "all",
        "--db",
        &db_arg,
        "--host",
        "127.0.0.1",
        "--port",
        &port,
        "--router-port",
        &router_port,
        "--endpoint-port",
        &busy,
        "--log-format",
        "xml",
    ];
    let stderr = refused(&args).await;
    assert!(stderr.contains("2 problems"), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "--endpoint-port {busy}: cannot listen on 127.0.0.1:{busy}"
        )),
        "{stderr}"
    );
    assert!(stderr.contains("--log-format"), "{stderr}");
    assert!(!db.exists(), "the data directory was made: {stderr}");
    assert!(!stderr.contains("generated a new one"), "{stderr}");
}

/// A `--db` URL of a store not served here is refused, naming the stores
/// served and not the URL (it may hold a password); nothing is made.
#[tokio::test]
async fn a_store_url_not_served_is_refused_never_a_directory() {
    let cwd = tempfile::tempdir().expect("temp dir");
    for url in [
        "mysql://u:pw@127.0.0.1:5999/autopush",
        "redis://127.0.0.1:6379",
    ] {
        let mut command = tokio::process::Command::from(server::autopush_command());
        command
            .args(["all", "--db", url])
            .args(server::port_flags())
            .current_dir(cwd.path())
            .kill_on_drop(true);
        // Taken as a directory, the store would start a service: a hang.
        let out = tokio::time::timeout(Duration::from_secs(60), command.output())
            .await
            .expect("autopush did not exit within 60 s: the URL was taken as a directory")
            .expect("run autopush");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{url}: {stderr}");
        let scheme = url.split("://").next().unwrap_or_default();
        assert!(
            stderr.contains(&format!("a {scheme}:// store is not served")),
            "{stderr}"
        );
        assert!(stderr.contains("`dynamodb`"), "{stderr}");
        assert!(!stderr.contains("pw@"), "{stderr}");
        // One problem: no key is asked for a store that is refused.
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
    }
    let made: Vec<_> = std::fs::read_dir(cwd.path()).expect("read cwd").collect();
    assert!(made.is_empty(), "made {made:?}");
}

/// The embedded store's cache is at least 1 MiB, within what the machine
/// can address, and set only for the embedded store: anything else stops
/// start-up, naming the setting.
#[tokio::test]
async fn a_bad_db_cache_mib_stops_start_up() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().display().to_string();
    let ports = server::port_flags();
    for (store, mib, said) in [
        (db.as_str(), "0", "--db-cache-mib must be at least 1"),
        (
            db.as_str(),
            "18446744073709551615",
            "--db-cache-mib is more than this machine can address",
        ),
        (
            "dynamodb",
            "64",
            "--db-cache-mib applies to the embedded store only",
        ),
        (
            db.as_str(),
            "lots",
            "invalid value 'lots' for '--db-cache-mib",
        ),
    ] {
        let args = [
            &["all", "--db", store, "--db-cache-mib", mib][..],
            &strs(&ports),
        ]
        .concat();
        let stderr = refused(&args).await;
        assert!(stderr.contains(said), "{mib}: {stderr}");
    }
}

/// A data directory that cannot be used is one problem, not one more for
/// each key it would hold.
#[tokio::test]
async fn an_unusable_data_directory_is_one_problem() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").expect("write");
    let db = file.display().to_string();
    let stderr = refused(&[&["all", "--db", &db][..], &strs(&server::port_flags())].concat()).await;
    assert!(stderr.contains("not a directory"), "{stderr}");
    assert!(!stderr.contains("problems"), "{stderr}");
}

/// An error names where the value was given: the settings file's key and
/// path, the environment variable, or the flag; an unknown key in the file
/// comes with the nearest known one.
#[tokio::test]
async fn errors_name_where_each_value_was_given() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("autopush.toml");
    std::fs::write(&file, "log_format = \"xml\"\nsweep_interval = 0\n").expect("write");
    let file = file.display().to_string();
    let out = server::run_autopush_with_env(
        &["config", "--config", &file, "--max-channels", "0"],
        &[("AUTOPUSH_HELLO_TIMEOUT", "-1")],
    )
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for named in [
        format!("log_format in {file} must be human or json"),
        format!("sweep_interval in {file} must be more than 0"),
        "AUTOPUSH_HELLO_TIMEOUT must be".to_owned(),
        "--max-channels must be at least 1".to_owned(),
    ] {
        assert!(stderr.contains(&named), "no {named:?} in {stderr}");
    }

    let typo = dir.path().join("typo.toml");
    std::fs::write(&typo, "prot = 9000\n").expect("write");
    let typo = typo.display().to_string();
    let stderr = refused(&["config", "--config", &typo]).await;
    assert!(
        stderr.contains("unknown key `prot`: did you mean `port`?"),
        "{stderr}"
    );
}
