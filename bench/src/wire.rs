//! Requests to the shared store counted at the wire: a proxy in front of
//! moto (DynamoDB's HTTP/1.1 JSON API, counted by `X-Amz-Target`) or of the
//! Bigtable emulator (gRPC over h2c, counted by method path). What a
//! DynamoDB or Bigtable bill is made of, whatever the server believes it sent.
//! On PostgreSQL, the statements its server ran (`pg_stat_statements`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use autopush_tests::dynamo::ThrottlingProxy;
use autopush_tests::postgres::psql_at;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Requests seen by operation (`GetItem`, `ReadRows`, ...).
pub type Counts = BTreeMap<String, usize>;

pub enum Counter {
    /// DynamoDB: `http://127.0.0.1:PORT` is the proxy.
    Dynamo(ThrottlingProxy),
    Bigtable(GrpcCounter),
    Postgres(StatementCounter),
}

impl Counter {
    /// The requests seen so far, and the count restarted.
    pub fn take(&self) -> Counts {
        match self {
            Counter::Dynamo(proxy) => proxy.take_operations(),
            Counter::Bigtable(counter) => std::mem::take(&mut *lock(&counter.counts)),
            Counter::Postgres(counter) => counter.take(),
        }
    }
}

/// An h2c proxy that counts gRPC calls by method (the last segment of the
/// path) and forwards each, streams and trailers as they are, on an
/// upstream connection of its own per client connection.
pub struct GrpcCounter {
    /// `127.0.0.1:PORT`.
    pub host: String,
    counts: Arc<Mutex<Counts>>,
    task: JoinHandle<()>,
}

impl GrpcCounter {
    pub async fn start(upstream: &str) -> GrpcCounter {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the gRPC counter");
        let host = listener.local_addr().expect("its address").to_string();
        let counts = Arc::new(Mutex::new(Counts::new()));
        let (upstream, shared) = (upstream.to_owned(), counts.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(forward(client, upstream.clone(), shared.clone()));
            }
        });
        GrpcCounter { host, counts, task }
    }
}

impl Drop for GrpcCounter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(client: TcpStream, upstream: String, counts: Arc<Mutex<Counts>>) {
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let Ok((sender, connection)) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(server)).await
    else {
        return;
    };
    tokio::spawn(connection);
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let (mut sender, counts, upstream) = (sender.clone(), counts.clone(), upstream.clone());
        async move {
            let path = request.uri().path().to_owned();
            let method = path.rsplit('/').next().unwrap_or_default().to_owned();
            *lock(&counts).entry(method).or_default() += 1;
            let (mut parts, body) = request.into_parts();
            parts.uri = format!("http://{upstream}{path}")
                .parse()
                .unwrap_or(parts.uri);
            let response: Result<Response<Incoming>, hyper::Error> =
                sender.send_request(Request::from_parts(parts, body)).await;
            response
        }
    });
    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(client), service)
        .await;
}

/// The statements PostgreSQL ran on one schema, by `pg_stat_statements`
/// (which the cluster preloads), counted by verb and table (`SELECT router`,
/// `DELETE message`: a statement that writes by what it writes).
pub struct StatementCounter {
    dsn: String,
    schema: String,
    /// Calls of each statement at the last count.
    seen: Mutex<BTreeMap<String, u64>>,
}

impl StatementCounter {
    /// Counting from now the statements on `schema` of the cluster at `dsn`.
    pub fn start(dsn: &str, schema: &str) -> StatementCounter {
        psql_at(dsn, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements");
        let counter = StatementCounter {
            dsn: dsn.to_owned(),
            schema: schema.to_owned(),
            seen: Mutex::new(BTreeMap::new()),
        };
        counter.take();
        counter
    }

    /// The cluster's postmaster, whose children serve its connections.
    pub fn postmaster_pid(&self) -> u32 {
        let pid = psql_at(
            &self.dsn,
            "SELECT split_part(pg_read_file('postmaster.pid'), E'\\n', 1)",
        );
        pid.trim()
            .parse()
            .unwrap_or_else(|_| panic!("postmaster.pid holds no pid: {pid:?}"))
    }

    fn take(&self) -> Counts {
        let rows = psql_at(
            &self.dsn,
            &format!(
                "SELECT sum(calls), regexp_replace(query, '\\s+', ' ', 'g') AS q \
                 FROM pg_stat_statements WHERE query LIKE '%{}.%' GROUP BY q",
                self.schema
            ),
        );
        let now: BTreeMap<String, u64> = rows
            .lines()
            .filter_map(|line| line.split_once('|'))
            .map(|(calls, query)| (query.to_owned(), calls.parse().unwrap_or(0)))
            .collect();
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let mut counts = Counts::new();
        for (query, calls) in &now {
            let new = calls.saturating_sub(seen.get(query).copied().unwrap_or(0));
            if new > 0 {
                *counts.entry(self.operation(query)).or_default() += new as usize;
            }
        }
        *seen = now;
        counts
    }

    /// `VERB table` of `query`: its first write, else `SELECT`, and the
    /// table of this schema that follows it.
    fn operation(&self, query: &str) -> String {
        let upper = query.to_ascii_uppercase();
        let (verb, at) = ["INSERT ", "UPDATE ", "DELETE "]
            .iter()
            .filter_map(|verb| Some((verb.trim(), upper.find(verb)?)))
            .min_by_key(|&(_, at)| at)
            .unwrap_or(("SELECT", 0));
        let prefix = format!("{}.", self.schema);
        let table = query[at..]
            .split_once(&prefix)
            .map(|(_, rest)| rest)
            .unwrap_or_default()
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .next()
            .unwrap_or_default();
        format!("{verb} {table}")
    }
}

fn lock(counts: &Mutex<Counts>) -> std::sync::MutexGuard<'_, Counts> {
    counts
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
