//! Remembering verified tokens, so a sender's repeated JWT skips the signature check.
//!
//! Senders mint one JWT and reuse it for hours, and an ECDSA verification costs far
//! more than everything else in a push. The cache maps (token, key) to the identity the
//! full check produced, until the token's `exp`.
//!
//! Three properties keep it safe:
//!
//! * the map key is a SHA-256 over *both* the token and the key text, so a cached token
//!   presented with another key is a miss and gets a full (failing) check, and nobody
//!   can craft a different (token, key) pair that lands on a cached entry;
//! * expiry is checked by the caller on every hit with the same rule as a full check,
//!   so a cached token ages exactly like a fresh one;
//! * it is bounded. When full, expired entries are swept; if every entry is still live,
//!   an arbitrary one is evicted. `HashMap` iteration order depends on a per-process
//!   random seed, so that is random eviction: cheap, and not steerable by a sender who
//!   floods fresh tokens to push someone else's entry out (they only dilute the hit
//!   rate, and each of their insertions cost them a signature we verified).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use sha2::{Digest, Sha256};

use super::VapidIdentity;
use super::claims::is_expired;

/// SHA-256 of the token and the key text: fixed-size however large the headers are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct CacheKey([u8; 32]);

impl CacheKey {
    pub(super) fn new(token: &str, key: &str) -> Self {
        // The length prefix makes the encoding unambiguous: ("ab", "c") and ("a", "bc")
        // hash differently.
        let mut hasher = Sha256::new();
        hasher.update((token.len() as u64).to_le_bytes());
        hasher.update(token.as_bytes());
        hasher.update(key.as_bytes());
        Self(hasher.finalize().into())
    }
}

/// Thread-safe, bounded map of verified tokens. A read lock serves hits, which are
/// nearly all traffic; only misses, and hits on an expired entry, take the write lock.
pub(super) struct VerifiedCache {
    capacity: usize,
    entries: RwLock<HashMap<CacheKey, Arc<VapidIdentity>>>,
    hits: AtomicU64,
}

impl std::fmt::Debug for VerifiedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerifiedCache")
            .field("capacity", &self.capacity)
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

impl VerifiedCache {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: RwLock::new(HashMap::new()),
            hits: AtomicU64::new(0),
        }
    }

    /// The identity cached for `key`, expired or not: the caller checks `exp`.
    pub(super) fn get(&self, key: &CacheKey) -> Option<Arc<VapidIdentity>> {
        // A panic while holding the lock cannot leave the map half-updated (each
        // operation is a single HashMap call), so a poisoned lock is still usable.
        let entries = self.entries.read().unwrap_or_else(PoisonError::into_inner);
        let identity = entries.get(key).cloned();
        if identity.is_some() {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
        identity
    }

    pub(super) fn remove(&self, key: &CacheKey) {
        let mut entries = self.entries.write().unwrap_or_else(PoisonError::into_inner);
        entries.remove(key);
    }

    pub(super) fn insert(&self, key: CacheKey, identity: Arc<VapidIdentity>, now: u64) {
        let mut entries = self.entries.write().unwrap_or_else(PoisonError::into_inner);
        if entries.len() >= self.capacity && !entries.contains_key(&key) {
            entries.retain(|_, cached| !is_expired(cached.exp, now));
            if entries.len() >= self.capacity {
                let victim = entries.keys().next().copied();
                if let Some(victim) = victim {
                    entries.remove(&victim);
                }
            }
        }
        entries.insert(key, identity);
    }

    pub(super) fn len(&self) -> usize {
        self.entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// How many lookups found an entry (for tests).
    #[cfg(test)]
    pub(super) fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(exp: u64) -> Arc<VapidIdentity> {
        Arc::new(VapidIdentity {
            public_key: vec![4; 65],
            key_hash: [0; 32],
            sub: None,
            exp,
        })
    }

    #[test]
    fn key_covers_token_and_key_unambiguously() {
        assert_eq!(CacheKey::new("tok", "key"), CacheKey::new("tok", "key"));
        assert_ne!(CacheKey::new("tok", "key"), CacheKey::new("tok", "other"));
        assert_ne!(CacheKey::new("ab", "c"), CacheKey::new("a", "bc"));
    }

    #[test]
    fn bounded_and_sweeps_expired_entries_first() {
        let cache = VerifiedCache::new(2);
        let (a, b, c, d) = (
            CacheKey::new("a", "k"),
            CacheKey::new("b", "k"),
            CacheKey::new("c", "k"),
            CacheKey::new("d", "k"),
        );
        cache.insert(a, identity(100), 0);
        cache.insert(b, identity(10_000), 0);
        // At t=1000, `a` is expired: it is the one to go, `b` stays.
        cache.insert(c, identity(10_000), 1_000);
        assert_eq!(cache.len(), 2);
        assert!(cache.get(&a).is_none());
        assert!(cache.get(&b).is_some());
        assert!(cache.get(&c).is_some());
        // Nothing expired: something is evicted, and the bound holds.
        cache.insert(d, identity(10_000), 1_000);
        assert_eq!(cache.len(), 2);
        assert!(cache.get(&d).is_some());
        // Re-inserting a present key never evicts.
        cache.insert(d, identity(10_000), 1_000);
        assert_eq!(cache.len(), 2);
    }

    #[test]
    fn hits_are_counted() {
        let cache = VerifiedCache::new(4);
        let key = CacheKey::new("t", "k");
        assert!(cache.get(&key).is_none());
        cache.insert(key, identity(10), 0);
        assert!(cache.get(&key).is_some());
        assert_eq!(cache.hits(), 1);
        cache.remove(&key);
        assert!(cache.get(&key).is_none());
        assert_eq!(cache.hits(), 1);
    }
}
