//! `register`: subscribe a channel and hand out its push endpoint.

use autopush_common::ids::{decode_vapid_key, parse_channel_id};

use super::{Flow, Session};
use crate::protocol::ServerMessage;

impl Session {
    pub(super) async fn register(&mut self, channel_id: &str, key: Option<&str>) -> Flow {
        let refuse = |status: u16, reason: &str| ServerMessage::Register {
            channel_id: channel_id.to_owned(),
            status,
            push_endpoint: None,
            reason: Some(reason.to_owned()),
        };
        let Some(chid) = parse_channel_id(channel_id) else {
            return self
                .send(&refuse(401, "channelID must be a lowercase dashed UUID"))
                .await;
        };
        let key = match key.map(decode_vapid_key) {
            Some(None) => {
                return self
                    .send(&refuse(
                        400,
                        "key must be an uncompressed P-256 public key in base64url",
                    ))
                    .await;
            }
            Some(Some(key)) => Some(key),
            None => None,
        };
        let limit = self.ctx.settings.max_channels;
        match self.ctx.storage.add_channel(&self.uaid, &chid, limit).await {
            Ok(true) => {}
            Ok(false) => {
                let reason = format!("too many channels: at most {limit} per user agent");
                return self.send(&refuse(413, &reason)).await;
            }
            Err(e) => {
                let reason = self.storage_failed("register", &e);
                return self.send(&refuse(500, reason)).await;
            }
        }
        let endpoint = self
            .ctx
            .crypto
            .make_endpoint(&self.uaid, &chid, key.as_deref());
        self.send(&ServerMessage::Register {
            channel_id: channel_id.to_owned(),
            status: 200,
            push_endpoint: Some(endpoint),
            reason: None,
        })
        .await
    }
}
