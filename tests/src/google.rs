//! A local stand-in for Google, over real HTTP on a free loopback port:
//!
//! * `POST /token`: the OAuth2 token endpoint of a service-account key. It
//!   checks the JWT-bearer grant as Google does: the RS256 signature against
//!   the test key's public half (`certs/fcm-public.pem`), the issuer, the
//!   audience (this endpoint) and the FCM scope; and counts the fetches.
//! * `POST /v1/projects/{project}/messages:send`: FCM HTTP v1. It checks the
//!   bearer token (issued here, unexpired, not revoked) and the message's
//!   shape, records what it received, and answers as scripted per device
//!   token ([`Reply`]), 200 by default.
//!
//! * `GET /stats`: `{"received": N, "token_fetches": N}`, for a load
//!   generator that runs the stand-in in a process of its own.
//!
//! The server is configured with [`Google::base_url`] and a service-account
//! file whose `token_uri` points here ([`Google::write_service_account`]).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use bytes::Bytes;
use serde_json::{Value, json};
use warp::Filter;
use warp::http::{HeaderMap, StatusCode};
use warp::reply::Reply as _;

use crate::{HANG_GUARD, cert_file};

/// The scope FCM HTTP v1 needs.
pub const FCM_SCOPE: &str = "https://www.googleapis.com/auth/firebase.messaging";

/// How `messages:send` answers one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// 200 with the message name.
    Ok,
    /// 404 `NOT_FOUND` / `UNREGISTERED`: the app was uninstalled.
    Unregistered,
    /// 400 `INVALID_ARGUMENT` on `message.token`.
    InvalidToken,
    /// 400 `INVALID_ARGUMENT` about something else, with this message.
    InvalidArgument(String),
    /// 401 `UNAUTHENTICATED`.
    Unauthenticated,
    /// 403 `PERMISSION_DENIED` / `SENDER_ID_MISMATCH`.
    PermissionDenied,
    /// 429 `RESOURCE_EXHAUSTED` / `QUOTA_EXCEEDED`, with `Retry-After` if given.
    QuotaExceeded { retry_after: Option<u64> },
    /// 500 `INTERNAL`.
    Internal,
    /// 503 `UNAVAILABLE`, with `Retry-After` if given.
    Unavailable { retry_after: Option<u64> },
    /// No answer for a minute.
    Stall,
    /// 307 to the same `messages:send` URL: a client that follows it posts
    /// the message (and its bearer token) again.
    Redirect,
}

/// One `messages:send` request as received.
#[derive(Clone, Debug)]
pub struct Received {
    pub project: String,
    /// Request headers, lower-case names.
    pub headers: HashMap<String, String>,
    pub body: Value,
    pub at: Instant,
}

impl Received {
    /// `message.token`.
    pub fn token(&self) -> &str {
        self.body["message"]["token"].as_str().unwrap_or_default()
    }

    /// `message.android.data`.
    pub fn data(&self) -> &Value {
        &self.body["message"]["android"]["data"]
    }
}

struct Issued {
    token: String,
    expires: Instant,
    revoked: bool,
}

struct State {
    /// The test key's public half, PKCS#1 DER.
    public_key: Vec<u8>,
    client_email: String,
    token_uri: String,
    token_lifetime: AtomicU64,
    refuse_grants: AtomicBool,
    token_fetches: AtomicU64,
    issued: Mutex<Vec<Issued>>,
    unauthenticated: AtomicU64,
    scripts: Mutex<HashMap<String, VecDeque<Reply>>>,
    /// Every answer of `messages:send` waits this long first.
    delay_micros: AtomicU64,
    received: Mutex<Vec<Received>>,
    /// Keep each request (tests) or only count them (load generators).
    keep: AtomicBool,
    received_count: AtomicU64,
    arrivals: tokio::sync::Notify,
}

