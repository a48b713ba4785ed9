//! What became of a message: the states a receipt (`GET` on the message URL
//! the sender got in `Location`) reports.

use serde::{Deserialize, Serialize};

/// A message's state, as the receipt names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MessageState {
    /// Waiting for the client (pending).
    Stored,
    /// Handed to a connected client, waiting for its ack (pending).
    Sent,
    /// Acked by the client.
    Delivered,
    /// Accepted by APNs/FCM.
    Bridged,
    /// Acked by the app through its mailbox.
    Fetched,
    /// Its TTL ran out before delivery.
    Expired,
    /// Deleted by the sender.
    Deleted,
    /// Replaced by a newer message with the same Topic.
    Replaced,
    /// TTL 0 and no client connected.
    Dropped,
    /// The subscription ended first.
    Gone,
}

impl MessageState {
    pub const ALL: [MessageState; 10] = [
        MessageState::Stored,
        MessageState::Sent,
        MessageState::Delivered,
        MessageState::Bridged,
        MessageState::Fetched,
        MessageState::Expired,
        MessageState::Deleted,
        MessageState::Replaced,
        MessageState::Dropped,
        MessageState::Gone,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            MessageState::Stored => "stored",
            MessageState::Sent => "sent",
            MessageState::Delivered => "delivered",
            MessageState::Bridged => "bridged",
            MessageState::Fetched => "fetched",
            MessageState::Expired => "expired",
            MessageState::Deleted => "deleted",
            MessageState::Replaced => "replaced",
            MessageState::Dropped => "dropped",
            MessageState::Gone => "gone",
        }
    }

    pub fn parse(name: &str) -> Option<MessageState> {
        MessageState::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// Whether nothing more happens to the message in this state.
    pub fn is_final(self) -> bool {
        !matches!(self, MessageState::Stored | MessageState::Sent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_as_serde_spells_them() {
        for state in MessageState::ALL {
            assert_eq!(MessageState::parse(state.as_str()), Some(state));
            assert_eq!(
                serde_json::to_value(state).unwrap(),
                serde_json::json!(state.as_str())
            );
        }
        assert_eq!(MessageState::parse("lost"), None);
    }
}
