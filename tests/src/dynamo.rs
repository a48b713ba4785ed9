//! A local DynamoDB-compatible server for the DynamoDB tests: moto
//! (`moto[dynamodb]` from tests/py/requirements.txt), started on a free
//! loopback port once per test binary. It is not AWS: it answers the same
//! API, with the same conditions, pagination and TTL settings.
//!
//! Each test gets its own pair of tables ([`tables`]), so tests share the
//! server without seeing each other's records.

use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use autopush_storage::dynamodb::{DynamoStore, Tables};
use tokio::sync::OnceCell;

use crate::py::python;
use crate::server::free_ports;

/// moto's server, exiting when its stdin closes, i.e. when the test binary
/// that started it exits, however it exits.
const MOTO: &str = r#"
import os, sys, threading
from moto.server import main
def watch():
    sys.stdin.read()
    os._exit(0)
threading.Thread(target=watch, daemon=True).start()
main(["-H", "127.0.0.1", "-p", sys.argv[1]])
"#;

pub struct LocalDynamo {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    _child: Child,
    _stdin: ChildStdin,
}

static SHARED: OnceCell<LocalDynamo> = OnceCell::const_new();

/// The server this test binary shares, started on first use.
pub async fn local() -> &'static LocalDynamo {
    SHARED.get_or_init(LocalDynamo::start).await
}

impl LocalDynamo {
    async fn start() -> LocalDynamo {
        let [port] = free_ports::<1>();
        let log = tempfile::Builder::new()
            .prefix("autopush-moto-")
            .tempfile()
            .expect("create moto log file")
            .into_temp_path()
            .keep()
            .expect("keep moto log file");
        let mut child = Command::new(python())
            .args(["-c", MOTO, &port.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("open moto log"))
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start moto with {} (run scripts/test --setup-python): {e}",
                    python().display()
                )
            });
        let stdin = child.stdin.take().expect("moto stdin");
        let endpoint = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let started = Instant::now();
        loop {
            if let Ok(reply) = http.get(format!("{endpoint}/moto-api/")).send().await
                && reply.status().is_success()
            {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "moto exited ({status}): {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "moto did not answer on {endpoint} within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        LocalDynamo {
            endpoint,
            _child: child,
            _stdin: stdin,
        }
    }

    /// The environment that points the AWS SDK (ours, boto3) at this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        aws_env(&self.endpoint)
    }
}

/// The environment that points an AWS SDK at `endpoint`, with dummy
/// credentials and a region.
pub fn aws_env(endpoint: &str) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ENDPOINT_URL_DYNAMODB", endpoint.to_owned()),
        ("AWS_REGION", "us-east-1".into()),
        ("AWS_DEFAULT_REGION", "us-east-1".into()),
        ("AWS_ACCESS_KEY_ID", "testing".into()),
        ("AWS_SECRET_ACCESS_KEY", "testing".into()),
        ("AWS_EC2_METADATA_DISABLED", "true".into()),
    ]
}

/// Fresh table names for one test.
pub fn tables() -> Tables {
    let tag = uuid::Uuid::new_v4().simple().to_string();
    Tables {
        router: format!("router_{tag}"),
        message: format!("message_{tag}"),
    }
}

/// A store on `endpoint` with the tables `tables` (not created).
pub async fn connect(endpoint: &str, tables: Tables) -> DynamoStore {
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .endpoint_url(endpoint)
        .region(aws_config::Region::new("us-east-1"))
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new(
            "testing", "testing", None, None, "tests",
        ));
    DynamoStore::connect_with(config, tables)
        .await
        .expect("connect to the local DynamoDB")
}

/// Query page size of [`fresh_store`]: small, so a few dozen messages
/// span several pages.
pub const PAGE_SIZE: usize = 25;

/// A store on the shared local server with fresh, created tables, reading
/// [`PAGE_SIZE`] items per page.
pub async fn fresh_store() -> DynamoStore {
    let store = connect(&local().await.endpoint, tables())
        .await
        .with_page_size(PAGE_SIZE);
    store.create_tables().await.expect("create tables");
    store
}
