//! Every setting from every source (flag, `AUTOPUSH_*` environment variable,
//! TOML file) and their precedence: flag > env > file > default.
//!
//! The cases are generated from one table, and the table is checked against
//! the settings the binary actually has, so a new setting without a row
//! fails here. Settings are parsed exactly as the binary parses them: clap
//! over `SettingsLayer` (flags and env), then `Settings::resolve` with the
//! file.
//!
//! Environment variables are process-global: this file is its own test
//! process, and every test in it holds [`ENV`] while it sets them.

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use autopush_gateway::settings::{Db, LogFormat, Settings, SettingsLayer};
use clap::{Args, Command, FromArgMatches};

/// One setting: its name (field and TOML key), two distinct non-default
/// sample values as a user types them, and how to read it back.
struct Case {
    name: &'static str,
    a: &'static str,
    b: &'static str,
    read: fn(&Settings) -> String,
}

const fn case(
    name: &'static str,
    a: &'static str,
    b: &'static str,
    read: fn(&Settings) -> String,
) -> Case {
    Case { name, a, b, read }
}

fn secret(s: &Option<autopush_common::Secret>) -> String {
    s.as_ref()
        .map(|s| s.expose().to_owned())
        .unwrap_or_default()
}

/// A rate setting as typed: `PER_SECOND,BURST`.
fn rate_text(rate: Option<autopush_common::limit::Rate>) -> String {
    rate.map(|r| format!("{},{}", r.per_second, r.burst))
        .unwrap_or_default()
}

/// A VAPID public key for `--sender-limits` (as `k=` spells it).
const SENDER_KEY: &str =
    "BCdPnPTMwkQ4ASavS7d6K3u50FNrhaphBqiK_yRi1vyxL6CsFD1GHNxMd5KiXyQX5cWG7_U2MJWgFnYMO5sk3Tc";

