//! `{}`: the client's keep-alive, answered with `{}`.
//!
//! Clients behind carrier NAT ping every 30–60 s to keep their connection
//! mapped, and may ping early now and then (a network change, waking up):
//! all of that is answered. Some clients in the wild ping in a tight loop,
//! costing both sides battery and bandwidth. So each session holds a few
//! ping tokens: a ping takes one, one comes back every `min_ping_interval`,
//! and only a client that runs out, pinging faster than that for long, is
//! closed with 4774 (Mozilla's "stop pinging until the network changes").

use std::time::Duration;

use tokio::time::Instant;

use super::{Close, Flow, Session};
use crate::protocol::PONG;

/// Pings a client may send in a row before their spacing counts.
const PING_BURST: f32 = 10.0;

/// A session's ping tokens.
pub(super) struct PingTokens {
    tokens: f32,
    updated: Instant,
}

impl PingTokens {
    pub(super) fn new(now: Instant) -> Self {
        PingTokens {
            tokens: PING_BURST,
            updated: now,
        }
    }

    /// Take a token for a ping at `now`, if one is left, with one token
    /// back per `every` since the last ping (`every` zero: no limit).
    fn take(&mut self, every: Duration, now: Instant) -> bool {
        if every.is_zero() {
            return true;
        }
        let elapsed = now.saturating_duration_since(self.updated);
        let gained = (elapsed.as_secs_f64() / every.as_secs_f64()) as f32;
        self.tokens = (self.tokens + gained).min(PING_BURST);
        self.updated = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

impl Session {
    pub(super) async fn ping(&mut self) -> Flow {
        if !self
            .ping_tokens
            .take(self.ctx.settings.min_ping_interval, Instant::now())
        {
            return Err(Close::new(4774, "pinging too often"));
        }
        self.send_text(PONG.to_owned()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVERY: Duration = Duration::from_secs(20);

    #[test]
    fn pings_as_often_as_the_interval_never_run_out() {
        let start = Instant::now();
        let mut tokens = PingTokens::new(start);
        for i in 1..1000 {
            assert!(tokens.take(EVERY, start + EVERY * i), "ping {i}");
        }
    }

    #[test]
    fn a_few_early_pings_are_answered_and_the_allowance_comes_back() {
        let start = Instant::now();
        let mut tokens = PingTokens::new(start);
        let mut now = start;
        for round in 0..50 {
            // Three pings at once (a network change), then five minutes of
            // a 30 s rhythm.
            for _ in 0..3 {
                assert!(tokens.take(EVERY, now), "round {round}");
            }
            for _ in 0..10 {
                now += Duration::from_secs(30);
                assert!(tokens.take(EVERY, now), "round {round}");
            }
        }
    }

    #[test]
    fn a_tight_loop_runs_out_after_the_burst() {
        let start = Instant::now();
        let mut tokens = PingTokens::new(start);
        let answered = (0..100)
            .take_while(|i| tokens.take(EVERY, start + Duration::from_millis(*i)))
            .count();
        assert_eq!(answered, PING_BURST as usize);
    }

    #[test]
    fn pings_faster_than_the_interval_run_out_in_time() {
        // Every 15 s against 20: a quarter token short each time.
        let start = Instant::now();
        let mut tokens = PingTokens::new(start);
        let answered = (1..1000)
            .take_while(|i| tokens.take(EVERY, start + Duration::from_secs(15) * *i))
            .count();
        assert!((30..50).contains(&answered), "{answered}");
    }

    #[test]
    fn zero_means_no_limit() {
        let start = Instant::now();
        let mut tokens = PingTokens::new(start);
        assert!((0..1000).all(|_| tokens.take(Duration::ZERO, start)));
    }
}
