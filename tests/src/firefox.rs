//! A real, headless Firefox (Debian's `firefox-esr`) against the service,
//! driven through `tests/firefox/drive.py` (marionette_driver from PyPI).
//!
//! The driver is one long-lived Python process: this side writes one JSON
//! command per line to its stdin and reads one JSON answer per line from its
//! stdout (see the script's docstring for the commands). The script also
//! serves the test page and service worker on a loopback port and records
//! what the service worker reports.
//!
//! Environment: `AUTOPUSH_TEST_FIREFOX` names the Firefox binary (default
//! `firefox-esr` on `PATH`, then `firefox`). A missing or broken Firefox fails
//! the test; it never skips.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::py::python;

/// Hang guard for one driver command (Firefox start-up included).
pub const COMMAND_GUARD: Duration = Duration::from_secs(120);

/// The path of `drive.py`.
pub fn driver_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("firefox")
        .join("drive.py")
}

/// A running `drive.py` and the Firefox it controls. Dropping it kills both;
/// dropping it during a panic also prints the driver's and Firefox's logs.
pub struct Firefox {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Lines<BufReader<ChildStdout>>,
    work: TempDir,
    /// The page's origin, `http://127.0.0.1:P/`, where the service worker lives.
    pub page_url: String,
    /// The pid of the running Firefox, if any (killed on drop).
    pid: Option<u32>,
}

impl Firefox {
    /// Start the driver for a push service at a `ws://` URL, which Firefox
    /// takes with `dom.push.testing.allowInsecureServerURL` (Firefox itself
    /// starts with [`Firefox::start`]).
    pub async fn launch(ws_url: &str) -> Firefox {
        Firefox::launch_driver(ws_url, None).await
    }

    /// Start the driver for a push service at a `wss://` URL, as a real
    /// deployment's, whose certificate the CA in the PEM file `ca` signed:
    /// NSS's `certutil` imports it into the profile (Debian's
    /// libnss3-tools) before Firefox first starts.
    pub async fn launch_with_ca(wss_url: &str, ca: &Path) -> Firefox {
        Firefox::launch_driver(wss_url, Some(ca)).await
    }

