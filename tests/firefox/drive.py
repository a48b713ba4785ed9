#!/usr/bin/env python3
"""Drive a real, headless Firefox against the push service, for tests/tests/firefox.rs.

The Rust test starts the push service and this script, then sends it one JSON
command per line on stdin; the script answers each with exactly one JSON line
on stdout: {"ok": true, ...} or {"ok": false, "error": "..."}. Everything else
(marionette_driver's logging, tracebacks) goes to stderr; Firefox's own output
goes to a gecko log file in --work-dir.

The script also runs a small loopback HTTP server that serves the page and the
service worker (sw.js beside this file) and records what the service worker
POSTs to /log (the plaintext of each push event).

Commands ("cmd" field):
  start         launch Firefox (the same profile every time) and open a
                Marionette session; answers {pid, version}
  ready         make the push service start, wait until Firefox has its UAID
                from the server's hello reply; answers {uaid, prefs} (prefs:
                the serverURL and allowInsecureServerURL Firefox runs with)
  subscribe     {"key": applicationServerKey} open the page, register the
                service worker, subscribe; answers {subscription: toJSON()}
  unsubscribe   open the page, unsubscribe the current subscription;
                answers {unsubscribed: bool, endpoint}
  log           {"count": N, "timeout": S} wait until the service worker has
                reported N events in all; answers {events: [...]} (all of them)
  quit          quit Firefox from inside (a normal shutdown); answers {returncode}
  exit          quit Firefox if running, stop the HTTP server, exit
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.dirname(os.path.abspath(__file__))

# The protocol channel; marionette_driver and mozrunner may print, so
# sys.stdout is pointed at stderr below.
PROTO_OUT = sys.stdout


def closed_network_prefs(ws_url: str, marionette_port: int) -> dict:
    """Profile prefs: push against ws_url, and nothing else reaching out."""
    prefs = {
        # The push service under test (see README "Use it with Firefox").
        "dom.push.enabled": True,
        "dom.push.serverURL": ws_url,
        # marionette_driver's required prefs turn the connection off.
        "dom.push.connection.enabled": True,
        # No permission prompt for subscribe(), no notification-permission
        # check for delivery.
        "dom.push.testing.ignorePermission": True,
        # Pushes that show no notification use up a quota (default 16).
        "dom.push.maxQuotaPerSubscription": 1000,
        "dom.push.loglevel": "Debug",
        "dom.serviceWorkers.enabled": True,
        "dom.serviceWorkers.testing.enabled": True,
        "marionette.port": marionette_port,
        # Service worker and push logging into the gecko log.
        "devtools.console.stdout.chrome": True,
        "devtools.console.stdout.content": True,
        "browser.dom.window.dump.enabled": True,
        # A closed network: no proxy, no DoH, no prefetching, no background
        # services that phone home.
        "network.proxy.type": 0,
        "network.trr.mode": 5,
        "network.dns.disablePrefetch": True,
        "network.prefetch-next": False,
        "network.http.speculative-parallel-limit": 0,
        "browser.places.speculativeConnect.enabled": False,
        "network.captive-portal-service.enabled": False,
        "network.connectivity-service.enabled": False,
        "network.manage-offline-status": False,
        "app.update.disabledForTesting": True,
        "app.update.auto": False,
        "app.update.checkInstallTime": False,
        "app.normandy.enabled": False,
        "app.normandy.api_url": "",
        "app.shield.optoutstudies.enabled": False,
        "messaging-system.rsexperimentloader.enabled": False,
        "browser.region.network.url": "",
        "browser.region.update.enabled": False,
        "browser.safebrowsing.malware.enabled": False,
        "browser.safebrowsing.phishing.enabled": False,
        "browser.safebrowsing.blockedURIs.enabled": False,
        "browser.safebrowsing.downloads.enabled": False,
        "browser.safebrowsing.downloads.remote.enabled": False,
        "browser.safebrowsing.update.enabled": False,
        "browser.safebrowsing.provider.google.updateURL": "",
        "browser.safebrowsing.provider.google4.updateURL": "",
        "browser.safebrowsing.provider.mozilla.updateURL": "",
        "toolkit.telemetry.enabled": False,
        "toolkit.telemetry.unified": False,
        "toolkit.telemetry.archive.enabled": False,
        "datareporting.healthreport.uploadEnabled": False,
        "datareporting.policy.dataSubmissionEnabled": False,
        "browser.ping-centre.telemetry": False,
        "browser.newtabpage.enabled": False,
        "browser.newtabpage.activity-stream.feeds.telemetry": False,
        "browser.newtabpage.activity-stream.telemetry": False,
        "browser.search.update": False,
        "extensions.update.enabled": False,
        "extensions.blocklist.enabled": False,
        "extensions.getAddons.cache.enabled": False,
        "media.gmp-manager.updateEnabled": False,
        "media.gmp-manager.url": "",
        "media.gmp-gmpopenh264.enabled": False,
        "geo.provider.network.url": "",
        "identity.fxaccounts.enabled": False,
        "services.settings.server": "data:,#remote-settings-dummy/v1",
        "security.OCSP.enabled": 0,
        "security.remote_settings.crlite_filters.enabled": False,
        "browser.startup.page": 0,
        "browser.startup.homepage": "about:blank",
        "browser.sessionstore.resume_from_crash": False,
        "browser.shell.checkDefaultBrowser": False,
        "toolkit.startup.max_resumed_crashes": -1,
    }
    # Only a ws:// URL needs the testing pref; a wss:// one is used as a
    # real deployment's is.
    if ws_url.startswith("ws://"):
        prefs["dom.push.testing.allowInsecureServerURL"] = True
    return prefs


# ---------------------------------------------------------------- HTTP server


class Events:
    """What the service worker reported, in arrival order."""

    def __init__(self):
        self._cond = threading.Condition()
        self._events = []

    def add(self, event):
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def wait(self, count: int, timeout: float) -> list:
        with self._cond:
            self._cond.wait_for(lambda: len(self._events) >= count, timeout)
            return list(self._events)


PAGE = b"""<!doctype html>
<meta charset="utf-8">
<title>autopush interop</title>
<p>autopush interop test page</p>
"""


def make_handler(events: Events):
    with open(os.path.join(HERE, "sw.js"), "rb") as f:
        sw_js = f.read()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status, ctype, body):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path in ("/", "/index.html"):
                self._reply(200, "text/html; charset=utf-8", PAGE)
            elif self.path == "/sw.js":
                self._reply(200, "text/javascript; charset=utf-8", sw_js)
            else:
                self._reply(404, "text/plain", b"not found")

        def do_POST(self):
            if self.path != "/log":
                self._reply(404, "text/plain", b"not found")
                return
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                event = json.loads(raw)
            except ValueError:
                event = {"kind": "unparsable", "raw": raw.decode("utf-8", "replace")}
            event["received_at"] = time.time()
            print(f"drive.py: service worker reported {event}", file=sys.stderr)
            events.add(event)
            self._reply(204, "text/plain", b"")

        def log_message(self, fmt, *args):
            sys.stderr.write("drive.py http: " + (fmt % args) + "\n")

    return Handler


# ---------------------------------------------------------------- Firefox


def find_firefox(explicit: str | None) -> str:
    """--firefox, else $AUTOPUSH_TEST_FIREFOX, else firefox-esr or firefox on PATH."""
    wanted = explicit or os.environ.get("AUTOPUSH_TEST_FIREFOX")
    candidates = [wanted] if wanted else ["firefox-esr", "firefox"]
    for candidate in candidates:
        path = shutil.which(candidate)
        if path:
            # /usr/bin/firefox-esr is a symlink to the real binary in
            # /usr/lib/firefox-esr, next to application.ini.
            return os.path.realpath(path)
    raise RuntimeError(
        f"Firefox not found (looked for {' or '.join(candidates)}): install Debian's "
        "firefox-esr (apt-get install -y firefox-esr) or set AUTOPUSH_TEST_FIREFOX"
    )


# Chrome context. Firefox starts its push service late in start-up (an idle
# task) and a subscribe() made before the service's hello can be dropped, so
# the test calls ensureReady() and waits for dom.push.userAgentID, which the
# hello reply sets, before the page subscribes.
CHROME_ENSURE_READY = """
const svc = Cc["@mozilla.org/push/Service;1"]
  .getService(Ci.nsIPushService).wrappedJSObject;
