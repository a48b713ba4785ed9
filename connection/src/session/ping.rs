//! `{}`: the client's keep-alive, answered with `{}`.
//!
//! Some clients in the wild ping in a tight loop, costing both sides battery
//! and bandwidth; one that pings more often than `min_ping_interval` is closed.

use tokio::time::Instant;

use super::{Close, Flow, Session};
use crate::protocol::PONG;

impl Session {
    pub(super) async fn ping(&mut self) -> Flow {
        let now = Instant::now();
        if let Some(last) = self.last_client_ping
            && now.duration_since(last) < self.ctx.settings.min_ping_interval
        {
            return Err(Close::new(4774, "pinging too often"));
        }
        self.last_client_ping = Some(now);
        self.send_text(PONG.to_owned()).await
    }
}
