//! A TCP relay that a test can cut off: in front of a node's router API,
//! it stands for a node stalled past its callers' timeouts (a VM paused, a
//! runtime starved) that never sees what was sent meanwhile, which a
//! process merely paused would read, in part or whole, once resumed. Or
//! muted: the node gets every call and its answers are lost on the way.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// See the module's notes.
pub struct CutOffRelay {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    accepting: JoinHandle<()>,
}

#[derive(Default)]
struct State {
    /// Where connections go; `None`: cut off.
    target: Option<SocketAddr>,
    /// Whether the answers are dropped.
    muted: bool,
    /// The connections being relayed, ended at the cut.
    relays: Vec<JoinHandle<()>>,
}

impl CutOffRelay {
    /// A relay on a free loopback port, cut off until [`CutOffRelay::forward_to`].
    pub async fn start() -> CutOffRelay {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local_addr");
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let accepting = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let mut state = shared.lock().expect("relay state");
                let relay = match (state.target, state.muted) {
                    (Some(target), false) => tokio::spawn(relay(stream, target)),
                    (Some(target), true) => tokio::spawn(relay_muted(stream, target)),
                    (None, _) => tokio::spawn(swallow(stream)),
                };
                state.relays.retain(|r| !r.is_finished());
                state.relays.push(relay);
            }
        });
        CutOffRelay {
            addr,
            state,
            accepting,
        }
    }

    /// `http://` and the relay's address.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Relay new connections to `target`.
    pub fn forward_to(&self, target: SocketAddr) {
        let mut state = self.state.lock().expect("relay state");
        state.target = Some(target);
        state.muted = false;
    }

    /// End every relayed connection, and take new ones without relaying
    /// anything they carry or ever answering.
    pub fn cut(&self) {
        self.set(None, false);
    }

    /// End every relayed connection, and relay new ones to `target` one
    /// way only: what the node answers is dropped.
    pub fn mute(&self, target: SocketAddr) {
        self.set(Some(target), true);
    }

    fn set(&self, target: Option<SocketAddr>, muted: bool) {
        let mut state = self.state.lock().expect("relay state");
        (state.target, state.muted) = (target, muted);
        for relay in state.relays.drain(..) {
            relay.abort();
        }
    }
}

impl Drop for CutOffRelay {
    fn drop(&mut self) {
        self.accepting.abort();
        self.cut();
    }
}

async fn relay(mut client: TcpStream, target: SocketAddr) {
    if let Ok(mut server) = TcpStream::connect(target).await {
        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
    }
}

/// Relay what `client` sends to `target`, and drop what comes back.
async fn relay_muted(client: TcpStream, target: SocketAddr) {
    let Ok(server) = TcpStream::connect(target).await else {
        return;
    };
    let (mut from_client, _to_client) = client.into_split();
    let (from_server, mut to_server) = server.into_split();
    let forward = async {
        let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
        let _ = to_server.shutdown().await;
    };
    tokio::join!(forward, swallow(from_server));
}

/// Read and drop what `stream` carries, until its peer hangs up.
async fn swallow(mut stream: impl AsyncRead + Unpin) {
    let mut buf = [0u8; 4096];
    while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
}
