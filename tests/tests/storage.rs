//! One behavioural suite for the `Storage` trait, run against every
//! backend: the embedded store (redb in a temp dir), DynamoDB (local moto
//! and dynalite servers, see `autopush_tests::dynamo`) and Bigtable
//! (Google's emulator, see `autopush_tests::bigtable`) and PostgreSQL (a
//! private cluster, see `autopush_tests::postgres`), so they cannot drift.
//! Each test is written once in `suite` and instantiated per backend by
//! `for_backend!`.

use std::sync::Arc;

use autopush_common::notification::receipt_key;
use autopush_common::receipt::MessageState;
use autopush_common::{Notification, RouterType, User, WakeRoute, time::now_secs};
use autopush_storage::{Storage, StorageError, StoredMessage, embedded::EmbeddedStore};
use autopush_tests::{bigtable as emulator, dynamo, postgres as pg};
use tempfile::TempDir;
use uuid::Uuid;

/// A store under test, with whatever must live as long as it.
struct Backend {
    store: Arc<dyn Storage>,
    _dir: Option<TempDir>,
}

async fn embedded() -> Backend {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    Backend {
        store: Arc::new(store),
        _dir: Some(dir),
    }
}

async fn dynamodb() -> Backend {
    Backend {
        store: Arc::new(dynamo::fresh_store().await),
        _dir: None,
    }
}

async fn dynalite() -> Backend {
    Backend {
        store: Arc::new(dynamo::fresh_dynalite_store().await),
        _dir: None,
    }
}

async fn bigtable() -> Backend {
    Backend {
        store: Arc::new(emulator::fresh_store().await),
        _dir: None,
    }
}

async fn postgres() -> Backend {
    Backend {
        store: Arc::new(pg::fresh_store().await),
        _dir: None,
    }
}

/// PostgreSQL tables as autopush-rs makes them: its foreign keys on.
async fn postgres_autopush_rs_schema() -> Backend {
    Backend {
        store: Arc::new(pg::fresh_autopush_rs_store().await),
        _dir: None,
    }
}

/// Seconds receipts are kept by the `*_receipts` backends.
const RETENTION: u64 = 3600;

async fn embedded_receipts() -> Backend {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path())
        .unwrap()
        .with_receipt_retention(RETENTION);
    Backend {
        store: Arc::new(store),
        _dir: Some(dir),
    }
}

async fn dynamodb_receipts() -> Backend {
    Backend {
        store: Arc::new(
            dynamo::fresh_store()
                .await
                .with_receipt_retention(RETENTION),
        ),
        _dir: None,
    }
}

async fn dynalite_receipts() -> Backend {
    Backend {
        store: Arc::new(
            dynamo::fresh_dynalite_store()
                .await
                .with_receipt_retention(RETENTION),
        ),
        _dir: None,
    }
}

async fn bigtable_receipts() -> Backend {
    Backend {
        store: Arc::new(
            emulator::fresh_store()
                .await
                .with_receipt_retention(RETENTION),
        ),
        _dir: None,
    }
}

async fn postgres_receipts() -> Backend {
    Backend {
        store: Arc::new(pg::fresh_store().await.with_receipt_retention(RETENTION)),
        _dir: None,
    }
}

fn message(channel_id: Uuid, topic: Option<&str>, ts: u64, ttl: u64, data: &str) -> Notification {
    Notification {
        channel_id,
        version: format!("v-{data}-{ts}"),
        ttl,
        timestamp: now_secs(),
        topic: topic.map(str::to_owned),
        sortkey_timestamp: Some(ts),
        data: Some(data.to_owned()),
        headers: None,
        urgency: None,
        durable: false,
    }
}

/// Settle the message under `key` if still `version`; whether it was.
async fn settle(
    store: &dyn Storage,
    uaid: &Uuid,
    key: &str,
    version: &str,
    state: MessageState,
) -> bool {
    store
        .settle_message(uaid, key, version, state)
        .await
        .unwrap()
}

/// A new user's UAID, its record written: on autopush-rs's PostgreSQL
/// tables a channel or a message needs its user's row.
async fn user(store: &dyn Storage) -> Uuid {
    let uaid = Uuid::new_v4();
    let user = User::new_webpush(uaid, "http://a", 1);
    store.add_user(&user).await.unwrap();
    uaid
}

fn data(messages: &[Notification]) -> Vec<String> {
    messages.iter().map(|m| m.data.clone().unwrap()).collect()
}

mod suite {
    use super::*;

    /// With receipts off, settling a message deletes it, as an ack always did.
    pub async fn without_receipts_settling_deletes(store: Arc<dyn Storage>) {
        let (uaid, chid) = (user(&*store).await, Uuid::new_v4());
        let m = message(chid, None, 1, 60, "m");
        store.save_messages(&uaid, vec![m.clone()]).await.unwrap();
        let (key, delivered) = (m.sort_key(), MessageState::Delivered);
        assert!(!settle(&*store, &uaid, &key, "another version", delivered).await);
        assert!(settle(&*store, &uaid, &key, &m.version, delivered).await);
        assert_eq!(store.read_message(&uaid, &key).await.unwrap(), None);
        assert!(!settle(&*store, &uaid, &key, &m.version, delivered).await);
    }

    /// An ack turns the message's row into its receipt, only for the
    /// version acked and only once; fetching and counting skip receipts.
    pub async fn settling_leaves_a_receipt_in_the_row(store: Arc<dyn Storage>) {
        let (uaid, chid) = (Uuid::new_v4(), Uuid::new_v4());
        let m = message(chid, None, 1, 60, "m");
        let key = m.sort_key();
        store.save_messages(&uaid, vec![m.clone()]).await.unwrap();
        assert_eq!(
            store.read_message(&uaid, &key).await.unwrap(),
            Some(StoredMessage::Pending(m.clone()))
        );
        let delivered = MessageState::Delivered;
        assert!(!settle(&*store, &uaid, &key, "another version", delivered).await);
        let before = now_secs();
        assert!(settle(&*store, &uaid, &key, &m.version, delivered).await);
        let Some(StoredMessage::Settled(receipt)) = store.read_message(&uaid, &key).await.unwrap()
        else {
            panic!("no receipt after the ack");
        };
        assert_eq!(receipt.state, MessageState::Delivered);
        assert!(receipt.is_for(&m.version), "{receipt:?}");
        assert!(receipt.updated >= before && receipt.updated <= now_secs());
        assert_eq!(receipt.expiry, receipt.updated + RETENTION);
        // Settled once: a late DELETE by the sender changes nothing.
        assert!(!settle(&*store, &uaid, &key, &m.version, MessageState::Deleted).await);
        let read = store.read_message(&uaid, &key).await.unwrap();
        assert!(
            matches!(read, Some(StoredMessage::Settled(r)) if r.state == MessageState::Delivered)
        );
        assert!(store.fetch_messages(&uaid, 10).await.unwrap().is_empty());
        assert_eq!(store.count_messages(&uaid, 10).await.unwrap(), 0);
        let next = message(chid, None, 2, 60, "next");
        store
            .save_messages(&uaid, vec![next.clone()])
            .await
            .unwrap();
        assert_eq!(store.fetch_messages(&uaid, 10).await.unwrap(), vec![next]);
        assert_eq!(store.count_messages(&uaid, 10).await.unwrap(), 1);
    }

