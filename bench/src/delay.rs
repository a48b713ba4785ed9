//! A latency stand-in: a TCP proxy that holds every chunk it reads for half
//! a round trip (plus optional jitter) before it writes it on, in each
//! direction. The kernel's netem is not available everywhere (not here), so
//! the bench puts this in front of a port to play a client or a sender that
//! is a real network away.
//!
//! Each chunk is stamped when it is read and written when its time comes,
//! so the proxy adds delay without limiting bandwidth: the next chunk is
//! read while the last one waits. Bytes keep their order in each direction
//! (a later chunk never leaves before an earlier one, whatever its jitter),
//! and a half-close is passed on after the same delay.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How long each direction holds a chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Latency {
    /// The round trip: each direction holds a chunk for half of it.
    pub rtt: Duration,
    /// Up to this much more, at random, for each chunk.
    pub jitter: Duration,
}

impl Latency {
    pub fn rtt(rtt: Duration) -> Latency {
        Latency {
            rtt,
            jitter: Duration::ZERO,
        }
    }

    pub fn is_zero(&self) -> bool {
        self.rtt.is_zero() && self.jitter.is_zero()
    }
}

/// A running proxy; stops (with every connection it carries) when dropped.
pub struct DelayProxy {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl DelayProxy {
    /// Listen on `listen` (port 0: any free one) and carry each connection
    /// to `upstream` with `latency` each way.
    pub async fn start(
        listen: SocketAddr,
        upstream: SocketAddr,
        latency: Latency,
    ) -> std::io::Result<DelayProxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(serve(listener, upstream, latency));
        Ok(DelayProxy { addr, task })
    }

