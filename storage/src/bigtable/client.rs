//! The gRPC side: one lazily connected channel, Google credentials unless
//! on the emulator, the routing header Bigtable wants, and bounded retries.
//!
//! Every call has [`RETRY_BUDGET`], each attempt [`ATTEMPT_TIMEOUT`] of it.
//! Reads and unconditional writes (which set cells with explicit
//! timestamps or delete: the same result when applied twice) are retried
//! with exponential backoff and full jitter on the transient codes. A
//! conditional write is retried only when it never left this process (no
//! connection): once sent, a lost answer may hide an applied write, and a
//! second attempt would then report its own condition as failed.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use googleapis_tonic_google_bigtable_v2::google::bigtable::v2::{
    self as pb, bigtable_client::BigtableClient, read_rows_response::cell_chunk::RowStatus,
};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request, Status};

use super::row::Row;
use super::settings::BigtableSettings;
use crate::{Result, StorageError};

/// How long one storage call may take, retries included.
pub const RETRY_BUDGET: Duration = Duration::from_secs(5);
/// How long one attempt may take.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
const DATA_SCOPE: &str = "https://www.googleapis.com/auth/bigtable.data";
pub const ADMIN_SCOPE: &str = "https://www.googleapis.com/auth/bigtable.admin.table";

/// Whether a failed attempt may be tried again.
#[derive(Clone, Copy, PartialEq)]
pub enum Retry {
    /// Reads and writes that give the same result applied twice.
    Idempotent,
    /// Conditional writes: only when nothing was sent.
    Unsent,
}

#[derive(Clone)]
pub struct Connection {
    pub channel: Channel,
    pub settings: Arc<BigtableSettings>,
    /// `None` on the emulator, which takes no credentials.
    auth: Option<Arc<dyn gcp_auth::TokenProvider>>,
}