    /// A message past its TTL is never delivered or counted, but stays
    /// readable (its receipt says `expired`); a fetch does not delete it.
    pub async fn an_expired_message_stays_for_its_receipt(store: Arc<dyn Storage>) {
        let (uaid, chid) = (Uuid::new_v4(), Uuid::new_v4());
        let expired = message(chid, None, 1, 0, "expired");
        store
            .save_messages(&uaid, vec![expired.clone()])
            .await
            .unwrap();
        assert!(store.fetch_messages(&uaid, 10).await.unwrap().is_empty());
        assert_eq!(store.count_messages(&uaid, 10).await.unwrap(), 0);
        let (key, deleted) = (expired.sort_key(), MessageState::Deleted);
        assert!(!settle(&*store, &uaid, &key, &expired.version, deleted).await);
        // What the `expired` receipt needs: the pending message by its
        // version. Its body may be gone already where the backend collects
        // expired cells on its own (Bigtable's GC).
        match store
            .read_message(&uaid, &expired.sort_key())
            .await
            .unwrap()
        {
            Some(StoredMessage::Pending(kept)) => {
                assert_eq!(
                    (kept.version, kept.channel_id, kept.ttl),
                    (expired.version, expired.channel_id, expired.ttl)
                )
            }
            other => panic!("expected the pending message, read {other:?}"),
        }
    }

    /// Expired is final: no settle (an ack, a mailbox ack, a sender's
    /// delete) takes a message past its TTL, plain, Topic or direct. With
    /// receipts on its row stays pending, so its receipt says `expired`.
    pub async fn an_expired_message_is_never_settled(store: Arc<dyn Storage>) {
        let (uaid, chid) = (user(&*store).await, Uuid::new_v4());
        let lapsed = |topic, ts, data| {
            let mut m = message(chid, topic, ts, 60, data);
            m.timestamp -= 120;
            m
        };
        let (plain, topic, direct) = (
            lapsed(None, 1, "plain"),
            lapsed(Some("t"), 2, "topic"),
            lapsed(None, 3, "direct"),
        );
        store
            .save_messages(&uaid, vec![plain.clone(), topic.clone()])
            .await
            .unwrap();
        store.save_direct(&uaid, direct.clone()).await.unwrap();
        use MessageState::*;
        for m in [&plain, &topic, &direct] {
            let key = m.sort_key();
            for state in [Delivered, Fetched, Deleted, Gone] {
                let settled = settle(&*store, &uaid, &key, &m.version, state).await;
                assert!(!settled, "{:?} settled {state:?}", m.data);
            }
            match store.read_message(&uaid, &key).await.unwrap() {
                None => {}
                Some(StoredMessage::Pending(kept)) if kept.version == m.version => {}
                other => panic!("{:?} left {other:?}", m.data),
            }
        }
        assert!(store.fetch_messages(&uaid, 10).await.unwrap().is_empty());
    }

    /// A removed user's pending messages leave `gone` receipts; its
    /// receipts and expired messages stay until their own expiry; nothing
    /// is fetched or counted for it.
    pub async fn a_removed_users_messages_are_gone(store: Arc<dyn Storage>) {
        let (uaid, chid) = (Uuid::new_v4(), Uuid::new_v4());
        let user = User::new_webpush(uaid, "http://a", now_secs() * 1000);
        store.add_user(&user).await.unwrap();
        assert!(store.add_channel(&uaid, &chid, 10).await.unwrap());
        let pending = message(chid, None, 1, 60, "pending");
        let acked = message(chid, None, 2, 60, "acked");
        let expired = message(chid, None, 3, 0, "expired");
        store
            .save_messages(&uaid, vec![pending.clone(), acked.clone(), expired.clone()])
            .await
            .unwrap();
        let delivered = MessageState::Delivered;
        assert!(settle(&*store, &uaid, &acked.sort_key(), &acked.version, delivered).await);
        store.remove_user(&uaid).await.unwrap();
        let state = async |m: &Notification| match store
            .read_message(&uaid, &m.sort_key())
            .await
            .unwrap()
        {
            Some(StoredMessage::Settled(r)) => Some(r.state),
            Some(StoredMessage::Pending(_)) => None,
            None => panic!("{:?} left nothing", m.data),
        };
        assert_eq!(state(&pending).await, Some(MessageState::Gone));
        assert_eq!(state(&acked).await, Some(MessageState::Delivered));
        // Pending past its TTL, or (where the removal takes it) its
        // `expired` receipt: either says `expired`.
        assert!(matches!(
            state(&expired).await,
            None | Some(MessageState::Expired)
        ));
        assert!(store.get_user(&uaid).await.unwrap().is_none());
        assert!(store.get_channels(&uaid).await.unwrap().is_empty());
        assert!(store.fetch_messages(&uaid, 10).await.unwrap().is_empty());
    }

