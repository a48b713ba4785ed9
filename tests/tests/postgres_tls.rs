//! TLS to PostgreSQL as the DSN asks (`sslmode`, `sslrootcert`), on a
//! private cluster with `ssl=on` and the test certificate (issued to
//! 127.0.0.1 by `certs/tls-ca.pem`).

use autopush_tests::postgres::{self, Cluster};
use autopush_tests::server::run_autopush;
use autopush_tests::{Node, Server, Subscription, cert_file, scenarios};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A cluster speaking TLS with the test certificate.
async fn tls_cluster() -> Cluster {
    let mut cluster = Cluster::init();
    let read = |name: &str| std::fs::read(cert_file(name)).expect("certs/ (run certs/make-tls.sh)");
    let cert = cluster.add_file("server.crt", &read("tls-127.0.0.1.pem"));
    let key = cluster.add_file("server.key", &read("tls-127.0.0.1-key.pem"));
    let cert = format!("ssl_cert_file={}", cert.display());
    let key = format!("ssl_key_file={}", key.display());
    cluster.start(&["ssl=on", &cert, &key]).await;
    cluster
}

/// `db preflight` with `dsn` on `schema`: (success, its exit status,
/// stdout and stderr).
async fn preflight(dsn: &str, schema: &str) -> (bool, String) {
    let settings = postgres::db_settings(schema);
    let out = run_autopush(&["db", "preflight", "--db", dsn, "--db-settings", &settings]).await;
    let said = format!("{}\n{}{}", out.status, text(&out.stdout), text(&out.stderr));
    (out.status.success(), said)
}

/// A node on `sslmode=verify-full` with the CA of the server's certificate:
/// its tables made, a push delivered end to end, and every connection it
/// holds encrypted, as the server's `pg_stat_ssl` says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_the_servers_ca_connects_over_tls_end_to_end() {
    let cluster = tls_cluster().await;
    let ca = cert_file("tls-ca.pem");
    let dsn = format!(
        "{}?sslmode=verify-full&sslrootcert={}&application_name=autopush-tls",
        cluster.dsn(),
        ca.display()
    );
    let schema = postgres::schema_name();
    let settings = postgres::db_settings(&schema);
    let out = run_autopush(&[
        "db",
        "create-tables",
        "--db",
        &dsn,
        "--db-settings",
        &settings,
    ])
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let (ready, said) = preflight(&dsn, &schema).await;
    assert!(ready, "{said}");

    let mut args = vec![format!("--db-settings={settings}")];
    args.extend(scenarios::cluster_keys().await);
    let node = Server::start_node(Node {
        db: Some(dsn.clone()),
        args,
        ..Node::default()
    })
    .await;
    let mut ws = node.client().await;
    let sub = Subscription::new(&mut ws).await;
    sub.push_text("over TLS").await;
    let (n, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "over TLS");
    ws.ack_notification(&n).await;

    let seen = cluster.psql(
        "SELECT count(*) FILTER (WHERE s.ssl), count(*), min(s.version) \
         FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE a.application_name = 'autopush-tls'",
    );
    eprintln!("the node's connections (over TLS|all|TLS version): {seen}");
    let fields: Vec<&str> = seen.split('|').collect();
    assert!(
        fields.len() == 3 && fields[0] == fields[1] && fields[0] != "0",
        "the node's connections, over TLS|all|version: {seen}"
    );
}

/// A certificate the DSN's CA did not sign, or one for another host under
/// verify-full, or an unreadable `sslrootcert`: `db preflight` fails and
/// says why; `require` without a CA encrypts without checking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_or_a_missing_ca_fails_saying_why() {
    let cluster = tls_cluster().await;
    let schema = postgres::fresh_schema_on(&cluster.dsn()).await;
    let with = |host: &str, query: String| {
        format!(
            "postgres://postgres@{host}:{}/postgres?{query}",
            cluster.port
        )
    };
    let root = |name: &str| format!("sslrootcert={}", cert_file(name).display());

    let other_ca = with(
        "127.0.0.1",
        format!("sslmode=verify-full&{}", root("tls-other-ca.pem")),
    );
    let (ready, said) = preflight(&other_ca, &schema).await;
    eprintln!("verify-full, another CA: {said}");
    assert!(!ready && said.contains("UnknownIssuer"), "{said}");
    // verify-ca checks the CA as verify-full does.
    let other_ca = with(
        "127.0.0.1",
        format!("sslmode=verify-ca&{}", root("tls-other-ca.pem")),
    );
    let (ready, said) = preflight(&other_ca, &schema).await;
    assert!(!ready && said.contains("UnknownIssuer"), "{said}");

    // The certificate names 127.0.0.1, not localhost.
    let by_name = |mode: &str| {
        with(
            "localhost",
            format!("sslmode={mode}&{}", root("tls-ca.pem")),
        )
    };
    let (ready, said) = preflight(&by_name("verify-full"), &schema).await;
    eprintln!("verify-full, another host name: {said}");
    assert!(
        !ready && said.contains("certificate not valid for name \"localhost\""),
        "{said}"
    );
    let (ready, said) = preflight(&by_name("verify-ca"), &schema).await;
    assert!(ready, "verify-ca checks the CA, not the name: {said}");

    let missing = with(
        "127.0.0.1",
        "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem".into(),
    );
    let (ready, said) = preflight(&missing, &schema).await;
    eprintln!("verify-full, a missing CA file: {said}");
    assert!(
        !ready && said.contains("sslrootcert /nonexistent/ca.pem"),
        "{said}"
    );

    let (ready, said) = preflight(&with("127.0.0.1", "sslmode=require".into()), &schema).await;
    assert!(ready, "require without a CA: {said}");
}