    /// A proxy on a free loopback port in front of the `host:port` of `url`
    /// (`ws://`, `http://`), and `url` with its authority replaced by the
    /// proxy's.
    pub async fn in_front_of(url: &str, latency: Latency) -> (DelayProxy, String) {
        let (scheme, rest) = url.split_once("://").unwrap_or(("http", url));
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let upstream: SocketAddr = authority
            .parse()
            .unwrap_or_else(|e| panic!("{url}: not an IP:PORT URL: {e}"));
        let proxy = DelayProxy::start(([127, 0, 0, 1], 0).into(), upstream, latency)
            .await
            .expect("bind the latency stand-in");
        let proxied = format!("{scheme}://{}{path}", proxy.addr);
        (proxy, proxied)
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Accept until dropped; each connection lives in its own tasks, which end
/// with it (or when the runtime ends).
pub async fn serve(listener: TcpListener, upstream: SocketAddr, latency: Latency) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let Ok((client, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        connections.spawn(async move {
            if let Ok(server) = connect_from(peer, upstream).await {
                carry(client, server, latency, seed(peer)).await;
            }
        });
        // Forget connections that have ended.
        while connections.try_join_next().is_some() {}
    }
}

/// Connect to `upstream`, from the client's own loopback address when it
/// has one: load generators spread tens of thousands of clients over
/// 127.0.0.2, .3, ... so that no one address runs out of ephemeral ports.
async fn connect_from(peer: SocketAddr, upstream: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = match upstream {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    if peer.ip().is_loopback() && peer.is_ipv4() == upstream.is_ipv4() {
        socket.bind(SocketAddr::new(peer.ip(), 0))?;
    }
    let stream = socket.connect(upstream).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Carry bytes both ways between `client` and `server` until both
/// directions have ended.
async fn carry(client: TcpStream, server: TcpStream, latency: Latency, seed: u64) {
    let _ = client.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let half = latency.rtt / 2;
    let upstream = one_way(client_read, server_write, half, latency.jitter, seed);
    let downstream = one_way(server_read, client_write, half, latency.jitter, !seed);
    tokio::join!(upstream, downstream);
}

/// One direction: a reader that stamps each chunk with the time it may
/// leave, and a writer that sends it then. `None` is the end of the stream.
async fn one_way(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    delay: Duration,
    jitter: Duration,
    seed: u64,
) {
    let (queue, mut due) = mpsc::unbounded_channel::<(Instant, Option<Bytes>)>();
    let reader = async move {
        let mut random = XorShift(seed | 1);
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            let read = from.read(&mut buffer).await;
            let when = Instant::now() + delay + random.below(jitter);
            let chunk = match read {
                Ok(n) if n > 0 => Some(Bytes::copy_from_slice(&buffer[..n])),
                _ => None,
            };
            let end = chunk.is_none();
            if queue.send((when, chunk)).is_err() || end {
                return;
            }
        }
    };
    // One writer, in the order read: a chunk whose jitter is shorter than
    // the one ahead of it leaves right after that one.
    let writer = async move {
        while let Some((when, chunk)) = due.recv().await {
            tokio::time::sleep_until(when).await;
            match chunk {
                Some(bytes) => {
                    if to.write_all(&bytes).await.is_err() {
                        return;
                    }
                }
                None => {
                    let _ = to.shutdown().await;
                    return;
                }
            }
        }
    };
    tokio::join!(reader, writer);
}

/// A per-connection seed for the jitter (nothing here needs good randomness).
fn seed(peer: SocketAddr) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    now ^ (u64::from(peer.port()) << 32)
}

struct XorShift(u64);

impl XorShift {
    /// A duration in `[0, limit]`.
    fn below(&mut self, limit: Duration) -> Duration {
        if limit.is_zero() {
            return Duration::ZERO;
        }
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let nanos = limit.as_nanos() as u64;
        Duration::from_nanos(self.0 % (nanos + 1))
    }
}

/// A duration as written on the command line: `100ms`, `1.5s`, `250us`, or
/// `0`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if text == "0" {
        (text, 0.0)
    } else {
        return Err(format!("{text:?}: a duration is like 100ms, 1.5s or 0"));
    };
    match number.trim().parse::<f64>() {
        Ok(n) if n >= 0.0 && n.is_finite() => Ok(Duration::from_secs_f64(n * scale)),
        _ => Err(format!("{text:?}: a duration is like 100ms, 1.5s or 0")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server: what comes in goes back out, until the peer closes.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut read, mut write) = socket.split();
                    let _ = tokio::io::copy(&mut read, &mut write).await;
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn each_round_trip_takes_at_least_the_set_time_and_bytes_keep_their_order() {
        let rtt = Duration::from_millis(60);
        let latency = Latency {
            rtt,
            jitter: Duration::from_millis(20),
        };
        let proxy = DelayProxy::start(([127, 0, 0, 1], 0).into(), echo().await, latency)
            .await
            .unwrap();
        let socket = TcpStream::connect(proxy.addr).await.unwrap();
        socket.set_nodelay(true).unwrap();
        // Many small writes a little apart (so the proxy reads each on its
        // own, with its own jitter): any reordering shows up in the bytes
        // read back.
        let sent: Vec<u8> = (0..1000u32).flat_map(|i| i.to_be_bytes()).collect();
        let started = Instant::now();
        let (mut read, mut write) = socket.into_split();
        let chunks: Vec<Vec<u8>> = sent.chunks(40).map(<[u8]>::to_vec).collect();
        let writer = tokio::spawn(async move {
            for chunk in chunks {
                write.write_all(&chunk).await.unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            write
        });
        let mut first = [0u8; 4];
        let echoed = tokio::time::timeout(Duration::from_secs(15), async {
            read.read_exact(&mut first).await.unwrap();
            let first_back = started.elapsed();
            let mut rest = vec![0u8; sent.len() - 4];
            read.read_exact(&mut rest).await.unwrap();
            (first_back, [first.to_vec(), rest].concat())
        })
        .await
        .expect("the echo came back within the hang guard");
        let (first_back, echoed) = echoed;
        assert!(
            first_back >= rtt,
            "the first bytes came back after {first_back:?}, under the round trip of {rtt:?}"
        );
        assert!(echoed == sent, "the bytes came back out of order");

        // A half-close reaches the far end (after its delay) and comes back.
        let mut write = writer.await.unwrap();
        write.shutdown().await.unwrap();
        let mut tail = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(15), read.read_to_end(&mut tail))
            .await
            .expect("the close came back within the hang guard")
            .unwrap();
        assert_eq!(n, 0, "nothing after the echo");
    }

    #[test]
    fn durations_read_as_written() {
        assert_eq!(parse_duration("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert!(parse_duration("100").is_err());
        assert!(parse_duration("-1ms").is_err());
    }
}