/// The running stand-in; stops when dropped.
pub struct Google {
    addr: SocketAddr,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Google {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `certs/fcm-service-account.json`, as committed.
pub fn service_account_template() -> Value {
    let path = cert_file("fcm-service-account.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run certs/make-fcm.sh)", path.display()));
    serde_json::from_str(&text).expect("the service-account JSON parses")
}

fn public_key_der() -> Vec<u8> {
    let path = cert_file("fcm-public.pem");
    let pem = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run certs/make-fcm.sh)", path.display()));
    let b64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    STANDARD.decode(b64).expect("fcm-public.pem is base64 PEM")
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

impl Google {
    /// Start on a free loopback port.
    pub async fn start() -> Google {
        Google::start_on(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("bind the Google stand-in")
    }

    /// Start on `addr` (port 0: a free one).
    pub async fn start_on(addr: SocketAddr) -> std::io::Result<Google> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let template = service_account_template();
        let state = Arc::new(State {
            public_key: public_key_der(),
            client_email: template["client_email"].as_str().unwrap_or_default().into(),
            token_uri: format!("http://{addr}/token"),
            token_lifetime: AtomicU64::new(3600),
            refuse_grants: AtomicBool::new(false),
            token_fetches: AtomicU64::new(0),
            issued: Mutex::new(Vec::new()),
            unauthenticated: AtomicU64::new(0),
            scripts: Mutex::new(HashMap::new()),
            delay_micros: AtomicU64::new(0),
            received: Mutex::new(Vec::new()),
            keep: AtomicBool::new(true),
            received_count: AtomicU64::new(0),
            arrivals: tokio::sync::Notify::new(),
        });
        let token_state = state.clone();
        let token = warp::post()
            .and(warp::path("token"))
            .and(warp::path::end())
            .and(warp::body::form::<HashMap<String, String>>())
            .map(move |form| token_state.grant(&form));
        let send_state = state.clone();
        let send = warp::post()
            .and(warp::path::full())
            .and(warp::header::headers_cloned())
            .and(warp::body::bytes())
            .then(
                move |path: warp::path::FullPath, headers: HeaderMap, body: Bytes| {
                    handle_send(send_state.clone(), path.as_str().to_owned(), headers, body)
                },
            );
        // What a load generator in another process reads back.
        let stats_state = state.clone();
        let stats = warp::get()
            .and(warp::path("stats"))
            .and(warp::path::end())
            .map(move || {
                warp::reply::json(&json!({
                    "received": stats_state.received_count.load(Ordering::Relaxed),
                    "token_fetches": stats_state.token_fetches.load(Ordering::Relaxed),
                }))
                .into_response()
            });
        let routes = token.or(stats).unify().or(send).unify().boxed();
        let task = tokio::spawn(async move {
            warp::serve(routes).incoming(listener).run().await;
        });
        Ok(Google { addr, state, task })
    }

    /// Where it listens (plain HTTP).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What the server's FCM `base_url` is set to.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The OAuth token endpoint.
    pub fn token_uri(&self) -> &str {
        &self.state.token_uri
    }

    /// The test service account, its `token_uri` pointing here.
    pub fn service_account(&self) -> Value {
        let mut key = service_account_template();
        key["token_uri"] = json!(self.token_uri());
        key
    }

    /// [`Google::service_account`] written to `dir/NAME`; returns the path.
    pub fn write_service_account(&self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, self.service_account().to_string()).expect("write the key file");
        path
    }

    /// Answer the next requests for device `token` with `replies`, in order
    /// (then 200 again).
    pub fn script(&self, token: &str, replies: &[Reply]) {
        self.state
            .scripts
            .lock()
            .unwrap()
            .entry(token.to_owned())
            .or_default()
            .extend(replies.iter().cloned());
    }

    /// Lifetime of the tokens issued from now on.
    pub fn set_token_lifetime(&self, seconds: u64) {
        self.state.token_lifetime.store(seconds, Ordering::Relaxed);
    }

    /// Every token issued so far is refused from now on (as after a key rotation).
    pub fn revoke_tokens(&self) {
        for issued in self.state.issued.lock().unwrap().iter_mut() {
            issued.revoked = true;
        }
    }

    /// Refuse (or accept again) every grant: the key was deleted.
    pub fn refuse_grants(&self, refuse: bool) {
        self.state.refuse_grants.store(refuse, Ordering::Relaxed);
    }

    /// Answer every `messages:send` after `delay`.
    pub fn set_delay(&self, delay: Duration) {
        self.state
            .delay_micros
            .store(delay.as_micros() as u64, Ordering::Relaxed);
    }

