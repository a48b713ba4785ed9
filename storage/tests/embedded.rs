//! What only the embedded store does (durability on reopen, one process per
//! file, group commits, housekeeping sweeps), on a real redb file in a temp
//! dir. The behaviour every backend shares is tested once, for all of them,
//! in tests/tests/storage.rs.

use autopush_common::{Notification, User, time::now_secs};
use autopush_storage::{Storage, StorageError, embedded::EmbeddedStore};
use uuid::Uuid;

fn message(channel_id: Uuid, topic: Option<&str>, ts: u64, ttl: u64, data: &str) -> Notification {
    Notification {
        channel_id,
        version: format!("v-{data}"),
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

#[tokio::test]
async fn data_survives_reopening_and_the_file_belongs_to_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let uaid = Uuid::new_v4();
    {
        let store = EmbeddedStore::open(dir.path()).unwrap();
        store
            .save_messages(&uaid, vec![message(Uuid::new_v4(), None, 1, 60, "kept")])
            .await
            .unwrap();
        assert!(matches!(
            EmbeddedStore::open(dir.path()),
            Err(StorageError::InUse(_))
        ));
    }
    let store = EmbeddedStore::open(dir.path()).unwrap();
    assert_eq!(
        store.fetch_messages(&uaid, 10).await.unwrap()[0]
            .data
            .as_deref(),
        Some("kept")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writes_share_commits_and_all_survive_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let users: Vec<Uuid> = (0..200).map(|_| Uuid::new_v4()).collect();
    {
        let store = std::sync::Arc::new(EmbeddedStore::open(dir.path()).unwrap());
        let writes: Vec<_> = users
            .iter()
            .enumerate()
            .map(|(i, uaid)| {
                let (store, uaid) = (store.clone(), *uaid);
                tokio::spawn(async move {
                    let chid = Uuid::new_v4();
                    store.add_channel(&uaid, &chid, 10).await.unwrap();
                    store
                        .save_messages(&uaid, vec![message(chid, None, i as u64, 60, "m1")])
                        .await
                        .unwrap();
                    store
                        .save_messages(&uaid, vec![message(chid, None, i as u64 + 1, 60, "m2")])
                        .await
                        .unwrap();
                })
            })
            .collect();
        for write in writes {
            write.await.unwrap();
        }
    }
    let store = EmbeddedStore::open(dir.path()).unwrap();
    for uaid in &users {
        assert_eq!(store.get_channels(uaid).await.unwrap().len(), 1);
        let data: Vec<_> = store
            .fetch_messages(uaid, 10)
            .await
            .unwrap()
            .into_iter()
            .map(|m| m.data.unwrap())
            .collect();
        assert_eq!(data, ["m1", "m2"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_write_does_not_take_concurrent_writes_down() {
    let dir = tempfile::tempdir().unwrap();
    let broken = Uuid::new_v4();
    {
        // A router record that is not JSON: updating it fails as corrupt.
        let db = redb::Database::create(dir.path().join("autopush.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        let users: redb::TableDefinition<u128, &[u8]> = redb::TableDefinition::new("users");
        txn.open_table(users)
            .unwrap()
            .insert(broken.as_u128(), b"not json".as_slice())
            .unwrap();
        txn.commit().unwrap();
    }
    let store = std::sync::Arc::new(EmbeddedStore::open(dir.path()).unwrap());
    let failing = {
        let store = store.clone();
        tokio::spawn(async move {
            let user = User::new_webpush(broken, "http://node", now_secs());
            store.take_over_user(&user, 0).await
        })
    };
    let others: Vec<_> = (0..50)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let uaid = Uuid::new_v4();
                store
                    .save_messages(&uaid, vec![message(Uuid::new_v4(), None, i, 60, "ok")])
                    .await
                    .unwrap();
                uaid
            })
        })
        .collect();
    assert!(matches!(
        failing.await.unwrap(),
        Err(StorageError::Corrupt(_))
    ));
    for other in others {
        let uaid = other.await.unwrap();
        assert_eq!(store.count_messages(&uaid, usize::MAX).await.unwrap(), 1);
    }
}

/// Housekeeping steps look at a bounded number of records each, and a pass
/// of steps removes every expired message and nothing else.
#[tokio::test]
async fn sweeping_removes_expired_messages_in_bounded_steps() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let mut live = Vec::new();
    for _ in 0..5 {
        let (uaid, chid) = (Uuid::new_v4(), Uuid::new_v4());
        let mut batch: Vec<_> = (0..4)
            .map(|i| message(chid, None, i, 0, "expired"))
            .collect();
        batch.push(message(chid, None, 10, 60, "live"));
        store.save_messages(&uaid, batch).await.unwrap();
        live.push(uaid);
    }
    let (mut removed, mut steps) = (0, 0);
    loop {
        let step = store.sweep_expired_messages(3).await.unwrap();
        assert!(step.removed <= 3);
        removed += step.removed;
        steps += 1;
        if step.finished_pass {
            break;
        }
    }
    assert_eq!(removed, 20);
    assert!(steps >= 25 / 3, "{steps} steps");
    for uaid in live {
        let left = store.fetch_messages(&uaid, 10).await.unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].data.as_deref(), Some("live"));
    }
    // A second pass finds nothing more.
    let step = store.sweep_expired_messages(100).await.unwrap();
    assert_eq!((step.removed, step.finished_pass), (0, true));
}

/// Idle webpush users go with their channels and messages; recent users
/// and bridge registrations stay.
#[tokio::test]
async fn sweeping_drops_idle_webpush_users_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let idle = User::new_webpush(Uuid::new_v4(), "http://a", 1_000);
    let recent = User::new_webpush(Uuid::new_v4(), "http://a", 9_000);
    let mut bridge = User::new_webpush(Uuid::new_v4(), "http://a", 1_000);
    bridge.router_type = autopush_common::RouterType::Fcm;
    for user in [&idle, &recent, &bridge] {
        store.add_user(user).await.unwrap();
        store
            .add_channel(&user.uaid, &Uuid::new_v4(), 10)
            .await
            .unwrap();
    }
    store
        .save_messages(&idle.uaid, vec![message(Uuid::new_v4(), None, 1, 60, "x")])
        .await
        .unwrap();
    let mut removed = 0;
    loop {
        let step = store.drop_idle_users(5_000, 1).await.unwrap();
        removed += step.removed;
        if step.finished_pass {
            break;
        }
    }
    assert_eq!(removed, 1);
    assert!(store.get_user(&idle.uaid).await.unwrap().is_none());
    assert!(store.get_channels(&idle.uaid).await.unwrap().is_empty());
    assert!(
        store
            .fetch_messages(&idle.uaid, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(store.get_user(&recent.uaid).await.unwrap().is_some());
    assert!(store.get_user(&bridge.uaid).await.unwrap().is_some());
}
