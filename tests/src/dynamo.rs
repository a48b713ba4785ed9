//! Local DynamoDB-compatible servers for the DynamoDB tests: moto
//! (`moto[dynamodb]` from tests/py/requirements.txt) and dynalite (npm,
//! tests/node/package.json), each started on a free loopback port once per
//! test binary. Neither is AWS: they answer the same API, with the same
//! conditions and pagination; moto also keeps TTL settings, dynalite has
//! no TTL API at all.
//!
//! Each test gets its own pair of tables ([`tables`]), so tests share the
//! server without seeing each other's records.

use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use autopush_storage::dynamodb::{DynamoStore, Tables};
use tokio::sync::OnceCell;

use crate::node::{node, node_dir};
use crate::py::python;
use crate::server::free_ports;

/// moto's server, exiting when its stdin closes, i.e. when the test binary
/// that started it exits, however it exits.
///
/// It answers one request at a time. moto serves each request on its own
/// thread and checks a write's condition apart from making the write, so two
/// `UpdateItem`s conditional on the same value can both succeed (9 rounds in
/// 600 of eight racing writers here). DynamoDB makes each conditional write
/// atomic; the storage race tests rely on that.
const MOTO: &str = r#"
import os, sys, threading
from moto.moto_server.werkzeug_app import DomainDispatcherApplication
from moto.server import main
def watch():
    sys.stdin.read()
    os._exit(0)
threading.Thread(target=watch, daemon=True).start()
one_at_a_time = threading.Lock()
dispatch = DomainDispatcherApplication.__call__
def serially(app, environ, start_response):
    with one_at_a_time:
        return dispatch(app, environ, start_response)
DomainDispatcherApplication.__call__ = serially
main(["-H", "127.0.0.1", "-p", sys.argv[1]])
"#;

/// dynalite in memory, exiting when its stdin closes.
const DYNALITE: &str = r#"
process.stdin.on("end", () => process.exit(0));
process.stdin.resume();
require("dynalite")({ createTableMs: 50 }).listen(Number(process.argv[1]), "127.0.0.1");
"#;

pub struct LocalDynamo {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    _child: Child,
    _stdin: ChildStdin,
}

static SHARED: OnceCell<LocalDynamo> = OnceCell::const_new();
static DYNALITE_SHARED: OnceCell<LocalDynamo> = OnceCell::const_new();

/// The moto server this test binary shares, started on first use.
pub async fn local() -> &'static LocalDynamo {
    SHARED
        .get_or_init(|| async {
            let mut moto = Command::new(python());
            moto.arg("-c").arg(MOTO);
            LocalDynamo::start("moto (run scripts/test --setup-python)", moto).await
        })
        .await
}

/// The dynalite server this test binary shares, started on first use.
pub async fn dynalite() -> &'static LocalDynamo {
    DYNALITE_SHARED
        .get_or_init(|| async {
            let mut dynalite = Command::new(node());
            dynalite.current_dir(node_dir()).arg("-e").arg(DYNALITE);
            LocalDynamo::start("dynalite (run scripts/test --setup-node)", dynalite).await
        })
        .await
}