    /// A message saved for direct delivery (`save_direct`, which a backend
    /// may keep apart from its message table) reads, counts, fetches in
    /// key order among stored ones, and settles like a stored one, only
    /// for its version and only once.
    pub async fn direct_messages_read_and_settle_like_stored_ones(store: Arc<dyn Storage>) {
        let (uaid, chid) = (user(&*store).await, Uuid::new_v4());
        let (first, direct, last) = (
            message(chid, None, 1, 60, "first"),
            message(chid, None, 2, 60, "direct"),
            message(chid, None, 3, 60, "last"),
        );
        store
            .save_messages(&uaid, vec![first.clone()])
            .await
            .unwrap();
        store.save_direct(&uaid, direct.clone()).await.unwrap();
        store
            .save_messages(&uaid, vec![last.clone()])
            .await
            .unwrap();
        let key = direct.sort_key();
        assert_eq!(
            store.read_message(&uaid, &key).await.unwrap(),
            Some(StoredMessage::Pending(direct.clone()))
        );
        assert_eq!(
            data(&store.fetch_messages(&uaid, 10).await.unwrap()),
            ["first", "direct", "last"]
        );
        assert_eq!(
            data(&store.fetch_messages(&uaid, 2).await.unwrap()),
            ["first", "direct"]
        );
        assert_eq!(store.count_messages(&uaid, 10).await.unwrap(), 3);
        assert_eq!(store.count_messages(&uaid, 2).await.unwrap(), 2);
        let delivered = MessageState::Delivered;
        assert!(!settle(&*store, &uaid, &key, "another version", delivered).await);
        assert!(settle(&*store, &uaid, &key, &direct.version, delivered).await);
        assert!(!settle(&*store, &uaid, &key, &direct.version, delivered).await);
        assert!(matches!(
            store.read_message(&uaid, &key).await.unwrap(),
            None | Some(StoredMessage::Settled(_))
        ));
        assert_eq!(
            data(&store.fetch_messages(&uaid, 10).await.unwrap()),
            ["first", "last"]
        );
        assert_eq!(store.count_messages(&uaid, 10).await.unwrap(), 2);
        // A sender's DELETE of a direct message removes it, on its version.
        let deleted = message(chid, None, 4, 60, "deleted");
        store.save_direct(&uaid, deleted.clone()).await.unwrap();
        let key = deleted.sort_key();
        assert!(
            !store
                .remove_message(&uaid, &key, "another version")
                .await
                .unwrap()
        );
        assert!(
            store
                .remove_message(&uaid, &key, &deleted.version)
                .await
                .unwrap()
        );
        assert_eq!(store.count_messages(&uaid, 10).await.unwrap(), 2);
    }

    /// With receipts on, an acked direct message leaves its receipt, and a
    /// removed user's unacked direct messages leave `gone` receipts.
    pub async fn direct_messages_leave_receipts(store: Arc<dyn Storage>) {
        let (uaid, chid) = (Uuid::new_v4(), Uuid::new_v4());
        let user = User::new_webpush(uaid, "http://a", now_secs() * 1000);
        store.add_user(&user).await.unwrap();
        let (acked, pending) = (
            message(chid, None, 1, 60, "acked"),
            message(chid, None, 2, 60, "pending"),
        );
        store.save_direct(&uaid, acked.clone()).await.unwrap();
        store.save_direct(&uaid, pending.clone()).await.unwrap();
        let delivered = MessageState::Delivered;
        assert!(settle(&*store, &uaid, &acked.sort_key(), &acked.version, delivered).await);
        let state = async |m: &Notification| match store
            .read_message(&uaid, &m.sort_key())
            .await
            .unwrap()
        {
            Some(StoredMessage::Settled(r)) => {
                assert!(r.is_for(&m.version), "{r:?}");
                Some(r.state)
            }
            Some(StoredMessage::Pending(_)) => None,
            None => panic!("{:?} left nothing", m.data),
        };
        assert_eq!(state(&acked).await, Some(MessageState::Delivered));
        assert_eq!(state(&pending).await, None);
        store.remove_user(&uaid).await.unwrap();
        assert_eq!(state(&pending).await, Some(MessageState::Gone));
        assert_eq!(state(&acked).await, Some(MessageState::Delivered));
        assert!(store.fetch_messages(&uaid, 10).await.unwrap().is_empty());
    }

    /// A newer message with the same Topic takes the place of an older
    /// one's receipt, and is delivered.
    pub async fn a_topic_message_replaces_a_receipt(store: Arc<dyn Storage>) {
        let (uaid, chid) = (Uuid::new_v4(), Uuid::new_v4());
        let t1 = message(chid, Some("score"), 1, 60, "t1");
        let t2 = message(chid, Some("score"), 2, 60, "t2");
        store.save_messages(&uaid, vec![t1.clone()]).await.unwrap();
        let delivered = MessageState::Delivered;
        assert!(settle(&*store, &uaid, &t1.sort_key(), &t1.version, delivered).await);
        store.save_messages(&uaid, vec![t2.clone()]).await.unwrap();
        assert_eq!(
            store.read_message(&uaid, &t2.sort_key()).await.unwrap(),
            Some(StoredMessage::Pending(t2.clone()))
        );
        assert_eq!(store.fetch_messages(&uaid, 10).await.unwrap(), vec![t2]);
    }

    /// The receipt of message `m`, wherever it is kept: the message's row,
    /// or for a Topic message, a row of its own (once a newer message took
    /// the Topic's row, or wherever the backend keeps it).
    async fn receipt_of(
        store: &dyn Storage,
        uaid: &Uuid,
        m: &Notification,
    ) -> Option<MessageState> {
        let own = receipt_key(&m.sort_key(), &m.version);
        for key in std::iter::once(m.sort_key()).chain(own) {
            if let Some(StoredMessage::Settled(r)) = store.read_message(uaid, &key).await.unwrap()
                && r.is_for(&m.version)
            {
                return Some(r.state);
            }
        }
        None
    }

    /// The messages of [`settle_a_mixed_batch`], by what the batch does to
    /// each.
    struct MixedBatch {
        uaid: Uuid,
        /// Settled: a plain message and the Topic's newest.
        settled: [Notification; 2],
        /// Left as they were: one named with a stale version, one past its
        /// TTL.
        pending: [Notification; 2],
        /// Not settled: replaced under its Topic before the batch.
        replaced: Notification,
    }

    /// One user's batch of a plain message (twice), one under a stale
    /// version, a Topic message replaced since and its replacement, a
    /// message never stored and one past its TTL; each settles only if
    /// it matches, as one settle at a time would. Another user's batch
    /// naming them settles none.
    async fn settle_a_mixed_batch(store: &dyn Storage) -> MixedBatch {
        let (uaid, other_user, chid) = (user(store).await, user(store).await, Uuid::new_v4());
        let plain = message(chid, None, 1, 60, "plain");
        let stale = message(chid, None, 2, 60, "stale");
        let (t1, t2) = (
            message(chid, Some("score"), 3, 60, "t1"),
            message(chid, Some("score"), 4, 60, "t2"),
        );
        let never_stored = message(chid, None, 5, 60, "never stored");
        let mut lapsed = message(chid, None, 6, 60, "lapsed");
        lapsed.timestamp -= 120;
        for m in [&plain, &stale, &t1, &lapsed] {
            store.save_messages(&uaid, vec![m.clone()]).await.unwrap();
        }
        store.save_messages(&uaid, vec![t2.clone()]).await.unwrap();
        let pair = |m: &Notification| (m.sort_key(), m.version.clone());
        let delivered = MessageState::Delivered;
        let others = [pair(&plain), pair(&t2)];
        let settled = store.settle_messages(&other_user, &others, delivered);
        assert_eq!(settled.await.unwrap(), [false, false], "another user's");
        let batch = [
            pair(&plain),
            (stale.sort_key(), "a stale version".to_owned()),
            pair(&t1),
            pair(&never_stored),
            pair(&lapsed),
            pair(&t2),
            pair(&plain),
        ];
        let settled = store.settle_messages(&uaid, &batch, delivered);
        let settled = settled.await.unwrap();
        assert_eq!(
            settled,
            [true, false, false, false, false, true, false],
            "settled, in the batch's order"
        );
        let none = store.settle_messages(&uaid, &[], delivered).await.unwrap();
        assert!(none.is_empty());
        MixedBatch {
            uaid,
            settled: [plain, t2],
            pending: [stale, lapsed],
            replaced: t1,
        }
    }