    /// Count requests without keeping them (for load: bodies add up).
    pub fn count_only(&self) {
        self.state.keep.store(false, Ordering::Relaxed);
    }

    /// `messages:send` requests with a valid bearer token so far.
    pub fn received_count(&self) -> u64 {
        self.state.received_count.load(Ordering::Relaxed)
    }

    /// Token requests so far (refused ones included).
    pub fn token_fetches(&self) -> u64 {
        self.state.token_fetches.load(Ordering::Relaxed)
    }

    /// `messages:send` requests answered 401 for their bearer token.
    pub fn unauthenticated(&self) -> u64 {
        self.state.unauthenticated.load(Ordering::Relaxed)
    }

    /// Every `messages:send` request with a valid bearer token, in order.
    pub fn received(&self) -> Vec<Received> {
        self.state.received.lock().unwrap().clone()
    }

    /// The requests for device `token`.
    pub fn received_for(&self, token: &str) -> Vec<Received> {
        self.received()
            .into_iter()
            .filter(|r| r.token() == token)
            .collect()
    }

    /// Wait (hang-guarded) until `n` requests for device `token` arrived.
    pub async fn wait_for(&self, token: &str, n: usize) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + HANG_GUARD;
        loop {
            let arrived = self.state.arrivals.notified();
            let got = self.received_for(token);
            if got.len() >= n {
                return got;
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                panic!("{n} requests for {token} never reached FCM; got {got:?}");
            }
        }
    }
}

impl State {
    fn grant(&self, form: &HashMap<String, String>) -> warp::reply::Response {
        self.token_fetches.fetch_add(1, Ordering::Relaxed);
        let refuse = |why: &str| {
            warp::reply::with_status(
                warp::reply::json(&json!({"error": "invalid_grant", "error_description": why})),
                StatusCode::BAD_REQUEST,
            )
            .into_response()
        };
        if form.get("grant_type").map(String::as_str)
            != Some("urn:ietf:params:oauth:grant-type:jwt-bearer")
        {
            return refuse("grant_type must be the JWT-bearer grant");
        }
        let Some(assertion) = form.get("assertion") else {
            return refuse("no assertion");
        };
        if let Err(why) = self.check_assertion(assertion) {
            return refuse(&why);
        }
        if self.refuse_grants.load(Ordering::Relaxed) {
            return refuse("Invalid JWT Signature.");
        }
        let n = self.token_fetches.load(Ordering::Relaxed);
        let token = format!("ya29.mock-{n}-{}", crate::random_uaid());
        let lifetime = self.token_lifetime.load(Ordering::Relaxed);
        self.issued.lock().unwrap().push(Issued {
            token: token.clone(),
            expires: Instant::now() + Duration::from_secs(lifetime),
            revoked: false,
        });
        warp::reply::json(&json!({
            "access_token": token, "expires_in": lifetime, "token_type": "Bearer"
        }))
        .into_response()
    }

    /// The JWT-bearer assertion: RS256 by the test key, for this endpoint,
    /// with the FCM scope, not expired.
    fn check_assertion(&self, jwt: &str) -> Result<(), String> {
        let parts: Vec<&str> = jwt.split('.').collect();
        let [header, claims, signature] = parts[..] else {
            return Err("the assertion is not a JWT".into());
        };
        let decode = |part: &str| {
            URL_SAFE_NO_PAD
                .decode(part.trim_end_matches('='))
                .map_err(|e| format!("bad base64url in the JWT: {e}"))
        };
        let key = ring::signature::UnparsedPublicKey::new(
            &ring::signature::RSA_PKCS1_2048_8192_SHA256,
            &self.public_key,
        );
        key.verify(format!("{header}.{claims}").as_bytes(), &decode(signature)?)
            .map_err(|_| {
                "the JWT's RS256 signature does not verify with the test key".to_string()
            })?;
        let header: Value = serde_json::from_slice(&decode(header)?).map_err(|e| e.to_string())?;
        let claims: Value = serde_json::from_slice(&decode(claims)?).map_err(|e| e.to_string())?;
        if header["alg"] != "RS256" {
            return Err(format!("alg must be RS256: {header}"));
        }
        if claims["iss"] != self.client_email.as_str() || claims["aud"] != self.token_uri.as_str() {
            return Err(format!("wrong iss or aud: {claims}"));
        }
        let scopes = claims["scope"].as_str().unwrap_or_default();
        if !scopes.split(' ').any(|s| s == FCM_SCOPE) {
            return Err(format!("the FCM scope is missing: {claims}"));
        }
        let now = unix_now();
        let (iat, exp) = (claims["iat"].as_u64(), claims["exp"].as_u64());
        match (iat, exp) {
            (Some(iat), Some(exp)) if iat <= now + 60 && exp > now && exp - iat <= 3600 => Ok(()),
            _ => Err(format!("bad iat/exp: {claims}")),
        }
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        let bearer = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let now = Instant::now();
        bearer.is_some_and(|token| {
            self.issued
                .lock()
                .unwrap()
                .iter()
                .any(|i| i.token == token && !i.revoked && i.expires > now)
        })
    }