impl Connection {
    pub async fn open(settings: BigtableSettings) -> Result<Self> {
        let scheme = if settings.emulator { "http" } else { "https" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{}", settings.endpoint))
            .map_err(|e| StorageError::Backend(format!("Bigtable endpoint: {e}")))?
            .connect_timeout(ATTEMPT_TIMEOUT)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10));
        if !settings.emulator {
            endpoint = endpoint
                .tls_config(ClientTlsConfig::new().with_native_roots())
                .map_err(|e| StorageError::Backend(format!("Bigtable TLS: {e}")))?;
        }
        let auth = match settings.emulator {
            true => None,
            false => Some(gcp_auth::provider().await.map_err(|e| {
                StorageError::Backend(format!("Bigtable: no Google credentials: {e}"))
            })?),
        };
        Ok(Connection {
            channel: endpoint.connect_lazy(),
            settings: Arc::new(settings),
            auth,
        })
    }

    pub fn data(&self) -> BigtableClient<Channel> {
        BigtableClient::new(self.channel.clone())
    }

    /// A data API call's `message` with its credentials, routing header and
    /// deadline.
    pub async fn request<T>(&self, message: T) -> Result<Request<T>> {
        let settings = &self.settings;
        let routing = [
            ("table_name", settings.table_name.as_str()),
            ("app_profile_id", settings.app_profile_id.as_str()),
        ];
        self.request_to(message, DATA_SCOPE, &routing).await
    }

    /// `message` with credentials for `scope`, the routing header naming
    /// the resources it is about (`table_name=...`, `parent=...`) and the
    /// attempt's deadline.
    pub async fn request_to<T>(
        &self,
        message: T,
        scope: &str,
        routing: &[(&str, &str)],
    ) -> Result<Request<T>> {
        let mut request = Request::new(message);
        request.set_timeout(ATTEMPT_TIMEOUT);
        let routing = routing
            .iter()
            .map(|(k, v)| format!("{k}={}", percent_encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        if let Ok(value) = routing.parse() {
            request
                .metadata_mut()
                .insert("x-goog-request-params", value);
        }
        if let Some(auth) = &self.auth {
            let token = auth
                .token(&[scope])
                .await
                .map_err(|e| StorageError::Backend(format!("Bigtable credentials: {e}")))?;
            let value = format!("Bearer {}", token.as_str())
                .parse()
                .map_err(|_| StorageError::Backend("Bigtable credentials: bad token".into()))?;
            request.metadata_mut().insert("authorization", value);
        }
        Ok(request)
    }

    /// Run `attempt` until it succeeds, fails for good, or the budget is
    /// spent.
    pub async fn retry<T, F, Fut>(
        &self,
        op: &'static str,
        retry: Retry,
        mut attempt: F,
    ) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<std::result::Result<T, Status>>>,
    {
        let deadline = tokio::time::Instant::now() + RETRY_BUDGET;
        let mut backoff = Duration::from_millis(25);
        loop {
            autopush_common::metrics::storage_request("bigtable", op);
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let status = match tokio::time::timeout(left.min(ATTEMPT_TIMEOUT), attempt()).await {
                Ok(outcome) => match outcome? {
                    Ok(value) => return Ok(value),
                    Err(status) => status,
                },
                Err(_) => Status::deadline_exceeded("no answer in time"),
            };
            let again = match retry {
                Retry::Idempotent => transient(&status),
                Retry::Unsent => unsent(&status),
            };
            let pause = backoff.mul_f64(fastrand::f64());
            if !again || tokio::time::Instant::now() + pause >= deadline {
                return Err(status_error(op, &self.settings.table_name, &status));
            }
            tokio::time::sleep(pause).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    /// Rows as ReadRows streams them, each with the newest cell of each
    /// column (the filter given should keep one per column).
    pub async fn read_rows(&self, request: pb::ReadRowsRequest) -> Result<Vec<Row>> {
        self.retry("ReadRows", Retry::Idempotent, || {
            let request = request.clone();
            async move {
                let request = self.request(request).await?;
                Ok(async {
                    let mut stream = self.data().read_rows(request).await?.into_inner();
                    let mut merger = RowMerger::default();
                    while let Some(response) = stream.message().await? {
                        merger.push(response)?;
                    }
                    Ok(merger.rows)
                }
                .await)
            }
        })
        .await
    }

    pub async fn mutate_row(&self, request: pb::MutateRowRequest) -> Result<()> {
        self.retry("MutateRow", Retry::Idempotent, || {
            let request = request.clone();
            async move {
                let request = self.request(request).await?;
                Ok(self.data().mutate_row(request).await.map(|_| ()))
            }
        })
        .await
    }

    /// Apply entries (idempotent ones: deletes), resending those that
    /// failed.
    pub async fn mutate_rows(&self, entries: Vec<pb::mutate_rows_request::Entry>) -> Result<()> {
        for chunk in entries.chunks(1000) {
            let request = pb::MutateRowsRequest {
                table_name: self.settings.table_name.clone(),
                app_profile_id: self.settings.app_profile_id.clone(),
                entries: chunk.to_vec(),
                ..Default::default()
            };
            self.retry("MutateRows", Retry::Idempotent, || {
                let request = request.clone();
                async move {
                    let request = self.request(request).await?;
                    Ok(async {
                        let mut stream = self.data().mutate_rows(request).await?.into_inner();
                        while let Some(response) = stream.message().await? {
                            for entry in response.entries {
                                if let Some(status) = entry.status.filter(|s| s.code != 0) {
                                    return Err(Status::new(
                                        Code::from(status.code),
                                        status.message,
                                    ));
                                }
                            }
                        }
                        Ok(())
                    }
                    .await)
                }
            })
            .await?;
        }
        Ok(())
    }

    /// Whether the predicate matched (and so which mutations were applied).
    pub async fn check_and_mutate(&self, request: pb::CheckAndMutateRowRequest) -> Result<bool> {
        self.retry("CheckAndMutateRow", Retry::Unsent, || {
            let request = request.clone();
            async move {
                let request = self.request(request).await?;
                Ok(self
                    .data()
                    .check_and_mutate_row(request)
                    .await
                    .map(|r| r.into_inner().predicate_matched))
            }
        })
        .await
    }
}

/// Codes worth another attempt of an idempotent call.
fn transient(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Aborted | Code::ResourceExhausted
    ) || (status.code() == Code::Internal && status.message().contains("RST_STREAM"))
        || unsent(status)
}

/// The call never reached the server: no connection could be made.
fn unsent(status: &Status) -> bool {
    use std::error::Error;
    let mut source = status.source();
    while let Some(e) = source {
        if let Some(transport) = e.downcast_ref::<tonic::transport::Error>()
            && transport.to_string().contains("connect")
        {
            return true;
        }
        if e.to_string().contains("tcp connect error") {
            return true;
        }
        source = e.source();
    }
    false
}

/// A failed call as a storage error: a missing table or family is
/// [`StorageError::NoTable`].
pub fn status_error(op: &str, table: &str, status: &Status) -> StorageError {
    let message = format!("Bigtable {op}: {:?}: {}", status.code(), status.message());
    match status.code() {
        Code::NotFound => StorageError::NoTable(format!("{message} (table {table})")),
        _ => StorageError::Backend(message),
    }
}

/// `value` for the routing header: everything but unreserved characters
/// percent-encoded.
fn percent_encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Rebuilds rows from ReadRows chunks: a chunk names its row, family and
/// qualifier only when they change, and a large value arrives split over
/// several chunks (`value_size` set on all but the last).
#[derive(Default)]
struct RowMerger {
    rows: Vec<Row>,
    current: Row,
    family: String,
    qualifier: Vec<u8>,
    /// The current cell's timestamp (sent with its first chunk only).
    timestamp: i64,
    /// Whether the last chunk left its cell's value unfinished.
    mid_cell: bool,
    value: Vec<u8>,
}

impl RowMerger {
    fn push(&mut self, response: pb::ReadRowsResponse) -> std::result::Result<(), Status> {
        for chunk in response.chunks {
            if !chunk.row_key.is_empty() {
                self.current.key = chunk.row_key;
            }
            if let Some(family) = chunk.family_name {
                self.family = family;
            }
            if let Some(qualifier) = chunk.qualifier {
                self.qualifier = qualifier;
            }
            if !self.mid_cell {
                self.timestamp = chunk.timestamp_micros;
            }
            self.mid_cell = chunk.value_size != 0;
            self.value.extend_from_slice(&chunk.value);
            if chunk.value_size == 0 {
                let value = std::mem::take(&mut self.value);
                // Cells of a column come newest first: keep the first.
                let at = (self.family.clone(), self.qualifier.clone());
                if let std::collections::hash_map::Entry::Vacant(cell) =
                    self.current.cells.entry(at.clone())
                {
                    cell.insert(value);
                    self.current.stamps.insert(at, self.timestamp);
                }
            }
            match chunk.row_status {
                Some(RowStatus::CommitRow(true)) => {
                    self.rows.push(std::mem::take(&mut self.current));
                }
                Some(RowStatus::ResetRow(true)) => {
                    self.current = Row::default();
                    self.value.clear();
                    self.mid_cell = false;
                }
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_header_values_are_percent_encoded() {
        assert_eq!(
            percent_encode("projects/p/instances/i/tables/autopush"),
            "projects%2Fp%2Finstances%2Fi%2Ftables%2Fautopush"
        );
    }
}