svc.ensureReady();
return Services.prefs.getStringPref("dom.push.userAgentID", "");
"""

CHROME_PUSH_PREFS = """
return {
  serverURL: Services.prefs.getStringPref("dom.push.serverURL", ""),
  allowInsecureServerURL: Services.prefs.getBoolPref(
    "dom.push.testing.allowInsecureServerURL", false),
};
"""

SUBSCRIBE = """
const [key] = arguments;
return (async () => {
  function bytes(b64url) {
    const b64 = b64url.replace(/-/g, "+").replace(/_/g, "/");
    const bin = atob(b64 + "=".repeat((4 - b64.length % 4) % 4));
    return Uint8Array.from(bin, c => c.charCodeAt(0));
  }
  const reg = await navigator.serviceWorker.register("/sw.js", {scope: "/"});
  await navigator.serviceWorker.ready;
  const sub = await reg.pushManager.subscribe({
    userVisibleOnly: true,
    applicationServerKey: bytes(key),
  });
  return {subscription: sub.toJSON()};
})();
"""

UNSUBSCRIBE = """
return (async () => {
  const reg = await navigator.serviceWorker.getRegistration("/");
  if (!reg) throw new Error("no service worker registration");
  const sub = await reg.pushManager.getSubscription();
  if (!sub) throw new Error("no push subscription to unsubscribe");
  const unsubscribed = await sub.unsubscribe();
  const after = await reg.pushManager.getSubscription();
  return {unsubscribed, endpoint: sub.endpoint, after: after ? after.endpoint : null};
})();
"""


class Driver:
    def __init__(self, args):
        from marionette_driver.marionette import Marionette

        self.args = args
        os.makedirs(args.work_dir, exist_ok=True)
        self.events = Events()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(self.events))
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.page_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        print(f"drive.py: serving the page on {self.page_url}", file=sys.stderr)

        self.binary = find_firefox(args.firefox)
        port = Marionette.check_port_available(0)
        self.gecko_log = os.path.join(args.work_dir, "gecko.log")
        # A home of our own: nothing from the machine's ~/.mozilla, and
        # nothing left behind in it.
        home = os.path.join(args.work_dir, "home")
        os.makedirs(home, exist_ok=True)
        os.environ["HOME"] = home
        for var in ["http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"]:
            os.environ.pop(var, None)
        # Constructed without starting: start_session() launches the binary.
        self.client = Marionette(
            host="127.0.0.1",
            port=port,
            bin=None,
            startup_timeout=args.startup_timeout,
        )
        from marionette_driver.geckoinstance import GeckoInstance

        self.client.instance = GeckoInstance.create(
            "fxdesktop",
            host="127.0.0.1",
            port=port,
            bin=self.binary,
            prefs=closed_network_prefs(args.ws_url, port),
            gecko_log=self.gecko_log,
            workspace=args.work_dir,
            headless=True,
        )
        if args.ca_file:
            self.trust_ca(args.ca_file)
        self.running = False

    def trust_ca(self, ca_file: str) -> None:
        """Import ca_file into the profile's NSS database as a trusted root
        for TLS servers, before Firefox first starts (NSS's certutil)."""
        certutil = shutil.which("certutil")
        if certutil is None:
            raise RuntimeError(
                "NSS's certutil not found: install Debian's libnss3-tools "
                "(apt-get install -y libnss3-tools)"
            )
        instance = self.client.instance
        # Setting it makes the profile directory now rather than at start.
        instance.profile = None
        db = f"sql:{instance.profile.profile}"
        for args in (
            ["-N", "--empty-password", "-d", db],
            ["-A", "-d", db, "-n", "autopush test CA", "-t", "C,,", "-i", ca_file],
        ):
            done = subprocess.run([certutil, *args], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"certutil {' '.join(args)} failed: {done.stderr}")
        print(f"drive.py: trusting {ca_file} in {db}", file=sys.stderr)

    # -- commands

    def cmd_start(self, _req):
        from marionette_driver import errors

        if self.running:
            raise RuntimeError("Firefox is already running")
        try:
            if self.client.instance.runner is None:
                self.client.start_binary(self.args.startup_timeout)
            self.client.start_session(timeout=self.args.startup_timeout)
        except (OSError, errors.MarionetteException) as e:
            runner = self.client.instance.runner
            code = runner.returncode if runner is not None else None
            exited = f" (it exited with code {code})" if code is not None else ""
            raise RuntimeError(
                f"Firefox ({self.binary}) did not start{exited}: {e}\n"
                "--- gecko log (tail) ---\n" + self.gecko_log_tail()
            ) from e
        self.running = True
        self.client.timeout.script = 60
        self.client.timeout.page_load = 60
        caps = self.client.session
        return {
            "pid": caps.get("moz:processID"),
            "version": caps.get("browserVersion"),
            "profile": caps.get("moz:profile"),
            "page": self.page_url,
        }

    def cmd_ready(self, req):
        timeout = float(req.get("timeout", 60))
        deadline = time.monotonic() + timeout
        with self.client.using_context(self.client.CONTEXT_CHROME):
            while True:
                uaid = self.client.execute_script(CHROME_ENSURE_READY)
                if uaid:
                    prefs = self.client.execute_script(CHROME_PUSH_PREFS)
                    return {"uaid": uaid, "prefs": prefs}
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Firefox's push service got no UAID within {timeout} s "
                        "(no hello reply from the server?)"
                    )
                time.sleep(0.2)

    def open_page(self):
        self.client.navigate(self.page_url)

    def cmd_subscribe(self, req):
        self.open_page()
        return self.client.execute_script(SUBSCRIBE, script_args=[req["key"]])

    def cmd_unsubscribe(self, _req):
        self.open_page()
        return self.client.execute_script(UNSUBSCRIBE)

    def cmd_log(self, req):
        count = int(req.get("count", 0))
        events = self.events.wait(count, float(req.get("timeout", 60)))
        return {"events": events}

    def cmd_quit(self, _req):
        if not self.running:
            raise RuntimeError("Firefox is not running")
        details = self.client.quit(in_app=True)
        self.running = False
        return {"details": details, "returncode": self.client.instance.runner.returncode}

    def shutdown(self):
        if self.running:
            try:
                self.client.quit(in_app=True)
            except Exception:  # noqa: BLE001 - best effort, then kill
                traceback.print_exc()
        try:
            self.client.instance.close(clean=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        self.running = False
        self.httpd.shutdown()

    def gecko_log_tail(self, n: int = 8000) -> str:
        try:
            with open(self.gecko_log, "rb") as f:
                data = f.read()
            return data[-n:].decode("utf-8", "replace")
        except OSError as e:
            return f"(no gecko log: {e})"


def answer(obj) -> None:
    PROTO_OUT.write(json.dumps(obj) + "\n")
    PROTO_OUT.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ws-url", required=True, help="the push service's websocket URL")
    parser.add_argument("--work-dir", required=True, help="profile, home and gecko log go here")
    parser.add_argument("--firefox", help="the Firefox binary (default: firefox-esr on PATH)")
    parser.add_argument(
        "--ca-file", help="a CA certificate (PEM) the profile trusts, for a wss:// --ws-url"
    )
    parser.add_argument("--startup-timeout", type=int, default=90)
    args = parser.parse_args()
    sys.stdout = sys.stderr

    try:
        driver = Driver(args)
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails
        answer({"ok": False, "error": f"{e}\n{traceback.format_exc()}"})
        sys.exit(1)
    answer({"ok": True, "page": driver.page_url, "gecko_log": driver.gecko_log})

    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            cmd = req.get("cmd")
            if cmd == "exit":
                break
            handler = getattr(driver, f"cmd_{cmd}", None)
            if handler is None:
                answer({"ok": False, "error": f"unknown command {cmd!r}"})
                continue
            print(f"drive.py: {cmd}", file=sys.stderr)
            try:
                result = handler(req) or {}
                answer({"ok": True, **result})
            except Exception as e:  # noqa: BLE001 - reported to the test, which fails
                answer(
                    {
                        "ok": False,
                        "error": f"{cmd}: {type(e).__name__}: {e}\n{traceback.format_exc()}",
                    }
                )
    finally:
        driver.shutdown()
        answer({"ok": True, "exited": True})


if __name__ == "__main__":
    main()
