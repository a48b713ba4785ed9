#!/usr/bin/env node
// The web-push npm package as an application server, for tests/tests/webpush_npm.rs.
//
//   node send.js '<request JSON>'
//
// request: {
//   "subscription": {"endpoint": "...", "keys": {"p256dh": "...", "auth": "..."}},
//   "payload": "text" (optional; UTF-8),
//   "options": { web-push's options: "TTL", "contentEncoding" ("aes128gcm" |
//                "aesgcm"), "vapidDetails": {"subject", "publicKey", "privateKey"},
//                "topic", "urgency", ... }
// }
//
// web-push builds the request (encryption, VAPID headers) with
// generateRequestDetails(); it is sent with Node's fetch, because web-push's
// own sendNotification() only speaks https and the test service is plain
// http on loopback. Prints one JSON object:
//   {"status", "headers", "body", "sent_headers", "sent_body_len"}
// Exits non-zero (message on stderr) when web-push refuses or fetch fails.

"use strict";

const webpush = require("web-push");

async function main() {
  if (process.argv.length !== 3) {
    throw new Error("usage: node send.js '<request JSON>'");
  }
  const req = JSON.parse(process.argv[2]);
  const payload = req.payload === undefined || req.payload === null ? null : req.payload;
  const details = webpush.generateRequestDetails(req.subscription, payload, req.options || {});

  // Header values as strings, names as web-push wrote them.
  const sentHeaders = {};
  for (const [name, value] of Object.entries(details.headers)) {
    sentHeaders[name] = String(value);
  }
  // fetch computes Content-Length from the body itself.
  const fetchHeaders = Object.fromEntries(
    Object.entries(sentHeaders).filter(([name]) => name.toLowerCase() !== "content-length"),
  );
  const resp = await fetch(details.endpoint, {
    method: details.method,
    headers: fetchHeaders,
    body: details.body,
    redirect: "manual",
    signal: AbortSignal.timeout(30000),
  });
  const headers = {};
  resp.headers.forEach((value, name) => {
    headers[name.toLowerCase()] = value;
  });
  const body = await resp.text();
  const lowerSent = {};
  for (const [name, value] of Object.entries(sentHeaders)) {
    lowerSent[name.toLowerCase()] = value;
  }
  process.stdout.write(
    JSON.stringify({
      status: resp.status,
      headers,
      body,
      sent_headers: lowerSent,
      sent_body_len: details.body ? details.body.length : 0,
    }) + "\n",
  );
}

main().catch((err) => {
  process.stderr.write(`send.js: ${err && err.stack ? err.stack : err}\n`);
  process.exit(1);
});