    /// Check and record one `messages:send`: the project and how to answer,
    /// or the error answer.
    fn receive(
        &self,
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<(String, Reply), Box<warp::reply::Response>> {
        let Some(project) = path
            .strip_prefix("/v1/projects/")
            .and_then(|rest| rest.strip_suffix("/messages:send"))
        else {
            return Err(Box::new(error(
                StatusCode::NOT_FOUND,
                "NOT_FOUND",
                &format!("no such path {path}"),
                json!([]),
            )));
        };
        if !self.authorized(headers) {
            self.unauthenticated.fetch_add(1, Ordering::Relaxed);
            return Err(Box::new(error(
                StatusCode::UNAUTHORIZED,
                "UNAUTHENTICATED",
                "Request had invalid authentication credentials.",
                json!([]),
            )));
        }
        let body: Value = match serde_json::from_slice(&body) {
            Ok(body) => body,
            Err(e) => return Err(Box::new(invalid(&format!("the body is not JSON: {e}")))),
        };
        if headers.get("content-type").and_then(|v| v.to_str().ok()) != Some("application/json") {
            return Err(Box::new(invalid("Content-Type must be application/json")));
        }
        if let Err(why) = check_message(&body) {
            return Err(Box::new(invalid(&why)));
        }
        let received = Received {
            project: project.to_owned(),
            headers: headers
                .iter()
                .map(|(k, v)| {
                    (
                        k.as_str().to_owned(),
                        v.to_str().unwrap_or_default().to_owned(),
                    )
                })
                .collect(),
            body,
            at: Instant::now(),
        };
        let token = received.token().to_owned();
        self.received_count.fetch_add(1, Ordering::Relaxed);
        if self.keep.load(Ordering::Relaxed) {
            self.received.lock().unwrap().push(received);
        }
        self.arrivals.notify_waiters();
        let reply = self
            .scripts
            .lock()
            .unwrap()
            .get_mut(&token)
            .and_then(VecDeque::pop_front)
            .unwrap_or(Reply::Ok);
        Ok((project.to_owned(), reply))
    }
}

async fn handle_send(
    state: Arc<State>,
    path: String,
    headers: HeaderMap,
    body: Bytes,
) -> warp::reply::Response {
    let delay = Duration::from_micros(state.delay_micros.load(Ordering::Relaxed));
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let received = state.receive(&path, &headers, body);
    match received {
        Ok((project, reply)) => answer(project, reply).await,
        Err(response) => *response,
    }
}

/// What FCM accepts: exactly `{"message": {"token", "android": {"ttl",
/// "priority", "collapse_key"?, "data"}}}`, data values all strings.
fn check_message(body: &Value) -> Result<(), String> {
    let keys = |v: &Value| -> Vec<String> {
        let mut keys: Vec<String> = v
            .as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default();
        keys.sort();
        keys
    };
    if keys(body) != ["message"] || keys(&body["message"]) != ["android", "token"] {
        return Err(format!("unexpected message shape: {body}"));
    }
    let android = &body["message"]["android"];
    let mut android_keys = keys(android);
    android_keys.retain(|k| k != "collapse_key");
    if android_keys != ["data", "priority", "ttl"] {
        return Err(format!("unexpected android fields: {android}"));
    }
    let ttl = android["ttl"].as_str().unwrap_or_default();
    if !ttl
        .strip_suffix('s')
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(format!("Invalid value at 'message.android.ttl': {ttl}"));
    }
    if !matches!(android["priority"].as_str(), Some("high" | "normal")) {
        return Err("Invalid value at 'message.android.priority'".into());
    }
    let data = android["data"]
        .as_object()
        .ok_or("data must be an object")?;
    if data.values().any(|v| !v.is_string()) {
        return Err("Invalid value at 'message.android.data': values must be strings".into());
    }
    Ok(())
}

