//! Debian's nginx in front of the service, as `docs/examples/nginx.conf`
//! deploys it: TLS ends at nginx (the test certificate for 127.0.0.1, signed
//! by `certs/tls-ca.pem`), which proxies a public websocket port and a public
//! endpoint port to the service's plain ones on loopback.
//!
//! The site configuration is the documented file itself, with only its
//! placeholders (ports, certificate paths, read timeout) replaced, so the
//! docs cannot drift from what is tested. nginx runs as a child process of
//! the test (`master_process off`, everything in a temp dir) and is killed on
//! drop. Environment: `AUTOPUSH_TEST_NGINX` names the binary (default `nginx`
//! on `PATH`, then `/usr/sbin/nginx`); a missing one fails the test.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::server::free_ports;
use crate::{Server, cert_file, workspace_root};

/// How long nginx may take to listen.
const START_GUARD: Duration = Duration::from_secs(20);

/// The documented site configuration.
pub fn example_config_path() -> PathBuf {
    workspace_root()
        .join("docs")
        .join("examples")
        .join("nginx.conf")
}

/// The nginx binary.
fn nginx_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("AUTOPUSH_TEST_NGINX") {
        return PathBuf::from(p);
    }
    let on_path = std::env::var_os("PATH")
        .map(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("nginx"))
                .find(|p| p.is_file())
        })
        .unwrap_or_default();
    // Debian puts it in /usr/sbin, which a non-root PATH may lack.
    on_path.unwrap_or_else(|| PathBuf::from("/usr/sbin/nginx"))
}

/// nginx's two public ports, chosen before the service starts: its
/// `--endpoint-url` names one of them.
#[derive(Clone, Copy, Debug)]
pub struct PublicPorts {
    pub websocket: u16,
    pub endpoint: u16,
}

impl PublicPorts {
    /// Two free loopback ports.
    pub fn pick() -> PublicPorts {
        let [websocket, endpoint] = free_ports::<2>();
        PublicPorts {
            websocket,
            endpoint,
        }
    }

    /// `wss://127.0.0.1:P/`: what user agents connect to.
    pub fn wss_url(&self) -> String {
        format!("wss://127.0.0.1:{}/", self.websocket)
    }

    /// `https://127.0.0.1:E`: the service's `--endpoint-url`.
    pub fn endpoint_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.endpoint)
    }
}

/// A running nginx in front of one [`Server`]. Killed on drop.
pub struct Nginx {
    child: Child,
    dir: TempDir,
    pub ports: PublicPorts,
}

impl Nginx {
    /// Start nginx on `ports` in front of `server`, closing a proxied
    /// connection on which the service sent nothing for `read_timeout`
    /// seconds (`proxy_read_timeout`).
    pub fn start(ports: PublicPorts, server: &Server, read_timeout: u64) -> Nginx {
        let dir = tempfile::Builder::new()
            .prefix("autopush-nginx-")
            .tempdir()
            .expect("temp dir");
        let site = site_config(ports, server, read_timeout);
        std::fs::write(dir.path().join("autopush.conf"), site).expect("write the site config");
        let conf = dir.path().join("nginx.conf");
        std::fs::write(&conf, main_config(dir.path())).expect("write nginx.conf");
        let error_log = dir.path().join("error.log");
        let child = Command::new(nginx_bin())
            .arg("-c")
            .arg(&conf)
            .arg("-p")
            .arg(dir.path())
            .arg("-e")
            .arg(&error_log)
            .args(["-g", "daemon off;"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "could not run {} ({e}): install Debian's nginx (apt-get install nginx) \
                     or set AUTOPUSH_TEST_NGINX",
                    nginx_bin().display()
                )
            });
        let mut nginx = Nginx { child, dir, ports };
        let log = nginx.dir.path().join("error.log");
        wait_listening("nginx", &mut nginx.child, &nginx.ports, &log);
        nginx
    }

    /// `wss://127.0.0.1:P/`.
    pub fn wss_url(&self) -> String {
        self.ports.wss_url()
    }

    /// `https://127.0.0.1:E`.
    pub fn endpoint_url(&self) -> String {
        self.ports.endpoint_url()
    }

    /// nginx's error log so far.
    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- nginx error log ---\n{}", self.error_log());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `docs/examples/nginx.conf` with its placeholders replaced: each must be
/// there, so a change to the example that the test would no longer cover
/// fails here.
fn site_config(ports: PublicPorts, server: &Server, read_timeout: u64) -> String {
    let path = example_config_path();
    let mut text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let cert = cert_file("tls-127.0.0.1.pem").display().to_string();
    let key = cert_file("tls-127.0.0.1-key.pem").display().to_string();
    let upstream = |base: String| format!("proxy_pass {base};");
    // The websocket server comes first in the file: each `listen` is
    // replaced once, in order.
    let replacements = [
        (
            "listen 443 ssl;",
            format!("listen 127.0.0.1:{} ssl;", ports.websocket),
        ),
        (
            "listen 443 ssl;",
            format!("listen 127.0.0.1:{} ssl;", ports.endpoint),
        ),
        (
            "/etc/letsencrypt/live/push.example.com/fullchain.pem",
            cert.clone(),
        ),
        (
            "/etc/letsencrypt/live/push.example.com/privkey.pem",
            key.clone(),
        ),
        (
            "/etc/letsencrypt/live/updates.example.com/fullchain.pem",
            cert,
        ),
        ("/etc/letsencrypt/live/updates.example.com/privkey.pem", key),
        (
            "proxy_pass http://127.0.0.1:8080;",
            upstream(server.ws_http_base()),
        ),
        (
            "proxy_pass http://127.0.0.1:8082;",
            upstream(server.endpoint_base()),
        ),
        (
            "proxy_read_timeout 330s;",
            format!("proxy_read_timeout {read_timeout}s;"),
        ),
    ];
    for (placeholder, value) in replacements {
        assert!(
            text.contains(placeholder),
            "{} no longer contains {placeholder:?}, which the test replaces",
            path.display()
        );
        text = text.replacen(placeholder, &value, 1);
    }
    text
}

/// The main configuration around the site: one process running as the
/// test's user, every file it writes inside `dir`.
fn main_config(dir: &std::path::Path) -> String {
    let dir = dir.display();
    format!(
        "master_process off;\n\
         pid {dir}/nginx.pid;\n\
         error_log {dir}/error.log info;\n\
         events {{ worker_connections 256; }}\n\
         http {{\n\
         \x20   access_log {dir}/access.log;\n\
         \x20   client_body_temp_path {dir}/client_body;\n\
         \x20   proxy_temp_path {dir}/proxy;\n\
         \x20   fastcgi_temp_path {dir}/fastcgi;\n\
         \x20   uwsgi_temp_path {dir}/uwsgi;\n\
         \x20   scgi_temp_path {dir}/scgi;\n\
         \x20   include {dir}/autopush.conf;\n\
         }}\n"
    )
}

/// Wait until the proxy `name` (a child process) listens on both public
/// `ports`; fail with its log file `log` if it exits first or takes too long.
pub(crate) fn wait_listening(name: &str, child: &mut Child, ports: &PublicPorts, log: &Path) {
    let log = || std::fs::read_to_string(log).unwrap_or_default();
    let deadline = Instant::now() + START_GUARD;
    for port in [ports.websocket, ports.endpoint] {
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "{name} exited ({status}) before listening; its log:\n{}",
                    log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{name} did not listen on 127.0.0.1:{port} within {START_GUARD:?}; its log:\n{}",
                log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