    /// With receipts off, a batch deletes what it settles and nothing else.
    pub async fn a_batch_settles_only_what_matches(store: Arc<dyn Storage>) {
        let b = settle_a_mixed_batch(&*store).await;
        for m in &b.settled {
            let row = store.read_message(&b.uaid, &m.sort_key()).await.unwrap();
            assert_eq!(row, None, "{:?} left", m.data);
        }
        let [stale, lapsed] = &b.pending;
        let row = store
            .read_message(&b.uaid, &stale.sort_key())
            .await
            .unwrap();
        assert_eq!(row, Some(StoredMessage::Pending(stale.clone())));
        // A backend's own expiry may have taken the lapsed one.
        match store
            .read_message(&b.uaid, &lapsed.sort_key())
            .await
            .unwrap()
        {
            None => {}
            Some(StoredMessage::Pending(kept)) if kept.version == lapsed.version => {}
            other => panic!("the lapsed message left {other:?}"),
        }
        assert_eq!(
            data(&store.fetch_messages(&b.uaid, 10).await.unwrap()),
            ["stale"]
        );
    }

    /// With receipts on, a batch leaves a `delivered` receipt of each
    /// message it settles, a Topic message's under its own key, and of no
    /// other.
    pub async fn a_batch_leaves_receipts_of_what_it_settles(store: Arc<dyn Storage>) {
        let b = settle_a_mixed_batch(&*store).await;
        let delivered = Some(MessageState::Delivered);
        for m in &b.settled {
            assert_eq!(
                receipt_of(&*store, &b.uaid, m).await,
                delivered,
                "{:?}",
                m.data
            );
        }
        for m in &b.pending {
            assert_eq!(receipt_of(&*store, &b.uaid, m).await, None, "{:?}", m.data);
        }
        let replaced = receipt_of(&*store, &b.uaid, &b.replaced).await;
        assert_eq!(replaced, Some(MessageState::Replaced));
        assert_eq!(
            data(&store.fetch_messages(&b.uaid, 10).await.unwrap()),
            ["stale"]
        );
    }

    /// A direct message acked before any copy of it was written leaves its
    /// receipt where no row is; where a copy was written after all, the
    /// copy is settled instead. Neither is fetched again.
    /// (Asked only of a store whose nodes hold copies back.)
    pub async fn an_unwritten_direct_message_leaves_its_receipt(store: Arc<dyn Storage>) {
        if !store.node_holds_direct_copies() {
            return;
        }
        let (uaid, chid) = (Uuid::new_v4(), Uuid::new_v4());
        let never_written = message(chid, None, 1, 60, "unwritten");
        let topic = message(chid, Some("t"), 2, 60, "topic");
        let written = message(chid, None, 3, 60, "written");
        store.save_direct(&uaid, written.clone()).await.unwrap();
        for m in [&never_written, &topic, &written] {
            store
                .settle_unwritten(&uaid, m, MessageState::Delivered)
                .await
                .unwrap();
            assert_eq!(
                receipt_of(&*store, &uaid, m).await,
                Some(MessageState::Delivered),
                "{:?}",
                m.data
            );
        }
        assert!(store.fetch_messages(&uaid, 10).await.unwrap().is_empty());
    }

    /// A Topic message's receipt outlives the Topic's row: delivered stays
    /// delivered after a newer message with the Topic arrives; one replaced
    /// while pending says replaced (expired, if its TTL ran out first),
    /// even after the message that replaced it is settled in turn; removal
    /// and sender deletes keep theirs too.
    pub async fn topic_receipts_survive_newer_messages(store: Arc<dyn Storage>) {
        let (uaid, chid) = (Uuid::new_v4(), Uuid::new_v4());
        let topic = |ts, ttl, data| message(chid, Some("score"), ts, ttl, data);
        let (delivered, replaced, deleted) =
            (topic(1, 60, "d"), topic(2, 60, "r"), topic(3, 60, "x"));
        let (lapsed, last) = (topic(4, 0, "l"), topic(5, 60, "g"));
        let save =
            async |m: &Notification| store.save_messages(&uaid, vec![m.clone()]).await.unwrap();
        save(&delivered).await;
        let key = delivered.sort_key();
        assert!(
            settle(
                &*store,
                &uaid,
                &key,
                &delivered.version,
                MessageState::Delivered
            )
            .await
        );
        save(&replaced).await;
        save(&deleted).await;
        assert!(
            settle(
                &*store,
                &uaid,
                &key,
                &deleted.version,
                MessageState::Deleted
            )
            .await
        );
        save(&lapsed).await;
        save(&last).await;
        let user = User::new_webpush(uaid, "http://a", now_secs() * 1000);
        store.add_user(&user).await.unwrap();
        store.remove_user(&uaid).await.unwrap();
        let states = [
            receipt_of(&*store, &uaid, &delivered).await,
            receipt_of(&*store, &uaid, &replaced).await,
            receipt_of(&*store, &uaid, &deleted).await,
            receipt_of(&*store, &uaid, &lapsed).await,
            receipt_of(&*store, &uaid, &last).await,
        ];
        use MessageState::*;
        assert_eq!(
            states,
            [
                Some(Delivered),
                Some(Replaced),
                Some(Deleted),
                Some(Expired),
                Some(Gone)
            ]
        );
        assert!(store.fetch_messages(&uaid, 10).await.unwrap().is_empty());
    }

