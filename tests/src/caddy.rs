//! Debian's Caddy in front of the service, as `docs/examples/Caddyfile`
//! deploys it, with the test certificate for 127.0.0.1 in place of the
//! certificates Caddy would get itself. Like [`crate::nginx`]: the documented
//! file with its placeholders replaced (each must be there), a child process
//! of the test with everything in a temp dir, killed on drop. Environment:
//! `AUTOPUSH_TEST_CADDY` names the binary (default `caddy` on `PATH`); a
//! missing one fails the test.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use tempfile::TempDir;

use crate::nginx::PublicPorts;
use crate::{Server, cert_file, workspace_root};

/// A running Caddy in front of one [`Server`]. Killed on drop.
pub struct Caddy {
    child: Child,
    dir: TempDir,
    pub ports: PublicPorts,
}

impl Caddy {
    /// Start Caddy on `ports` in front of `server`.
    pub fn start(ports: PublicPorts, server: &Server) -> Caddy {
        let dir = tempfile::Builder::new()
            .prefix("autopush-caddy-")
            .tempdir()
            .expect("temp dir");
        let config = dir.path().join("Caddyfile");
        std::fs::write(&config, caddyfile(ports, server, dir.path())).expect("write Caddyfile");
        let log = std::fs::File::create(dir.path().join("caddy.log")).expect("create caddy.log");
        let bin = std::env::var_os("AUTOPUSH_TEST_CADDY").unwrap_or_else(|| "caddy".into());
        let child = Command::new(&bin)
            .arg("run")
            .arg("--config")
            .arg(&config)
            .args(["--adapter", "caddyfile"])
            // Its autosaved config and data stay in the temp dir.
            .env("HOME", dir.path())
            .env("XDG_CONFIG_HOME", dir.path())
            .env("XDG_DATA_HOME", dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup caddy.log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "could not run {} ({e}): install Debian's caddy (apt-get install caddy) \
                     or set AUTOPUSH_TEST_CADDY",
                    PathBuf::from(&bin).display()
                )
            });
        let mut caddy = Caddy { child, dir, ports };
        let log = caddy.dir.path().join("caddy.log");
        crate::nginx::wait_listening("caddy", &mut caddy.child, &caddy.ports, &log);
        caddy
    }

    /// Caddy's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("caddy.log")).unwrap_or_default()
    }
}

impl Drop for Caddy {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- caddy log ---\n{}", self.log());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `docs/examples/Caddyfile` with its sites on `ports` and the test
/// certificate, behind global options that keep Caddy to the temp dir `dir`
/// (no admin port, no port-80 redirects, no system trust store).
fn caddyfile(ports: PublicPorts, server: &Server, dir: &Path) -> String {
    let path = workspace_root()
        .join("docs")
        .join("examples")
        .join("Caddyfile");
    let mut text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let tls = format!(
        "tls {} {}",
        cert_file("tls-127.0.0.1.pem").display(),
        cert_file("tls-127.0.0.1-key.pem").display()
    );
    let upstream = |base: String| format!("reverse_proxy {}", base.trim_start_matches("http://"));
    let replacements = [
        (
            "push.example.com {",
            format!("https://127.0.0.1:{} {{\n\t{tls}", ports.websocket),
        ),
        (
            "updates.example.com {",
            format!("https://127.0.0.1:{} {{\n\t{tls}", ports.endpoint),
        ),
        (
            "reverse_proxy 127.0.0.1:8080",
            upstream(server.ws_http_base()),
        ),
        (
            "reverse_proxy 127.0.0.1:8082",
            upstream(server.endpoint_base()),
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
    format!(
        "{{\n\tadmin off\n\tauto_https disable_redirects\n\tskip_install_trust\n\
         \tstorage file_system {}\n}}\n\n{text}",
        dir.join("data").display()
    )
}
