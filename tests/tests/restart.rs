//! Durability: the embedded store survives SIGKILL.

use std::collections::BTreeSet;

use autopush_tests::*;

#[tokio::test]
async fn stored_messages_survive_kill9_and_restart() {
    let mut server = Server::start().await;
    let (uaid, sub) = server.offline_subscription(false).await;
    let sent = ["before the crash (aes128gcm)", "before the crash (aesgcm)"];
    sub.send(&SendOptions::text(sent[0]).encoding(Encoding::Aes128Gcm))
        .await
        .assert_created();
    sub.send(&SendOptions::text(sent[1]).encoding(Encoding::AesGcm))
        .await
        .assert_created();

    server.kill9();
    server.restart().await;

    let mut ws = server.reconnect(&uaid).await;
    let mut got = BTreeSet::new();
    for _ in 0..2 {
        let (notif, d) = sub.receive(&mut ws).await;
        ws.ack_notification(&notif).await;
        got.insert(d.text);
    }
    assert_eq!(got, sent.iter().map(|s| s.to_string()).collect());
}

#[tokio::test]
async fn subscriptions_and_clients_survive_kill9_and_restart() {
    let mut server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let plain = Subscription::new(&mut ws).await;
    let restricted = Subscription::with_vapid(&mut ws).await;

    server.kill9();
    ws.expect_closed().await;
    server.restart().await;

    // The user agent comes back; both endpoints still work (the endpoint
    // crypto key and the VAPID restriction were kept).
    let mut ws = server.reconnect(&uaid).await;
    for (sub, text) in [
        (&plain, "plain after restart"),
        (&restricted, "vapid after restart"),
    ] {
        sub.push_text(text).await;
        let (notif, d) = sub.receive(&mut ws).await;
        assert_eq!(d.text, text);
        ws.ack_notification(&notif).await;
    }
    // Nothing else was sent: nothing else arrives.
    ws.assert_nothing_arrives().await;
}

#[tokio::test]
async fn a_new_server_on_a_stopped_servers_data_dir_delivers_its_messages() {
    let mut first = Server::start().await;
    let (uaid, sub) = first.offline_subscription(false).await;
    sub.push_text("handed over").await;
    first.kill9();

    let second = Server::start_in(first.data_dir(), &[]).await;
    let mut ws = second.reconnect(&uaid).await;
    let (notif, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "handed over");
    ws.ack_notification(&notif).await;
}