    pub async fn topics_first_then_arrival_order_and_topics_replace(store: Arc<dyn Storage>) {
        let (uaid, chid) = (user(&*store).await, Uuid::new_v4());
        store
            .save_messages(
                &uaid,
                vec![
                    message(chid, None, 2, 60, "b"),
                    message(chid, None, 1, 60, "a"),
                    message(chid, Some("t"), 3, 60, "old"),
                    message(chid, None, 4, 0, "expired"),
                ],
            )
            .await
            .unwrap();
        store
            .save_messages(&uaid, vec![message(chid, Some("t"), 5, 60, "new")])
            .await
            .unwrap();
        let got = store.fetch_messages(&uaid, 10).await.unwrap();
        assert_eq!(data(&got), ["new", "a", "b"]);
        // The expired one was deleted on the way.
        assert_eq!(store.count_messages(&uaid, usize::MAX).await.unwrap(), 3);
        assert_eq!(store.fetch_messages(&uaid, 2).await.unwrap().len(), 2);

        let first = store.fetch_messages(&uaid, 1).await.unwrap().remove(0);
        assert!(
            store
                .remove_message(&uaid, &first.sort_key(), &first.version)
                .await
                .unwrap()
        );
        assert!(
            !store
                .remove_message(&uaid, &first.sort_key(), &first.version)
                .await
                .unwrap()
        );
        // Another user's messages are separate.
        assert!(
            store
                .fetch_messages(&Uuid::new_v4(), 10)
                .await
                .unwrap()
                .is_empty()
        );
    }

    /// The same message twice in one call (e.g. written back at disconnect
    /// while its durable copy is in the same batch) is stored once.
    pub async fn one_key_twice_in_a_batch_is_stored_once(store: Arc<dyn Storage>) {
        let (uaid, chid) = (user(&*store).await, Uuid::new_v4());
        let first = message(chid, None, 1, 60, "first");
        let mut again = first.clone();
        again.data = Some("again".into());
        store
            .save_messages(&uaid, vec![first, again.clone()])
            .await
            .unwrap();
        assert_eq!(store.fetch_messages(&uaid, 10).await.unwrap(), vec![again]);
    }

    /// Two endpoint nodes that stamp messages for one channel in the same
    /// microsecond give them the same key. The second must not replace the
    /// first, which was already answered 201: it is refused (its sender
    /// hears 503 and sends again), the others in its call are stored, and
    /// writing the same message again is fine.
    pub async fn a_plain_message_never_replaces_another_under_its_key(store: Arc<dyn Storage>) {
        let (uaid, chid) = (user(&*store).await, Uuid::new_v4());
        let first = message(chid, None, 42, 60, "first");
        let second = message(chid, None, 42, 60, "second");
        assert_eq!(first.sort_key(), second.sort_key());
        store
            .save_messages(&uaid, vec![first.clone()])
            .await
            .unwrap();
        let other = message(chid, None, 43, 60, "other");
        let refused = store
            .save_messages(&uaid, vec![second, other.clone()])
            .await;
        assert!(
            matches!(refused, Err(StorageError::KeyTaken(_))),
            "{refused:?}"
        );
        store
            .save_messages(&uaid, vec![first.clone()])
            .await
            .unwrap();
        assert_eq!(
            store.fetch_messages(&uaid, 10).await.unwrap(),
            vec![first, other]
        );
    }

    /// Everything a message carries comes back as it was stored.
    pub async fn messages_round_trip(store: Arc<dyn Storage>) {
        let (uaid, chid) = (user(&*store).await, Uuid::new_v4());
        let mut m = message(chid, Some("topic"), 7, 600, "body");
        m.headers = Some(
            [("encoding".to_owned(), "aes128gcm".to_owned())]
                .into_iter()
                .collect(),
        );
        m.urgency = Some(autopush_common::Urgency::Low);
        m.durable = true;
        let mut plain = message(chid, None, 8, 600, "plain");
        plain.data = None;
        store
            .save_messages(&uaid, vec![m.clone(), plain.clone()])
            .await
            .unwrap();
        assert_eq!(
            store.fetch_messages(&uaid, 10).await.unwrap(),
            vec![m, plain]
        );
    }

    /// The ack race of a Topic message: the client holds T1 unacknowledged,
    /// the sender replaces it with T2 under the same Topic, then the client
    /// acks T1. T2 must survive, and acking T2 removes it.
    pub async fn acking_a_replaced_topic_message_keeps_the_newer_one(store: Arc<dyn Storage>) {
        let (uaid, chid) = (user(&*store).await, Uuid::new_v4());
        let t1 = message(chid, Some("score"), 1, 60, "t1");
        let t2 = message(chid, Some("score"), 2, 60, "t2");
        store.save_messages(&uaid, vec![t1.clone()]).await.unwrap();
        store.save_messages(&uaid, vec![t2.clone()]).await.unwrap();
        assert!(
            !store
                .remove_message(&uaid, &t1.sort_key(), &t1.version)
                .await
                .unwrap()
        );
        assert_eq!(
            store.fetch_messages(&uaid, 10).await.unwrap(),
            vec![t2.clone()]
        );
        assert!(
            store
                .remove_message(&uaid, &t2.sort_key(), &t2.version)
                .await
                .unwrap()
        );
        assert!(store.fetch_messages(&uaid, 10).await.unwrap().is_empty());
    }

    /// An older Topic message written back late (an unacknowledged direct
    /// one stored at disconnect) never replaces a newer one already stored.
    pub async fn an_older_topic_message_never_replaces_a_newer_one(store: Arc<dyn Storage>) {
        let (uaid, chid) = (user(&*store).await, Uuid::new_v4());
        let older = message(chid, Some("score"), 1, 60, "older");
        let newer = message(chid, Some("score"), 2, 60, "newer");
        store
            .save_messages(&uaid, vec![newer.clone()])
            .await
            .unwrap();
        store.save_messages(&uaid, vec![older]).await.unwrap();
        assert_eq!(store.fetch_messages(&uaid, 10).await.unwrap(), vec![newer]);
    }

    /// Counting stops at what the caller asks for; expired messages never count.
    pub async fn counting_is_bounded_and_skips_expired_messages(store: Arc<dyn Storage>) {
        let (uaid, chid) = (user(&*store).await, Uuid::new_v4());
        let mut batch: Vec<_> = (0..10)
            .map(|i| message(chid, None, 100 + i, 60, "live"))
            .collect();
        batch.extend((0..5).map(|i| message(chid, None, i, 0, "expired")));
        store.save_messages(&uaid, batch).await.unwrap();
        assert_eq!(store.count_messages(&uaid, usize::MAX).await.unwrap(), 10);
        assert_eq!(store.count_messages(&uaid, 4).await.unwrap(), 4);
        assert_eq!(store.count_messages(&uaid, 0).await.unwrap(), 0);
    }