    async fn launch_driver(ws_url: &str, ca: Option<&Path>) -> Firefox {
        let work = tempfile::Builder::new()
            .prefix("autopush-firefox-")
            .tempdir()
            .expect("temp dir");
        let stderr =
            std::fs::File::create(work.path().join("drive.stderr.log")).expect("create driver log");
        let mut cmd = tokio::process::Command::new(python());
        cmd.arg(driver_path())
            .arg(format!("--ws-url={ws_url}"))
            .arg(format!("--work-dir={}", work.path().join("ff").display()))
            .args(ca.map(|ca| format!("--ca-file={}", ca.display())))
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true);
        let mut child = cmd.spawn().unwrap_or_else(|e| {
            panic!(
                "could not run {} {} (run scripts/test --setup-python): {e}",
                python().display(),
                driver_path().display()
            )
        });
        let stdin = child.stdin.take().expect("driver stdin");
        let stdout = BufReader::new(child.stdout.take().expect("driver stdout")).lines();
        let mut ff = Firefox {
            child,
            stdin: Some(stdin),
            stdout,
            work,
            page_url: String::new(),
            pid: None,
        };
        let hello = ff.read_answer("launch").await;
        ff.page_url = hello["page"].as_str().unwrap_or_default().to_string();
        ff
    }

    /// Send one command and return its answer; panics (with the driver's and
    /// Firefox's logs) when it fails or hangs.
    pub async fn call(&mut self, cmd: Value) -> Value {
        let name = cmd["cmd"].as_str().unwrap_or("?").to_string();
        let stdin = self.stdin.as_mut().expect("driver stdin already closed");
        let line = format!("{cmd}\n");
        if let Err(e) = stdin.write_all(line.as_bytes()).await {
            panic!("writing {name:?} to the Firefox driver: {e} (its logs follow)");
        }
        stdin.flush().await.expect("flush driver stdin");
        self.read_answer(&name).await
    }

    async fn read_answer(&mut self, what: &str) -> Value {
        let line = match tokio::time::timeout(COMMAND_GUARD, self.stdout.next_line()).await {
            Ok(Ok(Some(line))) => line,
            Ok(Ok(None)) => {
                let status = self.child.try_wait().ok().flatten();
                panic!("the Firefox driver exited during {what:?} ({status:?}); its logs follow")
            }
            Ok(Err(e)) => panic!("reading the Firefox driver's answer to {what:?}: {e}"),
            Err(_) => panic!(
                "the Firefox driver did not answer {what:?} within {COMMAND_GUARD:?}; \
                 its logs follow"
            ),
        };
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| {
            panic!("the Firefox driver answered {what:?} with non-JSON ({e}): {line}")
        });
        if v["ok"] != true {
            panic!(
                "Firefox driver command {what:?} failed (logs follow):\n{}",
                v["error"].as_str().unwrap_or(&line)
            );
        }
        v
    }

    /// Launch Firefox (the same profile every time) and open a Marionette session.
    pub async fn start(&mut self) -> Value {
        let v = self.call(json!({"cmd": "start"})).await;
        self.pid = v["pid"].as_u64().map(|p| p as u32);
        v
    }

    /// Make Firefox's push service start and wait for its UAID (set from the
    /// server's hello reply). Returns the UAID.
    pub async fn ready(&mut self) -> String {
        self.ready_with_prefs().await.0
    }

    /// [`Firefox::ready`], and the push prefs Firefox runs with
    /// (`serverURL`, `allowInsecureServerURL`).
    pub async fn ready_with_prefs(&mut self) -> (String, Value) {
        let v = self.call(json!({"cmd": "ready", "timeout": 60})).await;
        let uaid = v["uaid"]
            .as_str()
            .unwrap_or_else(|| panic!("no uaid in {v}"))
            .to_string();
        (uaid, v["prefs"].clone())
    }

    /// Open the page, register the service worker and subscribe with this
    /// `applicationServerKey`. Returns `PushSubscription.toJSON()`.
    pub async fn subscribe(&mut self, application_server_key: &str) -> Value {
        let v = self
            .call(json!({"cmd": "subscribe", "key": application_server_key}))
            .await;
        v["subscription"].clone()
    }

    /// Open the page and unsubscribe; returns the driver's answer
    /// (`unsubscribed`, `endpoint`, `after`).
    pub async fn unsubscribe(&mut self) -> Value {
        self.call(json!({"cmd": "unsubscribe"})).await
    }

    /// Every event the service worker reported so far, once there are at
    /// least `count` (or after `wait`, with fewer).
    pub async fn events(&mut self, count: usize, wait: Duration) -> Vec<Value> {
        let v = self
            .call(json!({"cmd": "log", "count": count, "timeout": wait.as_secs_f64()}))
            .await;
        v["events"].as_array().cloned().unwrap_or_default()
    }

    /// Quit Firefox from inside (a normal shutdown), and wait until it is gone.
    pub async fn quit(&mut self) -> Value {
        let v = self.call(json!({"cmd": "quit"})).await;
        self.pid = None;
        v
    }

    /// Quit Firefox if running and end the driver.
    pub async fn exit(mut self) {
        self.call(json!({"cmd": "exit"})).await;
        self.pid = None;
        self.stdin = None;
        let _ = tokio::time::timeout(COMMAND_GUARD, self.child.wait()).await;
    }

    /// The driver's stderr and the gecko log, tails.
    pub fn logs(&self) -> String {
        let tail = |path: PathBuf, n: usize| {
            let s = std::fs::read_to_string(&path).unwrap_or_default();
            let start = s.len().saturating_sub(n);
            let start = (start..s.len())
                .find(|i| s.is_char_boundary(*i))
                .unwrap_or(0);
            format!("--- {} (tail) ---\n{}", path.display(), &s[start..])
        };
        format!(
            "{}\n{}",
            tail(self.work.path().join("drive.stderr.log"), 6000),
            tail(self.work.path().join("ff").join("gecko.log"), 6000)
        )
    }
}

impl Drop for Firefox {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
        // The driver dies with the test (kill_on_drop); Firefox is its
        // grandchild, so kill it by pid.
        if let Some(pid) = self.pid.take() {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}
