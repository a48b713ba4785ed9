//! The router API's versions (docs/internals.md holds the contract of
//! each): what a request and an answer say about their sender, and who an
//! answer comes from ([`Answerer`]).
//!
//! Nothing is inferred from a missing header: an answer is ours when it
//! says so, autopush-rs's when it comes from an address a declared
//! migration names (autopush-rs's node sends nothing of its own), and
//! anything else is trusted with nothing about durable copies.

use std::net::IpAddr;

use autopush_serving::http::in_networks;
use http::HeaderMap;

/// On every request and answer of ours since protocol 3: the router API
/// version its sender speaks, a decimal number.
pub const ROUTER_API: &str = "x-autopush-router-api";

/// The router API version this build speaks.
pub const VERSION: u32 = 5;

/// The first version whose endpoints seal a message their node says was
/// acked within the grace into its id (`delivered`): the node writes no
/// receipt for it.
pub const SEALS_ACKS: u32 = 4;

/// The first version whose endpoints take `kept` for an answer to a hold:
/// the node keeps the copy in its own journal (see
/// [`crate::node_journal`]) and answers before the ack.
pub const TAKES_KEPT: u32 = 5;

/// On every answer of ours since protocol 2 (which names no version): this
/// node deletes a durable direct copy when its client acks it. Kept for
/// the endpoints of protocol 2, which know a node of ours by it.
pub const SETTLES_DURABLE_COPY: &str = "x-autopush-settles-durable-copy";

/// Who answered a router API call, as far as its answer says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answerer {
    /// A node of ours of protocol 2 or later: it deletes a durable copy at
    /// its client's ack and says what became of a copy it held. A later
    /// version than ours is read as ours: each version keeps what the
    /// earlier ones answer, and what we do not know is ignored.
    Ours,
    /// autopush-rs's node, from an address a declared migration names
    /// (`--autopush-rs-nodes`), naming no version: its acks never touch
    /// storage, and it stores a message itself when its client leaves
    /// without an ack.
    AutopushRs,
    /// Anything else, our nodes of protocol 1 among them: the endpoint
    /// keeps (or writes) the durable copy, and never removes one. A
    /// duplicate, never a loss.
    Unknown,
}

/// Who sent an answer with `headers`, from `peer` (`None`: unknown), given
/// the addresses a declared migration names as autopush-rs's nodes.
pub fn answerer(
    headers: &HeaderMap,
    peer: Option<IpAddr>,
    autopush_rs: &[ipnet::IpNet],
) -> Answerer {
    if let Some(version) = headers.get(ROUTER_API) {
        return match version_of(version.as_bytes()) {
            Some(v) if v >= 3 => Answerer::Ours,
            // Not a version any node of ours sends.
            _ => Answerer::Unknown,
        };
    }
    if headers.contains_key(SETTLES_DURABLE_COPY) {
        return Answerer::Ours;
    }
    let declared = peer.is_some_and(|peer| in_networks(peer, autopush_rs));
    match declared {
        true => Answerer::AutopushRs,
        false => Answerer::Unknown,
    }
}

/// The version a [`ROUTER_API`] value names, if it is a number.
pub fn version_of(value: &[u8]) -> Option<u32> {
    std::str::from_utf8(value).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, http::HeaderValue::from_static(value));
        }
        map
    }

    fn local() -> Option<IpAddr> {
        Some("10.0.2.7".parse().unwrap())
    }

    #[test]
    fn an_answer_is_ours_when_it_says_so() {
        let declared = ["10.0.2.0/24".parse().unwrap()];
        for answer in [
            headers(&[(ROUTER_API, "3")]),
            // A later version, with what we do not know.
            headers(&[(ROUTER_API, "4"), ("x-autopush-router-api-next", "x")]),
            // Protocol 2.
            headers(&[(SETTLES_DURABLE_COPY, "1")]),
        ] {
            // Saying so wins over a declaration that names its address.
            assert_eq!(answerer(&answer, local(), &declared), Answerer::Ours);
            assert_eq!(answerer(&answer, None, &[]), Answerer::Ours);
        }
    }

    #[test]
    fn a_silent_answer_is_autopush_rs_only_from_a_declared_address() {
        let declared = ["10.0.2.0/24".parse().unwrap()];
        let silent = HeaderMap::new();
        assert_eq!(answerer(&silent, local(), &declared), Answerer::AutopushRs);
        // The same address as an IPv4-mapped IPv6 one.
        let mapped = Some("::ffff:10.0.2.7".parse().unwrap());
        assert_eq!(answerer(&silent, mapped, &declared), Answerer::AutopushRs);
        // Declared as IPv4-mapped IPv6 addresses.
        let declared_mapped = ["::ffff:10.0.2.0/120".parse().unwrap()];
        for peer in [local(), mapped] {
            assert_eq!(
                answerer(&silent, peer, &declared_mapped),
                Answerer::AutopushRs
            );
        }
        // Not declared, or from an unknown address: protocol 1 of ours,
        // or anyone.
        assert_eq!(answerer(&silent, local(), &[]), Answerer::Unknown);
        assert_eq!(answerer(&silent, None, &declared), Answerer::Unknown);
        let elsewhere = Some("10.0.3.7".parse().unwrap());
        assert_eq!(answerer(&silent, elsewhere, &declared), Answerer::Unknown);
    }

    #[test]
    fn a_version_no_node_of_ours_sends_is_trusted_with_nothing() {
        let declared = ["10.0.2.0/24".parse().unwrap()];
        for bad in ["2", "1", "three", ""] {
            let answer = headers(&[(ROUTER_API, bad), (SETTLES_DURABLE_COPY, "1")]);
            assert_eq!(
                answerer(&answer, local(), &declared),
                Answerer::Unknown,
                "{bad:?}"
            );
        }
    }
}
