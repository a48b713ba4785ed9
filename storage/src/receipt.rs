//! Receipts: what a settled message leaves behind in storage.
//!
//! When a message reaches a final state the service sees (the client acked
//! it, the sender deleted it), the one conditional write that used to delete
//! its row turns the row into a small [`Receipt`] instead, under the same
//! key, kept for the receipt retention window and then removed by the
//! backend's expiry. An unsettled message past its TTL is kept as long
//! after its deadline, so its receipt can say `expired`. With retention 0
//! the rows are deleted as before. A removed user's or an unsubscribed
//! channel's pending messages become `gone` receipts.

use autopush_common::Notification;
use autopush_common::notification::version_tag;
use autopush_common::receipt::MessageState;
use futures_util::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{Result, Storage};

/// A settled message's row. Two are equal when their versions are (one may
/// be the other's tag: see [`Receipt::is_for`]).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Receipt {
    /// The final state. Serialized first: the embedded store tells a
    /// receipt from a message by it (see [`Receipt::is_encoded`]).
    #[serde(rename = "settled")]
    pub state: MessageState,
    /// The message id (version) the receipt is for; as read back from the
    /// embedded store, which keeps only its tag, `#` and the tag's hex
    /// (see [`Receipt::is_for`]).
    pub version: String,
    /// Unix seconds when the message reached `state`.
    pub updated: u64,
    /// Unix seconds after which the receipt is gone.
    pub expiry: u64,
}

impl Receipt {
    /// A receipt for `version` settled in `state` now, kept `retention` seconds.
    pub fn new(version: &str, state: MessageState, now: u64, retention: u64) -> Receipt {
        Receipt {
            state,
            version: version.to_owned(),
            updated: now,
            expiry: now.saturating_add(retention),
        }
    }

    /// The receipt of `old`, whose row a newer message with its Topic took
    /// at `now`: `replaced`, or `expired` if its TTL had run out first.
    pub fn replaced(old: &Notification, now: u64, retention: u64) -> Receipt {
        match old.is_expired(now) {
            true => Receipt {
                state: MessageState::Expired,
                version: old.version.clone(),
                updated: old.expiry(),
                expiry: old.expiry().saturating_add(retention),
            },
            false => Receipt::new(&old.version, MessageState::Replaced, now, retention),
        }
    }

    /// A receipt read from a store that kept only `tag` of its message id
    /// ([`version_tag`]).
    pub fn of_tag(state: MessageState, tag: [u8; 8], updated: u64, expiry: u64) -> Receipt {
        Receipt {
            state,
            version: tagged(tag),
            updated,
            expiry,
        }
    }

    /// Whether the receipt is message `version`'s: it holds that id, or its
    /// tag.
    pub fn is_for(&self, version: &str) -> bool {
        self.version == version || self.version == tagged(version_tag(version))
    }

    /// Whether the receipt is that of the message whose id has `tag`
    /// ([`version_tag`]).
    pub fn has_tag(&self, tag: [u8; 8]) -> bool {
        version_tag(&self.version) == tag || self.version == tagged(tag)
    }

    /// Whether a JSON row is a receipt rather than a [`Notification`].
    pub fn is_encoded(json: &[u8]) -> bool {
        json.starts_with(br#"{"settled":"#)
    }
}

impl PartialEq for Receipt {
    fn eq(&self, other: &Receipt) -> bool {
        (self.state, self.updated, self.expiry) == (other.state, other.updated, other.expiry)
            && (self.is_for(&other.version) || other.is_for(&self.version))
    }
}

impl Eq for Receipt {}

/// A receipt's version when only its tag is known: `#` (which no id
/// holds) and the tag's hex.
fn tagged(tag: [u8; 8]) -> String {
    format!("#{}", autopush_common::ids::hex(&tag))
}

/// What a message's row holds.
#[derive(Clone, Debug, PartialEq)]
pub enum StoredMessage {
    /// Not settled yet (possibly past its TTL, kept for its receipt).
    Pending(Notification),
    Settled(Receipt),
}

impl StoredMessage {
    pub fn version(&self) -> &str {
        match self {
            StoredMessage::Pending(m) => &m.version,
            StoredMessage::Settled(r) => &r.version,
        }
    }

    /// Whether the row has outlived its use at `now`: a receipt past its
    /// expiry, a message past its TTL plus `retention` (its `expired`
    /// receipt).
    pub fn is_dead(&self, now: u64, retention: u64) -> bool {
        match self {
            StoredMessage::Pending(m) => m.expiry().saturating_add(retention) <= now,
            StoredMessage::Settled(r) => r.expiry <= now,
        }
    }
}

/// Most pending messages of one user an unsubscribe looks at: more than a
/// client is sent at hello (`--msg-limit`) or a mailbox holds.
const UNSUBSCRIBE_SCAN: usize = 1000;
/// Conditional writes of one unsubscribe in flight at once.
const UNSUBSCRIBE_CONCURRENCY: usize = 16;

/// After `channel_id` was unsubscribed: its pending messages become `gone`
/// receipts, each one conditional write on the version read (a message
/// acked meanwhile keeps its `delivered`). For backends with receipts on.
/// The channel is gone either way: a failure here costs only receipts
/// (they read `stored` until their TTL, then `expired`), so it is logged.
pub(crate) async fn after_unsubscribe<S: Storage + ?Sized>(
    store: &S,
    uaid: &Uuid,
    channel_id: &Uuid,
) {
    if let Err(e) = settle_channel_gone(store, uaid, channel_id).await {
        tracing::warn!(
            uaid = %autopush_common::ids::uaid_tag(uaid),
            error = %e,
            "unsubscribed, but its pending messages could not be marked gone"
        );
    }
}

async fn settle_channel_gone<S: Storage + ?Sized>(
    store: &S,
    uaid: &Uuid,
    channel_id: &Uuid,
) -> Result<()> {
    let pending = store.fetch_messages(uaid, UNSUBSCRIBE_SCAN).await?;
    let settled =
        futures_util::stream::iter(pending.into_iter().filter(|m| m.channel_id == *channel_id))
            .map(|m| async move {
                let key = m.sort_key();
                store
                    .settle_message(uaid, &key, &m.version, MessageState::Gone)
                    .await
            })
            .buffer_unordered(UNSUBSCRIBE_CONCURRENCY)
            .try_collect::<Vec<_>>()
            .await?;
    count_gone(&settled);
    Ok(())
}

/// Count the `gone` receipts of conditional writes that each say whether
/// they settled their message.
pub(crate) fn count_gone(settled: &[bool]) {
    let gone = settled.iter().filter(|settled| **settled).count();
    autopush_common::metrics::final_states_in_store(MessageState::Gone, gone);
}
