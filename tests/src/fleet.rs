//! Stand-ins for connection nodes of other versions, to test our endpoint
//! in a fleet upgraded node by node: a small HTTP server on loopback that
//! answers the router API exactly as another release's node did (or as
//! the next protocol version may, or as autopush-rs's node does), takes
//! every push, and then does nothing with it: a node killed right after
//! its answer. See docs/internals.md, "The router API, version by version".

use std::sync::{Arc, Mutex};

use warp::http::{HeaderMap, HeaderValue, StatusCode};
use warp::reply::{Reply, Response};
use warp::{Filter, Rejection};

/// How a stand-in node answers `PUT /push/{uaid}` and `PUT /notif/{uaid}`.
#[derive(Clone, Copy, Debug)]
pub enum Answers {
    /// Protocol 1, the release before held copies: `{"status":200}` as
    /// JSON and nothing else, whatever the request asked.
    Protocol1,
    /// Protocol 2 (names no version): protocol 1's answer with
    /// `x-autopush-settles-durable-copy: 1`; to a hold, `fate` in
    /// `x-autopush-durable-copy`.
    Protocol2 { fate: &'static str },
    /// A node of the next protocol version, 5: it names its version (and
    /// not protocol 2's header), sends a header we do not know, and answers a hold with `fate`
    /// (which may be a value we do not know).
    Next { fate: &'static str },
    /// autopush-rs's autoconnect: an empty 200.
    AutopushRs,
}

/// A running stand-in node; it stops (as if killed) on [`StandInNode::kill`]
/// or drop.
pub struct StandInNode {
    /// Its base URL, the node id to point users at (`--node-url`).
    pub url: String,
    /// The headers of every `PUT /push` it took, in order.
    pushes: Arc<Mutex<Vec<HeaderMap>>>,
    server: tokio::task::JoinHandle<()>,
}

impl StandInNode {
    pub async fn start(answers: Answers) -> StandInNode {
        let pushes = Arc::new(Mutex::new(Vec::new()));
        let seen = pushes.clone();
        let push = warp::put()
            .and(warp::path!("push" / String))
            .and(warp::header::headers_cloned())
            .and(warp::body::bytes())
            .map(move |_: String, headers: HeaderMap, _: bytes::Bytes| {
                let hold = headers
                    .get("x-autopush-durable-copy")
                    .is_some_and(|v| v == "hold");
                seen.lock().expect("lock").push(headers);
                answer(answers, hold)
            });
        let notif = warp::put()
            .and(warp::path!("notif" / String))
            .map(move |_: String| answer(answers, false));
        let routes = push.or(notif).unify().recover(|_: Rejection| async {
            Ok::<_, std::convert::Infallible>(StatusCode::NOT_FOUND.into_response())
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let url = format!("http://{}", listener.local_addr().expect("local_addr"));
        let server = tokio::spawn(warp::serve(routes).incoming(listener).run());
        StandInNode {
            url,
            pushes,
            server,
        }
    }

    /// The headers of every push it took.
    pub fn pushes(&self) -> Vec<HeaderMap> {
        self.pushes.lock().expect("lock").clone()
    }

    /// Stop answering, as a node killed after its answers.
    pub fn kill(&self) {
        self.server.abort();
    }
}

impl Drop for StandInNode {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A 200 as `answers` says, to a push that asked for a hold or not.
fn answer(answers: Answers, hold: bool) -> Response {
    let status_200 = || {
        warp::reply::with_status(
            warp::reply::json(&serde_json::json!({"status": 200})),
            StatusCode::OK,
        )
        .into_response()
    };
    let mut reply = match answers {
        Answers::AutopushRs => return StatusCode::OK.into_response(),
        _ => status_200(),
    };
    let headers = reply.headers_mut();
    let mut set = |name: &'static str, value: &'static str| {
        headers.insert(name, HeaderValue::from_static(value));
    };
    match answers {
        Answers::Protocol1 | Answers::AutopushRs => {}
        Answers::Protocol2 { fate } => {
            set("x-autopush-settles-durable-copy", "1");
            if hold {
                set("x-autopush-durable-copy", fate);
            }
        }
        Answers::Next { fate } => {
            // Not the version-2 header: what is ours is said by the version.
            set("x-autopush-router-api", "6");
            set("x-autopush-router-api-next", "a header of version 6");
            if hold {
                set("x-autopush-durable-copy", fate);
            }
        }
    }
    reply
}