impl LocalDynamo {
    /// Run `command PORT` and wait until it answers HTTP on that port.
    async fn start(name: &str, mut command: Command) -> LocalDynamo {
        let [port] = free_ports::<1>();
        let log = tempfile::Builder::new()
            .prefix("autopush-local-dynamo-")
            .tempfile()
            .expect("create server log file")
            .into_temp_path()
            .keep()
            .expect("keep server log file");
        let mut child = command
            .arg(port.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("open server log"))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let stdin = child.stdin.take().expect("server stdin");
        let endpoint = format!("http://127.0.0.1:{port}");
        let http = crate::http::client().clone();
        let started = Instant::now();
        // Any HTTP answer means it is up.
        while http.get(&endpoint).send().await.is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "{name} exited ({status}): {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{name} did not answer on {endpoint} within 60 s"
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
        rotate_messages: false,
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

/// A store on the shared moto server with fresh, created tables, reading
/// [`PAGE_SIZE`] items per page.
pub async fn fresh_store() -> DynamoStore {
    fresh_store_on(local().await).await
}

/// [`fresh_store`] on the shared dynalite server.
pub async fn fresh_dynalite_store() -> DynamoStore {
    fresh_store_on(dynalite().await).await
}

async fn fresh_store_on(server: &LocalDynamo) -> DynamoStore {
    let store = connect(&server.endpoint, tables())
        .await
        .with_page_size(PAGE_SIZE);
    store.create_tables().await.expect("create tables");
    store
}

/// A proxy in front of the local server that answers
/// `ProvisionedThroughputExceededException` (HTTP 400, as DynamoDB does)
/// instead of forwarding, while told to: for the next N requests, or until
/// switched off. What a table over its capacity looks like to a client.
/// Told to [`ThrottlingProxy::deny_access`], it answers every request with
/// the `AccessDeniedException` a misconfigured IAM role gets, whose message
/// names the AWS account ([`DENIED_ACCOUNT`]) and role: backend detail that
/// must stay in the service's log. It also counts the requests it sees by
/// operation (what a DynamoDB bill is made of). Told to
/// [`ThrottlingProxy::park`] an operation, it holds each such request until
/// released: a write as slow as the test needs, with no clock involved.
pub struct ThrottlingProxy {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    state: std::sync::Arc<ThrottleState>,
    task: tokio::task::JoinHandle<()>,
}

/// The AWS account the proxy's `AccessDeniedException` names.
pub const DENIED_ACCOUNT: &str = "123456789012";

/// The role the proxy's `AccessDeniedException` names.
pub const DENIED_ROLE: &str = "autopush-prod-node-role";

#[derive(Default)]
struct ThrottleState {
    always: std::sync::atomic::AtomicBool,
    deny: std::sync::atomic::AtomicBool,
    next: std::sync::atomic::AtomicUsize,
    refused: std::sync::atomic::AtomicUsize,
    /// Requests seen, by operation (`X-Amz-Target` without its prefix).
    operations: std::sync::Mutex<std::collections::BTreeMap<String, usize>>,
    /// Operations held until released, by name.
    parked: std::sync::Mutex<std::collections::BTreeMap<String, Gate>>,
}

/// Requests of one operation held back: how many arrived, and whether they
/// may go on.
#[derive(Clone)]
struct Gate {
    arrived: tokio::sync::watch::Sender<usize>,
    open: tokio::sync::watch::Sender<bool>,
}

impl Gate {
    fn new() -> Gate {
        Gate {
            arrived: tokio::sync::watch::Sender::new(0),
            open: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl ThrottleState {
    fn refuse(&self) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        let refuse = self.always.load(SeqCst)
            || self
                .next
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if refuse {
            self.refused.fetch_add(1, SeqCst);
        }
        refuse
    }
}

impl ThrottlingProxy {
    pub async fn start(upstream: &str) -> ThrottlingProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let endpoint = format!("http://{}", listener.local_addr().expect("proxy addr"));
        let state = std::sync::Arc::new(ThrottleState::default());
        let (upstream, shared) = (upstream.to_owned(), state.clone());
        let task = tokio::spawn(async move {
            let http = crate::http::client().clone();
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(proxy_connection(
                    socket,
                    http.clone(),
                    upstream.clone(),
                    shared.clone(),
                ));
            }
        });
        ThrottlingProxy {
            endpoint,
            state,
            task,
        }
    }

    /// Refuse every request until [`ThrottlingProxy::stop`].
    pub fn throttle(&self) {
        self.state
            .always
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Refuse the next `n` requests.
    pub fn throttle_next(&self, n: usize) {
        self.state
            .next
            .store(n, std::sync::atomic::Ordering::SeqCst);
    }

    /// Answer every request with `AccessDeniedException` until
    /// [`ThrottlingProxy::stop`].
    pub fn deny_access(&self) {
        self.state
            .deny
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn stop(&self) {
        self.state
            .always
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.state
            .deny
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.state
            .next
            .store(0, std::sync::atomic::Ordering::SeqCst);
    }

    /// Requests seen so far by operation (`GetItem`, `Query`, ...), and
    /// the count restarted.
    pub fn take_operations(&self) -> std::collections::BTreeMap<String, usize> {
        std::mem::take(&mut *self.state.operations.lock().unwrap())
    }

    /// Hold every `operation` request (`PutItem`, `DeleteItem`, ...) from
    /// now until [`ThrottlingProxy::release`].
    pub fn park(&self, operation: &str) {
        self.state
            .parked
            .lock()
            .unwrap()
            .insert(operation.to_owned(), Gate::new());
    }

    /// Wait until `n` requests of the parked `operation` are held (hang
    /// guard: panics after [`crate::HANG_GUARD`]).
    pub async fn wait_parked(&self, operation: &str, n: usize) {
        let gate = self.state.parked.lock().unwrap().get(operation).cloned();
        let gate = gate.unwrap_or_else(|| panic!("{operation} is not parked"));
        let mut arrived = gate.arrived.subscribe();
        tokio::time::timeout(crate::HANG_GUARD, arrived.wait_for(|held| *held >= n))
            .await
            .unwrap_or_else(|_| panic!("no {n} {operation} requests within the hang guard"))
            .expect("the gate is kept while waited on");
    }

    /// Let the held `operation` requests go on, and stop holding it.
    pub fn release(&self, operation: &str) {
        if let Some(gate) = self.state.parked.lock().unwrap().remove(operation) {
            gate.open.send_replace(true);
        }
    }

    /// Requests refused so far.
    pub fn refused(&self) -> usize {
        self.state.refused.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for ThrottlingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serve HTTP/1.1 requests on one connection (keep-alive), forwarding each
/// to `upstream` unless `state` says to refuse it.
async fn proxy_connection(
    mut socket: tokio::net::TcpStream,
    http: reqwest::Client,
    upstream: String,
    state: std::sync::Arc<ThrottleState>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 8192];
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let mut lines = head.split("\r\n");
        let path = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .unwrap_or("/")
            .to_owned();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        let length: usize = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 8192];
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body = buf[head_end..head_end + length].to_vec();
        let operation = headers
            .iter()
            .find(|(k, _)| k == "x-amz-target")
            .map(|(_, target)| target.rsplit('.').next().unwrap_or(target).to_owned());
        if let Some(operation) = &operation {
            *state
                .operations
                .lock()
                .unwrap()
                .entry(operation.clone())
                .or_default() += 1;
        }
        let operation = operation.unwrap_or_default();
        buf.drain(..head_end + length);
        let gate = state.parked.lock().unwrap().get(&operation).cloned();
        if let Some(gate) = gate {
            let mut open = gate.open.subscribe();
            gate.arrived.send_modify(|held| *held += 1);
            let _ = open.wait_for(|open| *open).await;
        }
        let (status, content_type, reply) = if state.deny.load(std::sync::atomic::Ordering::SeqCst)
        {
            let table = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|b| b["TableName"].as_str().map(str::to_owned))
                .unwrap_or_default();
            let message = format!(
                "User: arn:aws:sts::{DENIED_ACCOUNT}:assumed-role/{DENIED_ROLE}/i-0a1b2c3d4e5f \
                 is not authorized to perform: dynamodb:{operation} on resource: \
                 arn:aws:dynamodb:us-east-1:{DENIED_ACCOUNT}:table/{table} because no \
                 identity-based policy allows the dynamodb:{operation} action"
            );
            let reply = serde_json::json!({
                "__type": "com.amazon.coral.service#AccessDeniedException",
                "Message": message,
            });
            (
                400,
                "application/x-amz-json-1.0".to_owned(),
                reply.to_string().into_bytes(),
            )
        } else if state.refuse() {
            (
                400,
                "application/x-amz-json-1.0".to_owned(),
                br#"{"__type":"com.amazonaws.dynamodb.v20120810#ProvisionedThroughputExceededException","message":"The level of configured provisioned throughput for the table was exceeded."}"#.to_vec(),
            )
        } else {
            let mut request = http.post(format!("{upstream}{path}")).body(body);
            for (k, v) in &headers {
                if !["host", "content-length", "connection"].contains(&k.as_str()) {
                    request = request.header(k, v);
                }
            }
            match request.send().await {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let content_type = r
                        .headers()
                        .get("content-type")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("application/x-amz-json-1.0")
                        .to_owned();
                    (
                        status,
                        content_type,
                        r.bytes().await.unwrap_or_default().to_vec(),
                    )
                }
                Err(_) => (502, "text/plain".to_owned(), b"upstream failed".to_vec()),
            }
        };
        let head = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
            reply.len()
        );
        if socket.write_all(head.as_bytes()).await.is_err()
            || socket.write_all(&reply).await.is_err()
        {
            return;
        }
    }
}