    /// More messages than one query page holds (the DynamoDB store here
    /// reads `dynamo::PAGE_SIZE` a page): fetching, counting and removing
    /// the user see all of them, behind more expired ones than a page.
    pub async fn large_backlogs_are_read_across_pages(store: Arc<dyn Storage>) {
        let (uaid, chid) = (user(&*store).await, Uuid::new_v4());
        let page = dynamo::PAGE_SIZE as u64;
        store.add_channel(&uaid, &chid, 10).await.unwrap();
        let mut batch: Vec<_> = (0..page * 2 + 3)
            .map(|i| message(chid, None, i, 0, "expired"))
            .collect();
        batch.extend(
            (0..page * 3 + 5).map(|i| message(chid, None, 10_000 + i, 60, &format!("m{i:03}"))),
        );
        store.save_messages(&uaid, batch).await.unwrap();
        let live = (page * 3 + 5) as usize;
        assert_eq!(store.count_messages(&uaid, usize::MAX).await.unwrap(), live);
        assert_eq!(
            store.count_messages(&uaid, live - 7).await.unwrap(),
            live - 7
        );
        let got = store.fetch_messages(&uaid, live - 2).await.unwrap();
        assert_eq!(got.len(), live - 2);
        assert_eq!(got[0].data.as_deref(), Some("m000"));
        assert_eq!(got[live - 3].data, Some(format!("m{:03}", live - 3)));
        // The expired ones were deleted on the way.
        assert_eq!(
            store.fetch_messages(&uaid, usize::MAX).await.unwrap().len(),
            live
        );
        store.remove_user(&uaid).await.unwrap();
        assert_eq!(store.count_messages(&uaid, usize::MAX).await.unwrap(), 0);
        assert!(store.get_channels(&uaid).await.unwrap().is_empty());
    }

    /// A fetch that finds an expired Topic message must not delete the newer
    /// message a sender stores under the same Topic meanwhile: it was
    /// answered 201.
    pub async fn a_fetch_never_deletes_a_topic_message_stored_meanwhile(store: Arc<dyn Storage>) {
        let (uaid, chid) = (user(&*store).await, Uuid::new_v4());
        let rounds = 300;
        let mut lost = 0;
        for round in 0..rounds {
            let ts = 2 * round + 1;
            let mut expired = message(chid, Some("t"), ts, 10, "expired");
            expired.timestamp = now_secs() - 100;
            store.save_messages(&uaid, vec![expired]).await.unwrap();
            let fresh = message(chid, Some("t"), ts + 1, 60, &format!("fresh{round}"));
            let fetch = tokio::spawn({
                let store = store.clone();
                async move { store.fetch_messages(&uaid, 10).await.unwrap() }
            });
            store
                .save_messages(&uaid, vec![fresh.clone()])
                .await
                .unwrap();
            fetch.await.unwrap();
            let stored = store.fetch_messages(&uaid, 10).await.unwrap();
            if !stored.iter().any(|m| m.version == fresh.version) {
                lost += 1;
            }
        }
        assert_eq!(
            lost, 0,
            "the accepted Topic message was lost in {lost} of {rounds} rounds"
        );
    }

    /// A user's channels are capped; re-adding one it has always succeeds.
    pub async fn channels_per_user_are_capped(store: Arc<dyn Storage>) {
        let uaid = user(&*store).await;
        let held: Vec<_> = (0..3).map(|_| Uuid::new_v4()).collect();
        for chid in &held {
            assert!(store.add_channel(&uaid, chid, 3).await.unwrap());
        }
        assert!(!store.add_channel(&uaid, &Uuid::new_v4(), 3).await.unwrap());
        assert!(store.add_channel(&uaid, &held[0], 3).await.unwrap());
        assert_eq!(store.get_channels(&uaid).await.unwrap().len(), 3);
        // Another user is not affected.
        assert!(
            store
                .add_channel(&user(&*store).await, &Uuid::new_v4(), 3)
                .await
                .unwrap()
        );
    }

    /// Registrations racing for a user's last free channels never take
    /// more than the cap between them.
    pub async fn racing_registrations_stay_within_the_cap(store: Arc<dyn Storage>) {
        const CAP: usize = 3;
        for _ in 0..5 {
            let uaid = Uuid::new_v4();
            let racers = (0..8).map(|_| {
                let store = store.clone();
                tokio::spawn(async move { store.add_channel(&uaid, &Uuid::new_v4(), CAP).await })
            });
            let added = futures_util::future::join_all(racers)
                .await
                .into_iter()
                .filter(|r| matches!(r, Ok(Ok(true))))
                .count();
            let held = store.get_channels(&uaid).await.unwrap().len();
            assert!(
                added <= CAP && held <= CAP,
                "{added} registrations said yes, {held} channels held, cap {CAP}"
            );
        }
    }

    /// A connection takes a user over only if the record still holds the
    /// `connected_at` it read; a removed user is never re-created.
    pub async fn a_connection_takes_over_only_what_it_read(store: Arc<dyn Storage>) {
        let uaid = Uuid::new_v4();
        let mut first = User::new_webpush(uaid, "http://a", 10);
        first.router_data = Some(serde_json::json!({"kept": true}));
        store.add_user(&first).await.unwrap();
        let b = User::new_webpush(uaid, "http://b", 11);
        assert!(store.take_over_user(&b, 10).await.unwrap());
        // Another connection that read the record before b wrote.
        let c = User::new_webpush(uaid, "http://c", 12);
        assert!(!store.take_over_user(&c, 10).await.unwrap());
        let stored = store.get_user(&uaid).await.unwrap().unwrap();
        assert_eq!(
            (stored.node_id.as_deref(), stored.connected_at),
            (Some("http://b"), 11)
        );
        assert_eq!(stored.router_data, first.router_data);

        // node_id is cleared only for the exact connection the endpoint saw.
        assert!(!store.remove_node_id(&uaid, "http://b", 10).await.unwrap());
        assert!(!store.remove_node_id(&uaid, "http://a", 11).await.unwrap());
        assert!(store.remove_node_id(&uaid, "http://b", 11).await.unwrap());
        assert_eq!(store.get_user(&uaid).await.unwrap().unwrap().node_id, None);
        assert!(!store.remove_node_id(&uaid, "http://b", 11).await.unwrap());

        store.remove_user(&uaid).await.unwrap();
        assert!(!store.take_over_user(&c, 11).await.unwrap());
        assert!(store.get_user(&uaid).await.unwrap().is_none());
    }

