//! A push subscription as a page holds it: endpoint + keys, registered over
//! a [`WsClient`], sent to with pywebpush, decrypted with http_ece.

use serde_json::Value;

use crate::py::{self, Decrypted, Keys, SendOptions, SendResult, VapidKey};
use crate::ws::WsClient;
use crate::{is_dashed_uuid, new_channel_id};

/// A registered channel with its endpoint and keys.
#[derive(Debug, Clone)]
pub struct Subscription {
    /// The channel ID (lower-case dashed UUID v4).
    pub channel_id: String,
    /// The `pushEndpoint` from the register reply.
    pub endpoint: String,
    /// The browser-side keys.
    pub keys: Keys,
    /// The VAPID key the channel is restricted to, if any.
    pub vapid: Option<VapidKey>,
}

impl Subscription {
    /// Register a new channel (no VAPID restriction) on a client that has said hello.
    pub async fn new(ws: &mut WsClient) -> Subscription {
        Subscription::register(ws, None).await
    }

    /// Register a new channel restricted to a new VAPID key (a `/wpush/v2/` endpoint).
    pub async fn with_vapid(ws: &mut WsClient) -> Subscription {
        let key = VapidKey::generate().await;
        Subscription::register(ws, Some(key)).await
    }

    /// Register a new channel, restricted to `vapid` when given.
    pub async fn register(ws: &mut WsClient, vapid: Option<VapidKey>) -> Subscription {
        let channel_id = new_channel_id();
        assert!(is_dashed_uuid(&channel_id));
        let reply = ws
            .register(&channel_id, vapid.as_ref().map(|k| k.public_key.as_str()))
            .await;
        assert_eq!(reply["status"], 200, "register failed: {reply}");
        assert_eq!(
            reply["channelID"],
            channel_id.as_str(),
            "register reply: {reply}"
        );
        let endpoint = reply["pushEndpoint"]
            .as_str()
            .unwrap_or_else(|| panic!("no pushEndpoint in {reply}"))
            .to_string();
        Subscription {
            channel_id,
            endpoint,
            keys: Keys::generate().await,
            vapid,
        }
    }

    /// The VAPID key of a [`Subscription::with_vapid`] subscription.
    pub fn vapid_key(&self) -> &VapidKey {
        self.vapid.as_ref().expect("subscription has no VAPID key")
    }

    /// Send with pywebpush to this subscription's endpoint (exactly as `opts` says).
    pub async fn send(&self, opts: &SendOptions) -> SendResult {
        py::send(&self.endpoint, &self.keys, opts).await
    }

    /// Send `text` (aes128gcm, TTL 60, signed with the subscription's VAPID
    /// key if it has one) and assert it was accepted.
    pub async fn push_text(&self, text: &str) -> SendResult {
        let mut opts = SendOptions::text(text);
        if let Some(k) = &self.vapid {
            opts = opts.vapid(k);
        }
        let res = self.send(&opts).await;
        res.assert_created();
        res
    }

    /// Decrypt a notification for this subscription.
    pub async fn decrypt(&self, notification: &Value) -> Decrypted {
        assert_eq!(
            notification["channelID"],
            self.channel_id.as_str(),
            "notification for another channel: {notification}"
        );
        py::decrypt(&self.keys, notification).await
    }

    /// Receive the next notification on `ws`, check it is for this channel,
    /// and decrypt it. Does not ack.
    pub async fn receive(&self, ws: &mut WsClient) -> (Value, Decrypted) {
        let n = ws.recv_notification().await;
        let d = self.decrypt(&n).await;
        (n, d)
    }
}
