//! What a session has sent and not seen settled yet, and what it must
//! remember of what was settled.
//!
//! A session holds this boxed, and only while there is any of it: maps and
//! queues are a few dozen bytes each even when empty, and an idle client
//! should hold nothing it does not use. The session sheds it at its idle
//! ping ([`InFlight::shed`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::LazyLock;
use std::time::Duration;

use autopush_common::Notification;
use tokio::time::Instant;

use super::stored::BATCH;
use crate::registry::MAX_PENDING_DIRECT;

#[derive(Default)]
pub(super) struct InFlight {
    /// Direct notifications sent and not yet acknowledged, by version,
    /// each with when it was sent (see `LocalNode::acks_late`).
    pub unacked_direct: HashMap<String, (Notification, Instant)>,
    /// Stored notifications sent and not yet acknowledged, by version.
    pub unacked_stored: HashMap<String, Notification>,
    /// Messages the client nacked (stored ones, and direct ones, stored
    /// then if they were not already): they stay stored for its next
    /// connection but are not sent again in this one.
    pub skip_stored: HashSet<String>,
    /// The last stored messages settled, so a durable direct copy of one
    /// that arrives late is not delivered twice.
    pub recently_settled: RecentlySettled,
    /// Unacked direct messages whose copy a holder keeps (see
    /// `autopush_webpush::held`) and that were found in storage all the
    /// same: written there by an endpoint that gave up waiting for this
    /// node. Settled there at the ack too.
    pub stored_too: HashSet<String>,
    /// The last such held messages acked, so a copy an endpoint wrote
    /// after giving up, found by a later look, is settled, not sent again.
    pub recently_acked_held: RecentlySettled,
}

impl InFlight {
    /// An empty one, for reading when a session has none.
    pub fn none() -> &'static InFlight {
        static NONE: LazyLock<InFlight> = LazyLock::new(InFlight::default);
        &NONE
    }

    /// `notification`, sent (or queued, for a session ending) at `at`, is
    /// not acked yet.
    pub fn unacked(&mut self, notification: Notification, at: Instant) {
        let version = notification.version.clone();
        self.unacked_direct.insert(version, (notification, at));
    }

    /// Whether `version` was sent from storage in this session, settled, or
    /// nacked: a direct copy of it must not be delivered again.
    pub fn sent_from_storage(&self, version: &str) -> bool {
        self.unacked_stored.contains_key(version)
            || self.recently_settled.contains(version)
            || self.skip_stored.contains(version)
    }

    /// What is left worth keeping after the client has been silent for a
    /// ping interval: `None` when nothing is.
    pub fn shed(mut self: Box<Self>, now: Instant) -> Option<Box<Self>> {
        for recent in [&mut self.recently_settled, &mut self.recently_acked_held] {
            if recent.forgettable(now) {
                *recent = RecentlySettled::default();
            }
        }
        let unsettled = !self.unacked_direct.is_empty()
            || !self.unacked_stored.is_empty()
            || !self.skip_stored.is_empty();
        if !unsettled && self.recently_settled.is_empty() && self.recently_acked_held.is_empty() {
            return None;
        }
        // What a burst grew and no longer uses.
        self.unacked_direct.shrink_to_fit();
        self.unacked_stored.shrink_to_fit();
        Some(self)
    }
}

/// The versions of the stored messages settled last, so that a durable
/// direct copy of one, arriving from the inbox after its stored copy was
/// sent and acked, is not delivered a second time.
#[derive(Default)]
pub(super) struct RecentlySettled {
    versions: VecDeque<String>,
    /// When the last one was settled.
    last: Option<Instant>,
}

impl RecentlySettled {
    /// Versions remembered; the oldest is forgotten first. A client may
    /// ack a whole stored batch at once while up to `MAX_PENDING_DIRECT`
    /// durable direct copies wait in its inbox: that many are remembered.
    const CAPACITY: usize = BATCH + MAX_PENDING_DIRECT;

    /// How long after the last settle a late copy can still come: an
    /// endpoint gives up on a router call after 3 seconds, and a copy is in
    /// the inbox as soon as the node reads the call.
    const MEMORY: Duration = Duration::from_secs(60);

    pub fn remember(&mut self, version: &str, now: Instant) {
        if self.versions.len() == Self::CAPACITY {
            self.versions.pop_front();
        }
        self.versions.push_back(version.to_owned());
        self.last = Some(now);
    }

    pub fn contains(&self, version: &str) -> bool {
        self.versions.iter().any(|v| v == version)
    }

    fn is_empty(&self) -> bool {
        self.versions.is_empty()
    }

    /// No late copy can come any more.
    fn forgettable(&self, now: Instant) -> bool {
        self.last
            .is_none_or(|last| now.saturating_duration_since(last) >= Self::MEMORY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::test_notification as message;

    /// A client acks a full stored batch at once while durable direct
    /// copies of those messages wait in its inbox (at most
    /// `MAX_PENDING_DIRECT` of them): every version of the batch, and of as
    /// many more, must still be recognised when the copies come out.
    #[test]
    fn a_full_batch_and_the_direct_window_are_remembered() {
        let now = Instant::now();
        let mut settled = RecentlySettled::default();
        let versions: Vec<String> = (0..BATCH + MAX_PENDING_DIRECT)
            .map(|i| format!("v{i}"))
            .collect();
        for version in &versions {
            settled.remember(version, now);
        }
        let forgotten = versions.iter().filter(|v| !settled.contains(v)).count();
        assert_eq!(
            forgotten,
            0,
            "{forgotten} of the last {} settled versions forgotten",
            versions.len()
        );
        // Bounded all the same: the oldest goes first.
        settled.remember("one more", now);
        assert!(!settled.contains("v0") && settled.contains("one more"));
    }

    /// At the idle ping, a session keeps what is still unsettled, and the
    /// versions settled within the last minute, and frees the rest.
    #[test]
    fn an_idle_session_keeps_only_what_can_still_matter() {
        let now = Instant::now();
        let mut in_flight = Box::<InFlight>::default();
        in_flight.recently_settled.remember("settled", now);
        let in_flight = in_flight
            .shed(now + Duration::from_secs(59))
            .expect("a settle under a minute ago is kept");
        assert!(in_flight.sent_from_storage("settled"));
        assert!(
            in_flight.shed(now + RecentlySettled::MEMORY).is_none(),
            "nothing is left to keep a minute after the last settle"
        );

        let later = now + Duration::from_secs(600);
        for unsettled in [
            |f: &mut InFlight| {
                f.unacked(message("d"), Instant::now());
            },
            |f: &mut InFlight| {
                f.unacked_stored.insert("s".into(), message("s"));
            },
            |f: &mut InFlight| {
                f.skip_stored.insert("n".into());
            },
        ] {
            let mut in_flight = Box::<InFlight>::default();
            in_flight.recently_settled.remember("settled", now);
            unsettled(&mut in_flight);
            let kept = in_flight.shed(later).expect("what is unsettled is kept");
            assert!(!kept.recently_settled.contains("settled"));
        }
    }
}
