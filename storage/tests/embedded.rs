//! The embedded store's semantics, on a real redb file in a temp dir.

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
    }
}

#[tokio::test]
async fn messages_come_back_topics_first_then_in_order_and_topics_replace() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let (uaid, chid) = (Uuid::new_v4(), Uuid::new_v4());
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

    let got: Vec<_> = store
        .fetch_messages(&uaid, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.data.unwrap())
        .collect();
    assert_eq!(got, ["new", "a", "b"]);
    // The expired one was deleted on the way.
    assert_eq!(store.count_messages(&uaid).await.unwrap(), 3);
    assert_eq!(store.fetch_messages(&uaid, 2).await.unwrap().len(), 2);

    let first = store.fetch_messages(&uaid, 1).await.unwrap().remove(0);
    assert!(
        store
            .remove_message(&uaid, &first.sort_key())
            .await
            .unwrap()
    );
    assert!(
        !store
            .remove_message(&uaid, &first.sort_key())
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

#[tokio::test]
async fn older_connections_never_overwrite_newer_ones() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let uaid = Uuid::new_v4();
    assert!(
        store
            .update_user(&User::new_webpush(uaid, "http://a", 10))
            .await
            .unwrap()
    );
    assert!(
        !store
            .update_user(&User::new_webpush(uaid, "http://b", 5))
            .await
            .unwrap()
    );
    assert_eq!(
        store
            .get_user(&uaid)
            .await
            .unwrap()
            .unwrap()
            .node_id
            .as_deref(),
        Some("http://a")
    );

    // node_id is cleared only for the exact connection the endpoint saw.
    assert!(!store.remove_node_id(&uaid, "http://a", 9).await.unwrap());
    assert!(!store.remove_node_id(&uaid, "http://b", 10).await.unwrap());
    assert!(store.remove_node_id(&uaid, "http://a", 10).await.unwrap());
    assert_eq!(store.get_user(&uaid).await.unwrap().unwrap().node_id, None);
}

#[tokio::test]
async fn channels_and_user_removal() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let (uaid, a, b) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    store
        .add_user(&User::new_webpush(uaid, "http://a", 1))
        .await
        .unwrap();
    store.add_channel(&uaid, &a).await.unwrap();
    store.add_channel(&uaid, &b).await.unwrap();
    assert_eq!(store.get_channels(&uaid).await.unwrap().len(), 2);
    assert!(store.remove_channel(&uaid, &a).await.unwrap());
    assert!(!store.has_channel(&uaid, &a).await.unwrap());
    assert!(store.has_channel(&uaid, &b).await.unwrap());
    store
        .save_messages(&uaid, vec![message(b, None, 1, 60, "x")])
        .await
        .unwrap();

    store.remove_user(&uaid).await.unwrap();
    assert!(store.get_user(&uaid).await.unwrap().is_none());
    assert!(store.get_channels(&uaid).await.unwrap().is_empty());
    assert_eq!(store.count_messages(&uaid).await.unwrap(), 0);
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
