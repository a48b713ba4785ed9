//! An idle TLS connection on a public port holds none of its buffers, and
//! still works: a client that waited speaks again, renews its keys, and
//! closes cleanly.
//!
//! The heap is counted per thread: the server's connections live on a
//! runtime of their own thread, its clients on another.

use autopush_serving::tls::{Certificates, TlsFiles};
use rustls::pki_types::ServerName;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

mod support;
use support::{cert_file, client_config};

struct PerThread;

thread_local! {
    /// Bytes allocated less bytes freed by this thread.
    static HELD: Cell<isize> = const { Cell::new(0) };
}

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for PerThread {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = HELD.try_with(|held| held.set(held.get() + layout.size() as isize));
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let _ = HELD.try_with(|held| held.set(held.get() - layout.size() as isize));
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: PerThread = PerThread;

const CLIENTS: usize = 200;

/// A client's exchange with the echo server: `hello` out, `hello` back.
async fn exchange<S: AsyncReadExt + AsyncWriteExt + Unpin>(stream: &mut S, hello: &[u8]) {
    stream.write_all(hello).await.expect("a write");
    stream.flush().await.expect("a flush");
    let mut back = vec![0u8; hello.len()];
    stream.read_exact(&mut back).await.expect("the echo");
    assert_eq!(back, hello, "the echo differs");
}

/// Serve `CLIENTS` connections on their own thread, over TLS if `tls`,
/// echoing what each sends, with clients on `runtime`; returns the bytes the thread holds per idle
/// connection once every client has had its first echo, and the clients.
fn serve(
    tls: bool,
    runtime: &tokio::runtime::Runtime,
) -> (
    f64,
    Vec<tokio_rustls::client::TlsStream<TcpStream>>,
    Vec<TcpStream>,
) {
    let certs = Certificates::load(&TlsFiles {
        cert: cert_file("tls-127.0.0.1.pem"),
        key: cert_file("tls-127.0.0.1-key.pem"),
    })
    .expect("the test certificate");
    let acceptor = certs.acceptor(&[b"http/1.1"]);
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    std_listener.set_nonblocking(true).expect("nonblocking");
    let addr = std_listener.local_addr().expect("local addr");
    let (echoed_tx, echoed_rx) = std::sync::mpsc::channel::<()>();
    let (held_tx, held_rx) = std::sync::mpsc::channel::<isize>();
    let (go_tx, mut go_rx) = mpsc::unbounded_channel::<()>();
    // The server's thread; it runs for the rest of the test binary.
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async move {
            let listener = TcpListener::from_std(std_listener).expect("a listener");
            // Warm up the runtime's own allocations before the baseline.
            tokio::task::yield_now().await;
            let before = HELD.with(Cell::get);
            held_tx.send(before).expect("baseline");
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let (tcp, _) = accepted.expect("accept");
                        let acceptor = acceptor.clone();
                        let echoed = echoed_tx.clone();
                        tokio::spawn(async move {
                            if tls {
                                let stream = acceptor.accept(tcp).await.expect("a handshake");
                                echo(stream, echoed).await;
                            } else {
                                echo(tcp, echoed).await;
                            }
                        });
                    }
                    Some(()) = go_rx.recv() => {
                        // Let the connections settle, then say what is held.
                        tokio::task::yield_now().await;
                        held_tx.send(HELD.with(Cell::get)).expect("held");
                    }
                }
            }
        });
    });
    let before = held_rx.recv().expect("the baseline");
    let (tls_clients, plain_clients) = runtime.block_on(async {
        let config = client_config(rustls::DEFAULT_VERSIONS);
        let (mut tls_clients, mut plain_clients) = (Vec::new(), Vec::new());
        for _ in 0..CLIENTS {
            let tcp = TcpStream::connect(addr).await.expect("connect");
            if tls {
                let name = ServerName::IpAddress(addr.ip().into());
                let mut client = tokio_rustls::TlsConnector::from(config.clone())
                    .connect(name, tcp)
                    .await
                    .expect("a handshake");
                exchange(&mut client, b"hello").await;
                tls_clients.push(client);
            } else {
                let mut tcp = tcp;
                exchange(&mut tcp, b"hello").await;
                plain_clients.push(tcp);
            }
        }
        (tls_clients, plain_clients)
    });
    for _ in 0..CLIENTS {
        echoed_rx.recv().expect("an echo");
    }
    go_tx.send(()).expect("the server thread");
    let held = held_rx.recv().expect("what the server holds");
    (
        (held - before) as f64 / CLIENTS as f64,
        tls_clients,
        plain_clients,
    )
}

/// Echo what arrives until the client closes.
async fn echo<S: AsyncReadExt + AsyncWriteExt + Unpin>(
    mut stream: S,
    echoed: std::sync::mpsc::Sender<()>,
) {
    let mut first = true;
    loop {
        let mut buf = [0u8; 512];
        let n = match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if stream.write_all(&buf[..n]).await.is_err() || stream.flush().await.is_err() {
            break;
        }
        if first {
            first = false;
            let _ = echoed.send(());
        }
    }
    let _ = stream.shutdown().await;
}

#[test]
fn an_idle_tls_connection_holds_no_buffers_and_still_works() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("the clients' runtime");
    let (plain, _, plain_clients) = serve(false, &runtime);
    let (tls, mut tls_clients, _) = serve(true, &runtime);
    let extra = tls - plain;
    eprintln!(
        "heap per idle connection: {plain:.0} B plain, {tls:.0} B over TLS ({extra:.0} B more)"
    );
    // The stream and its traffic secrets, keys and IVs stay (about 0.4
    // KB); buffers (4 KiB for incoming records alone), rustls's connection
    // (2.3 KB) and its kernel connection (0.8 KB) do not.
    assert!(
        extra < 640.0,
        "an idle TLS connection holds {extra:.0} B more than a plain one: buffers or rustls's state kept"
    );
    drop(plain_clients);

    // After the wait, the clients speak again: large writes, a key update
    // (which the server answers with its own), and a clean close.
    runtime.block_on(async {
        for client in tls_clients.iter_mut().take(5) {
            exchange(client, b"ping").await;
            client
                .get_mut()
                .1
                .refresh_traffic_keys()
                .expect("a key update");
            exchange(client, &[7u8; 300]).await;
        }
        let mut client = tls_clients.pop().expect("a client");
        let big: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let mut back = vec![0u8; big.len()];
        let (mut reader, mut writer) = tokio::io::split(&mut client);
        let (written, read) = tokio::join!(
            async {
                writer.write_all(&big).await?;
                writer.flush().await
            },
            reader.read_exact(&mut back)
        );
        written.expect("a large write");
        read.expect("the large echo");
        assert!(back == big, "the large echo differs");
        assert!(support::close_cleanly(&mut client).await.is_empty());
    });
}
