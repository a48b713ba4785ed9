// Service worker of the Firefox interop test (tests/firefox/drive.py serves it).
// Reports every push event's plaintext, as Firefox decrypted it, to the test's
// loopback logger.

function report(event) {
  return fetch("/log", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(event),
  });
}

self.addEventListener("install", () => self.skipWaiting());
self.addEventListener("activate", (e) => e.waitUntil(self.clients.claim()));

self.addEventListener("push", (e) => {
  const text = e.data ? e.data.text() : null;
  e.waitUntil(report({ kind: "push", text }));
});

self.addEventListener("pushsubscriptionchange", (e) => {
  e.waitUntil(
    report({
      kind: "pushsubscriptionchange",
      old: e.oldSubscription ? e.oldSubscription.endpoint : null,
      new: e.newSubscription ? e.newSubscription.endpoint : null,
    }),
  );
});