    /// The minimum urgency is written only by the connection the record
    /// names, survives its next connection, and reads as very-low when
    /// never set.
    pub async fn the_minimum_urgency_belongs_to_the_connection(store: Arc<dyn Storage>) {
        use autopush_common::Urgency;
        let uaid = Uuid::new_v4();
        store
            .add_user(&User::new_webpush(uaid, "http://a", 10))
            .await
            .unwrap();
        let min = async || store.get_user(&uaid).await.unwrap().unwrap().min_urgency;
        assert_eq!(min().await, Urgency::VeryLow);
        assert!(
            !store
                .set_min_urgency(&uaid, "http://b", 10, Urgency::High)
                .await
                .unwrap()
        );
        assert!(
            !store
                .set_min_urgency(&uaid, "http://a", 9, Urgency::High)
                .await
                .unwrap()
        );
        assert!(
            store
                .set_min_urgency(&uaid, "http://a", 10, Urgency::Low)
                .await
                .unwrap()
        );
        assert_eq!(min().await, Urgency::Low);

        // The next connection carries the minimum it read; it stays.
        let mut b = User::new_webpush(uaid, "http://b", 11);
        b.min_urgency = Urgency::Low;
        assert!(store.take_over_user(&b, 10).await.unwrap());
        assert_eq!(min().await, Urgency::Low);
        assert!(
            !store
                .set_min_urgency(&uaid, "http://a", 10, Urgency::High)
                .await
                .unwrap()
        );
        assert!(
            store
                .set_min_urgency(&uaid, "http://b", 11, Urgency::VeryLow)
                .await
                .unwrap()
        );
        assert_eq!(min().await, Urgency::VeryLow);
        store.remove_user(&uaid).await.unwrap();
        assert!(
            !store
                .set_min_urgency(&uaid, "http://b", 11, Urgency::Low)
                .await
                .unwrap()
        );
        assert!(store.get_user(&uaid).await.unwrap().is_none());
    }

    /// Connections racing to take over what they all read: exactly one
    /// wins, and the record names it. Many rounds, since a store that
    /// checks a condition apart from the write lets two win only now and
    /// then (moto did, within the first ten rounds).
    pub async fn racing_connections_leave_exactly_one(store: Arc<dyn Storage>) {
        for round in 0..40 {
            let uaid = Uuid::new_v4();
            store
                .add_user(&User::new_webpush(uaid, "http://n0", 1))
                .await
                .unwrap();
            let writes: Vec<_> = (2..=21u64)
                .map(|at| {
                    let store = store.clone();
                    tokio::spawn(async move {
                        let user = User::new_webpush(uaid, &format!("http://n{at}"), at);
                        store.take_over_user(&user, 1).await.unwrap().then_some(at)
                    })
                })
                .collect();
            let mut winners = Vec::new();
            for w in writes {
                winners.extend(w.await.unwrap());
            }
            assert_eq!(winners.len(), 1, "round {round}, winners: {winners:?}");
            let stored = store.get_user(&uaid).await.unwrap().unwrap();
            let winner = winners[0];
            assert_eq!(
                (stored.node_id, stored.connected_at),
                (Some(format!("http://n{winner}")), winner),
                "round {round}"
            );
        }
    }

    /// Marking a user alive, replacing its router data, and removing it if
    /// unchanged: each a conditional write that never re-creates a user.
    pub async fn user_changes_are_conditional_on_what_was_read(store: Arc<dyn Storage>) {
        let uaid = Uuid::new_v4();
        let mut user = User::new_webpush(uaid, "http://a", 1_700_000_000_000);
        user.router_type = RouterType::Fcm;
        user.node_id = None;
        user.router_data = Some(serde_json::json!({"token": "one", "app_id": "app"}));
        store.add_user(&user).await.unwrap();
        let chid = Uuid::new_v4();
        assert!(store.add_channel(&uaid, &chid, 10).await.unwrap());
        store
            .save_messages(&uaid, vec![message(chid, None, 1, 60, "x")])
            .await
            .unwrap();

        let later = user.last_connect + 7 * 3_600_000;
        assert!(store.touch_user(&uaid, later).await.unwrap());
        let stored = store.get_user(&uaid).await.unwrap().unwrap();
        assert!(later - stored.last_connect < 3_600_000);
        assert_eq!(stored.router_data, user.router_data);

        let two = serde_json::json!({"token": "two", "app_id": "app"});
        let three = serde_json::json!({"token": "three", "app_id": "app"});
        assert!(!store.set_router_data(&uaid, None, &three).await.unwrap());
        assert!(
            store
                .set_router_data(&uaid, user.router_data.as_ref(), &two)
                .await
                .unwrap()
        );
        // An update that read the first token lost to the one above.
        assert!(
            !store
                .set_router_data(&uaid, user.router_data.as_ref(), &three)
                .await
                .unwrap()
        );
        let stored = store.get_user(&uaid).await.unwrap().unwrap();
        assert_eq!(stored.router_data.as_ref(), Some(&two));

        // Removal on what was read before the new token: refused.
        assert!(!store.remove_user_if_unchanged(&user).await.unwrap());
        let mut moved = stored.clone();
        moved.connected_at += 1;
        assert!(!store.remove_user_if_unchanged(&moved).await.unwrap());
        assert!(store.get_user(&uaid).await.unwrap().is_some());
        assert!(store.remove_user_if_unchanged(&stored).await.unwrap());
        assert!(store.get_user(&uaid).await.unwrap().is_none());
        assert!(store.get_channels(&uaid).await.unwrap().is_empty());
        assert_eq!(store.count_messages(&uaid, usize::MAX).await.unwrap(), 0);

        // Nothing re-creates it.
        assert!(!store.touch_user(&uaid, later).await.unwrap());
        assert!(
            !store
                .set_router_data(&uaid, Some(&two), &three)
                .await
                .unwrap()
        );
        assert!(!store.remove_user_if_unchanged(&stored).await.unwrap());
        assert!(store.get_user(&uaid).await.unwrap().is_none());
    }

    /// A bridge registration keeps its router data.
    pub async fn users_round_trip(store: Arc<dyn Storage>) {
        let mut user = User::new_webpush(Uuid::new_v4(), "http://a", 1_700_000_000_000);
        user.router_type = RouterType::Fcm;
        user.node_id = None;
        user.router_data = Some(serde_json::json!({
            "token": "abc", "app_id": "app", "n": 3, "nested": {"on": true, "list": [1, "x"]}
        }));
        user.over_msg_limit = true;
        store.add_user(&user).await.unwrap();
        let stored = store.get_user(&user.uaid).await.unwrap().unwrap();
        assert_eq!(stored.router_type, RouterType::Fcm);
        assert_eq!(stored.router_data, user.router_data);
        assert_eq!(stored.node_id, None);
        assert_eq!(stored.connected_at, user.connected_at);
        assert!(stored.over_msg_limit);
        // last_connect is kept to the hour at least (DynamoDB keys it by hour).
        assert!(user.last_connect - stored.last_connect < 3_600_000);
        assert!(store.get_user(&Uuid::new_v4()).await.unwrap().is_none());
    }