/// `--sender-limits` as it was given, from the rates kept by key hash:
/// the one key the cases name is recognised by its SHA-256.
fn sender_limits_text(s: &Settings) -> String {
    use base64::Engine;
    use sha2::Digest;
    let key = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(SENDER_KEY)
        .expect("the test key");
    let hash: [u8; 32] = sha2::Sha256::digest(key).into();
    s.limits
        .senders
        .iter()
        .map(|(named, rate)| {
            let key = if *named == hash { SENDER_KEY } else { "?" };
            format!("{key}={}", rate_text(*rate))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

const CASES: &[Case] = &[
    case("host", "127.0.0.2", "127.0.0.3", |s| s.host.clone()),
    case("port", "7001", "7002", |s| s.port.to_string()),
    case("router_host", "127.0.0.4", "127.0.0.5", |s| {
        s.router_host.clone()
    }),
    case("router_port", "7003", "7004", |s| s.router_port.to_string()),
    case("node_url", "http://node-a:1", "http://node-b:2", |s| {
        s.node_url.clone()
    }),
    case("endpoint_port", "7005", "7006", |s| {
        s.endpoint_port.to_string()
    }),
    case(
        "endpoint_url",
        "https://a.example",
        "https://b.example",
        |s| s.endpoint_url.clone(),
    ),
    case("db", "/srv/db-a", "/srv/db-b", |s| match &s.db {
        Db::Embedded(dir) => dir.display().to_string(),
        Db::DynamoDb => "dynamodb".into(),
        Db::Bigtable(bigtable) => bigtable.table_name.clone(),
        Db::Postgres(postgres) => postgres.qualified(&postgres.router_table),
    }),
    case("db_cache_mib", "16", "32", |s| {
        (s.db_cache >> 20).to_string()
    }),
    case("crypto_key", "crypto-a", "crypto-b", |s| {
        secret(&s.crypto_key)
    }),
    case("auth_key", "auth-a", "auth-b", |s| secret(&s.auth_key)),
    case("router_key", "router-a", "router-b", |s| {
        secret(&s.router_key)
    }),
    case("msg_limit", "7", "8", |s| s.msg_limit.to_string()),
    case("durable_direct", "false", "true", |s| {
        s.durable_direct.to_string()
    }),
    case("receipt_retention", "0", "60", |s| {
        s.receipt_retention.to_string()
    }),
    case("max_channels", "5", "6", |s| s.max_channels.to_string()),
    case("metrics_port", "7007", "7008", |s| {
        s.metrics_port.map(|p| p.to_string()).unwrap_or_default()
    }),
    case("statsd_host", "statsd-a:9125", "statsd-b:9126", |s| {
        s.statsd
            .as_ref()
            .map(|s| format!("{}:{}", s.host, s.port))
            .unwrap_or_default()
    }),
    case("statsd_flush_interval", "0.5", "7", |s| {
        s.statsd_flush_interval.as_secs_f64().to_string()
    }),
    case("statsd_label", "push-a", "push-b", |s| {
        s.statsd_label.clone()
    }),
    case("sweep_interval", "1.5", "2.5", |s| {
        s.sweep_interval.as_secs_f64().to_string()
    }),
    case("drop_idle_users_after_days", "2", "3", |s| {
        s.drop_idle_users_after
            .map_or(0.0, |d| d.as_secs_f64() / 86_400.0)
            .to_string()
    }),
    case("sender_limit", "5,50", "6,60", |s| {
        rate_text(s.limits.sender)
    }),
    case(
        "sender_limits",
        "BCdPnPTMwkQ4ASavS7d6K3u50FNrhaphBqiK_yRi1vyxL6CsFD1GHNxMd5KiXyQX5cWG7_U2MJWgFnYMO5sk3Tc=5,50",
        "BCdPnPTMwkQ4ASavS7d6K3u50FNrhaphBqiK_yRi1vyxL6CsFD1GHNxMd5KiXyQX5cWG7_U2MJWgFnYMO5sk3Tc=6,60",
        sender_limits_text,
    ),
    case("subscription_limit", "5,50", "6,60", |s| {
        rate_text(s.limits.subscription)
    }),
    case("source_ip_limit", "5,50", "6,60", |s| {
        rate_text(s.limits.source_ip)
    }),
    case("registration_limit", "5,50", "6,60", |s| {
        rate_text(s.limits.registration)
    }),
    case("new_uaid_limit", "5,50", "6,60", |s| {
        rate_text(s.limits.new_uaid)
    }),
    case("bridge_app_limit", "5,50", "6,60", |s| {
        rate_text(s.limits.bridge_app)
    }),
    case("matrix_gateway_limit", "5,50", "6,60", |s| {
        rate_text(s.limits.matrix_gateway)
    }),
    case("limiter_max_keys", "5", "6", |s| {
        s.limits.max_keys.to_string()
    }),
    case(
        "trusted_proxies",
        "10.0.0.1/32",
        "10.0.0.2/32,192.168.0.0/16",
        |s| {
            s.limits
                .trusted_proxies
                .iter()
                .map(|ip| ip.to_string())
                .collect::<Vec<_>>()
                .join(",")
        },
    ),
    case(
        "unsigned_node_calls_from",
        "10.0.0.0/24",
        "10.0.1.0/24,10.0.2.0/24",
        |s| {
            s.unsigned_node_calls_from
                .iter()
                .map(|net| net.to_string())
                .collect::<Vec<_>>()
                .join(",")
        },
    ),
    case(
        "autopush_rs_nodes",
        "10.0.2.0/24",
        "10.0.3.0/24,10.0.4.0/24",
        |s| {
            s.autopush_rs_nodes
                .iter()
                .map(|net| net.to_string())
                .collect::<Vec<_>>()
                .join(",")
        },
    ),
    case("ws_send_timeout", "1.5", "2.5", |s| {
        s.ws_send_timeout.as_secs_f64().to_string()
    }),
    case("wake_threshold", "low", "high", |s| {
        s.wake.threshold.as_str().to_owned()
    }),
    case("wake_interval", "1.5", "2.5", |s| {
        s.wake.interval.as_secs_f64().to_string()
    }),
    case("http_header_timeout", "1.5", "2.5", |s| {
        s.http.header_timeout.as_secs_f64().to_string()
    }),
    case("http_idle_timeout", "1.5", "2.5", |s| {
        s.http.idle_timeout.as_secs_f64().to_string()
    }),
    case("http_body_timeout", "1.5", "2.5", |s| {
        s.http.body_timeout.as_secs_f64().to_string()
    }),
    case("max_http_connections", "5", "6", |s| {
        s.http.max_connections.to_string()
    }),
    case("max_data_bytes", "4000", "4001", |s| {
        s.max_data_bytes.to_string()
    }),
    case("hello_timeout", "1.5", "2.5", |s| {
        s.hello_timeout.as_secs_f64().to_string()
    }),
    case("auto_ping_interval", "3.5", "4.5", |s| {
        s.auto_ping_interval.as_secs_f64().to_string()
    }),
    case("auto_ping_timeout", "5.5", "6.5", |s| {
        s.auto_ping_timeout.as_secs_f64().to_string()
    }),
    case("min_ping_interval", "7.5", "8.5", |s| {
        s.min_ping_interval.as_secs_f64().to_string()
    }),
    case("max_connections", "11", "12", |s| {
        s.max_connections.map(|n| n.to_string()).unwrap_or_default()
    }),
    case("vapid_cache_size", "13", "14", |s| {
        s.vapid_cache_size.to_string()
    }),
    case("log_format", "json", "human", |s| match s.log_format {
        LogFormat::Json => "json".into(),
        LogFormat::Human => "human".into(),
    }),
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Source {
    Flag,
    Env,
    File,
}

static ENV: Mutex<()> = Mutex::new(());

/// Hold the environment and clear every variable the settings read.
fn lock_env() -> MutexGuard<'static, ()> {
    let guard = ENV.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("AUTOPUSH_") || key == "CRYPTO_KEY" || key == "CREDENTIALS_DIRECTORY" {
            // SAFETY: every test in this process holds ENV, and nothing else
            // in it reads the environment.
            unsafe { std::env::remove_var(&*key) };
        }
    }
    guard
}

fn set_env(key: &str, value: &str) {
    // SAFETY: as in lock_env; callers hold ENV.
    unsafe { std::env::set_var(key, value) };
}

/// The settings as clap declares them: (field, --flag, env var).
/// Bridge settings: a JSON object in the flag and the environment, named as
/// Mozilla's autopush-rs names them so operators' settings carry over, and
/// tables in the file. Their own tests (in the gateway's settings module)
/// cover each source.
const BRIDGES: &[(&str, &str, &str)] = &[
    ("apns", "apns-channels", "AUTOPUSH_APNS_CHANNELS"),
    (
        "fcm_credentials",
        "fcm-credentials",
        "AUTOPUSH_FCM_CREDENTIALS",
    ),
    (
        "gcm_credentials",
        "gcm-credentials",
        "AUTOPUSH_GCM_CREDENTIALS",
    ),
];

/// Settings that are an error without `--db dynamodb` (`db_settings`:
/// without a Bigtable `--db`; `journal_dir` and `journal_window`: without a
/// shared store), so a row setting only them cannot stand alone; the
/// settings module's own tests read them.
const NEEDS_DYNAMODB: &[&str] = &[
    "router_table",
    "message_table",
    "message_table_rotation",
    "db_settings",
    "journal_dir",
    "journal_window",
];

/// Settings that are an error without their companion (`tls_cert` and
/// `tls_key` go together), so a row setting one alone cannot stand; the
/// settings module's own tests read them.
const NEEDS_ITS_PAIR: &[&str] = &["tls_cert", "tls_key"];

/// The `_file` forms of the secrets: their own test reads each.
const SECRET_FILES: &[&str] = &[
    "crypto_key_file",
    "auth_key_file",
    "router_key_file",
    "apns_channels_file",
    "fcm_credentials_file",
    "gcm_credentials_file",
];

fn declared() -> Vec<(String, String, String)> {
    SettingsLayer::augment_args(Command::new("autopush"))
        .get_arguments()
        .map(|arg| {
            (
                arg.get_id().to_string(),
                arg.get_long().unwrap_or_default().to_owned(),
                arg.get_env()
                    .map(|e| e.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            )
        })
        .collect()
}

fn parse_layer(args: &[String]) -> Result<SettingsLayer, String> {
    let matches = SettingsLayer::augment_args(Command::new("autopush"))
        .try_get_matches_from(std::iter::once("autopush".to_owned()).chain(args.iter().cloned()))
        .map_err(|e| e.to_string())?;
    SettingsLayer::from_arg_matches(&matches).map_err(|e| e.to_string())
}

fn flag(name: &str) -> String {
    format!("--{}", name.replace('_', "-"))
}

fn env_var(name: &str) -> String {
    format!("AUTOPUSH_{}", name.to_ascii_uppercase())
}

/// `name = value` as a user writes it in the file, whatever the setting's
/// type: the value as the flag parses it, written back as TOML.
fn toml_line(name: &str, value: &str) -> String {
    let layer = parse_layer(&[flag(name), value.to_owned()])
        .unwrap_or_else(|e| panic!("{name}={value:?} does not parse as a flag: {e}"));
    let table = toml::Table::try_from(layer).expect("a layer serializes");
    let value = table
        .get(name)
        .unwrap_or_else(|| panic!("{name} missing from the serialized layer"));
    let mut line = toml::Table::new();
    line.insert(name.to_owned(), value.clone());
    toml::to_string(&line).expect("TOML")
}

/// Resolve settings with each `(source, setting, value)` set, nothing else.
fn resolve(dir: &Path, sets: &[(Source, &str, &str)]) -> Result<Settings, String> {
    let mut file = String::new();
    for (source, name, value) in sets {
        if *source == Source::File {
            file.push_str(&toml_line(name, value));
        }
    }
    let mut args = Vec::new();
    for (source, name, value) in sets {
        match source {
            Source::Flag => args.extend([flag(name), value.to_string()]),
            Source::Env => set_env(&env_var(name), value),
            Source::File => {}
        }
    }
    let path = dir.join("autopush.toml");
    std::fs::write(&path, file).expect("write the settings file");
    let result = parse_layer(&args).and_then(|layer| Settings::resolve(layer, Some(&path)));
    for (source, name, _) in sets {
        if *source == Source::Env {
            // SAFETY: as in lock_env; callers hold ENV.
            unsafe { std::env::remove_var(env_var(name)) };
        }
    }
    result
}

/// What `case` reads back after setting `sets`, or the error.
fn read(dir: &Path, case: &Case, sets: &[(Source, &str)]) -> String {
    let sets: Vec<_> = sets.iter().map(|(s, v)| (*s, case.name, *v)).collect();
    match resolve(dir, &sets) {
        Ok(settings) => (case.read)(&settings),
        Err(e) => format!("error: {e}"),
    }
}

#[test]
fn every_setting_has_a_case_a_flag_and_an_env_var() {
    let declared = declared();
    let mut problems = Vec::new();
    for (name, long, env) in &declared {
        if let Some((_, want_long, want_env)) = BRIDGES.iter().find(|(b, _, _)| b == name) {
            if long != want_long || env != want_env {
                problems.push(format!(
                    "{name}: --{long} / {env}, expected --{want_long} / {want_env}"
                ));
            }
            continue;
        }
        if !CASES.iter().any(|c| c.name == *name)
            && !NEEDS_DYNAMODB.contains(&name.as_str())
            && !NEEDS_ITS_PAIR.contains(&name.as_str())
            && !SECRET_FILES.contains(&name.as_str())
        {
            problems.push(format!("{name}: no row in CASES"));
        }
        if flag(name) != format!("--{long}") {
            problems.push(format!("{name}: flag --{long}, expected {}", flag(name)));
        }
        if *env != env_var(name) {
            problems.push(format!("{name}: env {env:?}, expected {}", env_var(name)));
        }
    }
    for case in CASES {
        if !declared.iter().any(|(name, _, _)| name == case.name) {
            problems.push(format!("{}: a row for no setting", case.name));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn every_setting_is_honoured_from_each_source_alone() {
    let _env = lock_env();
    let dir = tempfile::tempdir().unwrap();
    let defaults = resolve(dir.path(), &[]).expect("defaults resolve");
    let mut problems = Vec::new();
    for case in CASES {
        assert_ne!(
            (case.read)(&defaults),
            case.a,
            "{}: the sample must differ from the default",
            case.name
        );
        for source in [Source::Flag, Source::Env, Source::File] {
            let got = read(dir.path(), case, &[(source, case.a)]);
            if got != case.a {
                problems.push(format!(
                    "{} set only by {source:?} to {:?}: got {got:?}",
                    case.name, case.a
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn flag_beats_env_beats_file() {
    let _env = lock_env();
    let dir = tempfile::tempdir().unwrap();
    let mut problems = Vec::new();
    for case in CASES {
        for (high, low) in [
            (Source::Flag, Source::Env),
            (Source::Env, Source::File),
            (Source::Flag, Source::File),
        ] {
            // Both ways round, so a value cannot win by being the default.
            for (win, lose) in [(case.a, case.b), (case.b, case.a)] {
                let got = read(dir.path(), case, &[(high, win), (low, lose)]);
                if got != win {
                    problems.push(format!(
                        "{}: {high:?}={win:?} over {low:?}={lose:?} gave {got:?}",
                        case.name
                    ));
                }
            }
        }
        let got = read(
            dir.path(),
            case,
            &[
                (Source::Flag, case.a),
                (Source::Env, case.b),
                (Source::File, case.b),
            ],
        );
        if got != case.a {
            problems.push(format!(
                "{}: flag over env and file gave {got:?}",
                case.name
            ));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn crypto_key_is_also_read_from_crypto_key_below_autopush_crypto_key() {
    let _env = lock_env();
    let dir = tempfile::tempdir().unwrap();
    let crypto_key = |sets: &[(Source, &str, &str)], legacy: Option<&str>| {
        if let Some(value) = legacy {
            set_env("CRYPTO_KEY", value);
        }
        let got = resolve(dir.path(), sets).map(|s| {
            s.crypto_key
                .map(|k| k.expose().to_owned())
                .unwrap_or_default()
        });
        // SAFETY: as in lock_env; this test holds ENV.
        unsafe { std::env::remove_var("CRYPTO_KEY") };
        got.unwrap()
    };
    assert_eq!(crypto_key(&[], Some("legacy")), "legacy");
    assert_eq!(
        crypto_key(&[(Source::File, "crypto_key", "file")], Some("legacy")),
        "legacy"
    );
    assert_eq!(
        crypto_key(&[(Source::Env, "crypto_key", "env")], Some("legacy")),
        "env"
    );
    assert_eq!(
        crypto_key(&[(Source::Flag, "crypto_key", "flag")], Some("legacy")),
        "flag"
    );
}

#[test]
fn unknown_and_mistyped_file_keys_are_errors_naming_them() {
    let _env = lock_env();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("autopush.toml");
    for (text, named) in [
        ("auth_kye = \"x\"\n", "auth_kye"),
        ("port = \"eighty\"\n", "port"),
    ] {
        std::fs::write(&path, text).unwrap();
        let err = Settings::resolve(SettingsLayer::default(), Some(&path)).unwrap_err();
        assert!(err.contains(named), "{text}: {err}");
    }
}

/// Each secret's `_file` form, from each source, gives the secret without
/// its trailing newline; a secret and its `_file` form together are an
/// error naming both.
#[test]
fn secrets_are_read_from_the_files_their_file_settings_name() {
    let _env = lock_env();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("crypto.key");
    std::fs::write(&file, "from-a-file\n").unwrap();
    let path = file.display().to_string();
    let crypto_key = |s: Settings| s.crypto_key.map(|k| k.expose().to_owned());
    for source in [Source::Flag, Source::Env, Source::File] {
        let s = resolve(dir.path(), &[(source, "crypto_key_file", &path)]).unwrap();
        assert_eq!(crypto_key(s).as_deref(), Some("from-a-file"), "{source:?}");
    }
    for (key, read) in [
        (
            "auth_key",
            (|s: &Settings| s.auth_key.clone()) as fn(&Settings) -> _,
        ),
        ("router_key", |s: &Settings| s.router_key.clone()),
    ] {
        let s = resolve(dir.path(), &[(Source::Flag, &format!("{key}_file"), &path)]).unwrap();
        assert_eq!(
            read(&s).map(|k| k.expose().to_owned()).as_deref(),
            Some("from-a-file")
        );
    }
    let json = dir.path().join("fcm.json");
    std::fs::write(
        &json,
        r#"{"app": {"project_id": "p", "credential": "/sa.json"}}"#,
    )
    .unwrap();
    let json = json.display().to_string();
    let s = resolve(dir.path(), &[(Source::Env, "fcm_credentials_file", &json)]).unwrap();
    assert_eq!(s.bridges.fcm.apps().unwrap()["app"].project_id, "p");

    let err = resolve(
        dir.path(),
        &[
            (Source::File, "crypto_key", "inline"),
            (Source::Flag, "crypto_key_file", &path),
        ],
    )
    .unwrap_err();
    let settings_file = dir.path().join("autopush.toml").display().to_string();
    assert!(
        err.contains(&format!(
            "crypto_key in {settings_file} and --crypto-key-file both give crypto_key"
        )),
        "{err}"
    );
    let missing = dir.path().join("missing").display().to_string();
    let err = resolve(dir.path(), &[(Source::Env, "router_key_file", &missing)]).unwrap_err();
    assert!(
        err.contains("--router-key-file") && err.contains(&missing),
        "{err}"
    );
}

/// systemd credentials: a secret by its setting's name, below every
/// explicit setting; `credential:NAME` wherever a setting names a file.
#[test]
fn secrets_come_from_systemd_credentials_below_every_setting() {
    let _env = lock_env();
    let dir = tempfile::tempdir().unwrap();
    let credentials = dir.path().join("credentials");
    std::fs::create_dir(&credentials).unwrap();
    for (name, text) in [
        ("crypto_key", "credential-crypto\n"),
        ("router_key", "credential-router"),
        ("cert.pem", "not read here"),
        ("key.pem", "not read here"),
        ("apns-firefox.p8", "not read here"),
        (
            "apns_channels",
            r#"{"firefox": {"topic": "t", "key": "credential:apns-firefox.p8", "key_id": "K", "team_id": "T"}}"#,
        ),
        ("fcm-app.json", "not read here"),
        // As the package ships it: empty, so none.
        ("auth_key", "\n"),
    ] {
        std::fs::write(credentials.join(name), text).unwrap();
    }
    set_env("CREDENTIALS_DIRECTORY", &credentials.display().to_string());
    let secret = |k: &Option<autopush_common::Secret>| k.as_ref().map(|k| k.expose().to_owned());

    let s = resolve(dir.path(), &[]).unwrap();
    assert_eq!(secret(&s.crypto_key).as_deref(), Some("credential-crypto"));
    assert_eq!(secret(&s.router_key).as_deref(), Some("credential-router"));
    assert_eq!(secret(&s.auth_key), None);
    let apns = s.bridges.apns.settings();
    let key = format!("{:?}", apns.channels["firefox"].key);
    assert!(
        key.contains(&credentials.join("apns-firefox.p8").display().to_string()),
        "{key}"
    );
    // Below every explicit setting.
    for source in [Source::Flag, Source::Env, Source::File] {
        let s = resolve(dir.path(), &[(source, "crypto_key", "given")]).unwrap();
        assert_eq!(
            secret(&s.crypto_key).as_deref(),
            Some("given"),
            "{source:?}"
        );
    }
    // A file named as a credential.
    let s = resolve(
        dir.path(),
        &[
            (Source::File, "tls_cert", "credential:cert.pem"),
            (Source::Env, "tls_key", "credential:key.pem"),
        ],
    )
    .unwrap();
    let tls = s.tls.unwrap();
    assert_eq!(tls.cert, credentials.join("cert.pem"));
    assert_eq!(tls.key, credentials.join("key.pem"));
    let path = dir.path().join("autopush.toml");
    std::fs::write(
        &path,
        "[fcm.apps.app]\nproject_id = \"p\"\ncredential = \"credential:fcm-app.json\"\n",
    )
    .unwrap();
    let s = Settings::resolve(SettingsLayer::default(), Some(&path)).unwrap();
    let credential = credentials.join("fcm-app.json").display().to_string();
    assert_eq!(s.bridges.fcm.apps().unwrap()["app"].credential, credential);
    // A credential that is not there, and none at all.
    let err = resolve(
        dir.path(),
        &[(Source::Flag, "crypto_key_file", "credential:nope")],
    )
    .unwrap_err();
    assert!(
        err.contains("--crypto-key-file") && err.contains("no credential nope"),
        "{err}"
    );
    // SAFETY: as in lock_env; this test holds ENV.
    unsafe { std::env::remove_var("CREDENTIALS_DIRECTORY") };
    let s = resolve(dir.path(), &[]).unwrap();
    assert_eq!(secret(&s.crypto_key), None);
    let err = resolve(
        dir.path(),
        &[
            (Source::Flag, "tls_cert", "credential:cert.pem"),
            (Source::Flag, "tls_key", "k.pem"),
        ],
    )
    .unwrap_err();
    assert!(
        err.contains("--tls-cert") && err.contains("CREDENTIALS_DIRECTORY is not set"),
        "{err}"
    );
}