fn invalid(message: &str) -> warp::reply::Response {
    error(
        StatusCode::BAD_REQUEST,
        "INVALID_ARGUMENT",
        message,
        json!([]),
    )
}

fn error(status: StatusCode, name: &str, message: &str, details: Value) -> warp::reply::Response {
    let body = json!({"error": {
        "code": status.as_u16(), "message": message, "status": name, "details": details
    }});
    warp::reply::with_status(warp::reply::json(&body), status).into_response()
}

fn fcm_detail(code: &str) -> Value {
    json!([{"@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError", "errorCode": code}])
}

fn with_retry_after(
    mut response: warp::reply::Response,
    seconds: Option<u64>,
) -> warp::reply::Response {
    if let Some(seconds) = seconds {
        response.headers_mut().insert(
            "retry-after",
            seconds.to_string().parse().expect("a header value"),
        );
    }
    response
}

async fn answer(project: String, reply: Reply) -> warp::reply::Response {
    match reply {
        Reply::Ok => warp::reply::json(&json!({
            "name": format!("projects/{project}/messages/0:{}", crate::random_uaid())
        }))
        .into_response(),
        Reply::Unregistered => error(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            "Requested entity was not found.",
            fcm_detail("UNREGISTERED"),
        ),
        Reply::InvalidToken => error(
            StatusCode::BAD_REQUEST,
            "INVALID_ARGUMENT",
            "The registration token is not a valid FCM registration token",
            json!([
                {"@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError", "errorCode": "INVALID_ARGUMENT"},
                {"@type": "type.googleapis.com/google.rpc.BadRequest",
                 "fieldViolations": [{"field": "message.token", "description": "Invalid registration token"}]}
            ]),
        ),
        Reply::InvalidArgument(message) => error(
            StatusCode::BAD_REQUEST,
            "INVALID_ARGUMENT",
            &message,
            fcm_detail("INVALID_ARGUMENT"),
        ),
        Reply::Unauthenticated => error(
            StatusCode::UNAUTHORIZED,
            "UNAUTHENTICATED",
            "Request had invalid authentication credentials.",
            fcm_detail("THIRD_PARTY_AUTH_ERROR"),
        ),
        Reply::PermissionDenied => error(
            StatusCode::FORBIDDEN,
            "PERMISSION_DENIED",
            "SenderId mismatch",
            fcm_detail("SENDER_ID_MISMATCH"),
        ),
        Reply::QuotaExceeded { retry_after } => with_retry_after(
            error(
                StatusCode::TOO_MANY_REQUESTS,
                "RESOURCE_EXHAUSTED",
                "Quota exceeded for the device.",
                fcm_detail("QUOTA_EXCEEDED"),
            ),
            retry_after,
        ),
        Reply::Internal => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "INTERNAL",
            "Internal error encountered.",
            fcm_detail("INTERNAL"),
        ),
        Reply::Unavailable { retry_after } => with_retry_after(
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "UNAVAILABLE",
                "The service is currently unavailable.",
                fcm_detail("UNAVAILABLE"),
            ),
            retry_after,
        ),
        Reply::Stall => {
            tokio::time::sleep(Duration::from_secs(60)).await;
            warp::reply::json(&json!({})).into_response()
        }
        Reply::Redirect => {
            let mut response = warp::reply::Response::new(Default::default());
            *response.status_mut() = StatusCode::TEMPORARY_REDIRECT;
            let location = format!("/v1/projects/{project}/messages:send");
            response
                .headers_mut()
                .insert("location", location.parse().expect("a header value"));
            response
        }
    }
}