    /// The wake route and the last wake-up: each one conditional write;
    /// a connection keeps them; only the node whose claim holds sends.
    pub async fn wake_routes_and_claims_are_conditional(store: Arc<dyn Storage>) {
        let uaid = Uuid::new_v4();
        let route = WakeRoute {
            router: RouterType::Fcm,
            app_id: "app1".into(),
            token: "tok:1".into(),
        };
        assert!(!store.set_wake_route(&uaid, Some(&route)).await.unwrap());
        assert!(!store.claim_wake(&uaid, 0, 5).await.unwrap());
        let user = User::new_webpush(uaid, "http://a", 1);
        store.add_user(&user).await.unwrap();
        assert!(store.set_wake_route(&uaid, Some(&route)).await.unwrap());
        let read = store.get_user(&uaid).await.unwrap().unwrap();
        assert_eq!(
            (read.wake_route.as_ref(), read.last_wake),
            (Some(&route), 0)
        );
        // Two nodes read last_wake 0: one claim holds.
        assert!(store.claim_wake(&uaid, 0, 1_000).await.unwrap());
        assert!(!store.claim_wake(&uaid, 0, 1_001).await.unwrap());
        assert!(store.claim_wake(&uaid, 1_000, 2_000).await.unwrap());
        // A connection leaves both alone.
        let mut reconnected = read.clone();
        reconnected.connected_at = 2;
        assert!(store.take_over_user(&reconnected, 1).await.unwrap());
        let read = store.get_user(&uaid).await.unwrap().unwrap();
        assert_eq!(
            (read.wake_route.as_ref(), read.last_wake),
            (Some(&route), 2_000)
        );
        // A gone token removes only the route it names.
        let newer = WakeRoute {
            token: "tok:2".into(),
            ..route.clone()
        };
        assert!(store.set_wake_route(&uaid, Some(&newer)).await.unwrap());
        assert!(!store.remove_wake_route(&uaid, &route).await.unwrap());
        assert!(store.remove_wake_route(&uaid, &newer).await.unwrap());
        let read = store.get_user(&uaid).await.unwrap().unwrap();
        assert_eq!(read.wake_route, None);
        assert_eq!(read.router_type, RouterType::WebPush);
        assert!(store.set_wake_route(&uaid, None).await.unwrap());
    }

    pub async fn channels_and_user_removal(store: Arc<dyn Storage>) {
        let (uaid, a, b) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        store
            .add_user(&User::new_webpush(uaid, "http://a", 1))
            .await
            .unwrap();
        assert!(store.add_channel(&uaid, &a, 10).await.unwrap());
        assert!(store.add_channel(&uaid, &b, 10).await.unwrap());
        assert_eq!(
            store.get_channels(&uaid).await.unwrap(),
            [a, b].into_iter().collect()
        );
        assert!(store.remove_channel(&uaid, &a).await.unwrap());
        assert!(!store.remove_channel(&uaid, &a).await.unwrap());
        assert!(!store.has_channel(&uaid, &a).await.unwrap());
        assert!(store.has_channel(&uaid, &b).await.unwrap());
        // What a push reads: the user, and whether the channel is its.
        let subscribed = |channel| {
            let store = store.clone();
            async move {
                let read = store.get_user_and_channel(&uaid, &channel).await.unwrap();
                read.map(|(user, subscribed)| (user.uaid, subscribed))
            }
        };
        assert_eq!(subscribed(a).await, Some((uaid, false)));
        assert_eq!(subscribed(b).await, Some((uaid, true)));
        assert!(store.remove_channel(&uaid, &b).await.unwrap());
        assert!(store.get_channels(&uaid).await.unwrap().is_empty());
        assert!(store.add_channel(&uaid, &b, 10).await.unwrap());
        assert!(!store.remove_channel(&Uuid::new_v4(), &b).await.unwrap());
        store
            .save_messages(&uaid, vec![message(b, None, 1, 60, "x")])
            .await
            .unwrap();

        store.remove_user(&uaid).await.unwrap();
        assert!(store.get_user(&uaid).await.unwrap().is_none());
        assert_eq!(subscribed(b).await, None);
        assert!(store.get_channels(&uaid).await.unwrap().is_empty());
        assert_eq!(store.count_messages(&uaid, usize::MAX).await.unwrap(), 0);
        store.health_check().await.unwrap();
    }
}

macro_rules! for_backend {
    ($backend:ident: $($test:ident),* $(,)?) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let backend = super::$backend().await;
                    super::suite::$test(backend.store.clone()).await;
                }
            )*
        }
    };
}

macro_rules! suite_for {
    ($($backend:ident),*) => {
        $(
            for_backend!($backend:
                topics_first_then_arrival_order_and_topics_replace,
                messages_round_trip,
                one_key_twice_in_a_batch_is_stored_once,
                a_plain_message_never_replaces_another_under_its_key,
                acking_a_replaced_topic_message_keeps_the_newer_one,
                an_older_topic_message_never_replaces_a_newer_one,
                counting_is_bounded_and_skips_expired_messages,
                large_backlogs_are_read_across_pages,
                a_fetch_never_deletes_a_topic_message_stored_meanwhile,
                channels_per_user_are_capped,
                racing_registrations_stay_within_the_cap,
                a_connection_takes_over_only_what_it_read,
                the_minimum_urgency_belongs_to_the_connection,
                racing_connections_leave_exactly_one,
                user_changes_are_conditional_on_what_was_read,
                users_round_trip,
                wake_routes_and_claims_are_conditional,
                channels_and_user_removal,
                without_receipts_settling_deletes,
                direct_messages_read_and_settle_like_stored_ones,
                an_expired_message_is_never_settled,
                a_batch_settles_only_what_matches,
            );
        )*
    };
}

suite_for!(
    embedded,
    dynamodb,
    dynalite,
    bigtable,
    postgres,
    postgres_autopush_rs_schema
);

macro_rules! receipts_for {
    ($($backend:ident),*) => {
        $(
            for_backend!($backend:
                settling_leaves_a_receipt_in_the_row,
                an_expired_message_stays_for_its_receipt,
                a_topic_message_replaces_a_receipt,
                topic_receipts_survive_newer_messages,
                a_removed_users_messages_are_gone,
                topics_first_then_arrival_order_and_topics_replace,
                counting_is_bounded_and_skips_expired_messages,
                acking_a_replaced_topic_message_keeps_the_newer_one,
                channels_and_user_removal,
                direct_messages_read_and_settle_like_stored_ones,
                direct_messages_leave_receipts,
                an_unwritten_direct_message_leaves_its_receipt,
                an_expired_message_is_never_settled,
                a_batch_leaves_receipts_of_what_it_settles,
            );
        )*
    };
}

receipts_for!(
    embedded_receipts,
    dynamodb_receipts,
    dynalite_receipts,
    bigtable_receipts,
    postgres_receipts
);
