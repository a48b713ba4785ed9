//! `unregister`: drop a channel; pushes to its endpoint get 410 from now on.

use super::{Flow, Session};
use crate::protocol::ServerMessage;
use autopush_common::ids::parse_channel_id;

impl Session {
    pub(super) async fn unregister(&mut self, channel_id: &str, code: Option<u32>) -> Flow {
        let reply = |status: u16, reason: Option<&str>| ServerMessage::Unregister {
            channel_id: channel_id.to_owned(),
            status,
            reason: reason.map(str::to_owned),
        };
        let Some(chid) = parse_channel_id(channel_id) else {
            return self
                .send(&reply(
                    401,
                    Some("channelID must be a lowercase dashed UUID"),
                ))
                .await;
        };
        // 200: unsubscribed, 201: over quota, 202: permission revoked.
        if code.is_some_and(|c| !(200..=202).contains(&c)) {
            return self
                .send(&reply(401, Some("code must be 200, 201 or 202")))
                .await;
        }
        match self.ctx.storage.remove_channel(&self.uaid, &chid).await {
            Ok(_) => self.send(&reply(200, None)).await,
            Err(e) => {
                let reason = self.storage_failed("unregister", &e);
                self.send(&reply(500, Some(reason))).await
            }
        }
    }
}
