//! The direct journal under faults, on the real binary: its writes and
//! syncs failing (libfiu's preload libraries, as `fiu-run -x` loads them,
//! toggled in the running node with `fiu-ctrl`), and a journal file damaged
//! between runs. Whatever happens, every push answered 201 is delivered
//! after a `kill -9` and a restart, or the node refuses to start and says
//! how to go on.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use autopush_tests::http::get;
use autopush_tests::server::run_autopush;
use autopush_tests::*;

const FIU_LIBS: &str = "/usr/lib/fiu/fiu_run_preload.so /usr/lib/fiu/fiu_posix_preload.so";

/// A node with libfiu's POSIX wrappers loaded, no failure enabled yet, and
/// its control FIFO under `dir`.
async fn node_under_fiu(dir: &Path) -> Server {
    assert!(
        Path::new("/usr/lib/fiu/fiu_posix_preload.so").exists(),
        "libfiu's preload libraries not found (apt-get install fiu-utils)"
    );
    let fifo = dir.join("fiu-ctrl").display().to_string();
    let env = [
        ("LD_PRELOAD", FIU_LIBS),
        ("FIU_CTRL_FIFO", fifo.as_str()),
        ("FIU_ENABLE", ""),
    ];
    Server::start_with_env(&[], &env).await
}

/// Run a `fiu-ctrl` command in the node.
fn fiu_ctrl(server: &Server, dir: &Path, command: &str) {
    let fifo = dir.join("fiu-ctrl");
    let out = Command::new("fiu-ctrl")
        .arg("-f")
        .arg(&fifo)
        .args(["-c", command])
        .arg(server.pid().to_string())
        .output()
        .expect("run fiu-ctrl (apt-get install fiu-utils)");
    assert!(
        out.status.success(),
        "fiu-ctrl -c {command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether the node's endpoint health answers 200.
async fn healthy(server: &Server) -> bool {
    get(&format!("{}/health", server.endpoint_base()))
        .await
        .status
        == 200
}

/// Push `n` texts named after `tag` to a connected client that does not
/// ack (so each is written to the journal and synced): the texts answered
/// 201. Any other answer must be 503.
async fn push_some(sub: &Subscription, tag: &str, n: usize) -> (BTreeSet<String>, usize) {
    let (mut created, mut refused) = (BTreeSet::new(), 0);
    for i in 0..n {
        let text = format!("{tag} {i}");
        let res = sub.send(&SendOptions::text(&text)).await;
        match res.status {
            201 => {
                created.insert(text);
            }
            503 => refused += 1,
            other => panic!("{text}: answered {other} {}", res.body),
        }
    }
    (created, refused)
}

/// Restart after `kill -9` and receive until every text of `want` came
/// (others, answered 503, may come too).
async fn all_delivered_after_kill9(
    server: &mut Server,
    uaid: &str,
    sub: &Subscription,
    want: &BTreeSet<String>,
) {
    server.kill9();
    server.restart().await;
    let mut ws = server.reconnect(uaid).await;
    let mut missing = want.clone();
    while !missing.is_empty() {
        let (notif, d) = sub.receive(&mut ws).await;
        ws.ack_notification(&notif).await;
        missing.remove(&d.text);
    }
}

/// One failure point on for a while under load, then off: pushes answered
/// while it is on are 201 or 503, and every 201 is delivered after a
/// `kill -9`. Returns how many were refused.
async fn under(point: &str, errno: i32) -> usize {
    let dir = tempfile::tempdir().unwrap();
    let mut server = node_under_fiu(dir.path()).await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    let (mut created, _) = push_some(&sub, "before", 2).await;
    assert_eq!(created.len(), 2, "refused without a fault");
    fiu_ctrl(
        &server,
        dir.path(),
        &format!("enable name={point},failinfo={errno}"),
    );
    let (during, refused) = push_some(&sub, "during", 4).await;
    let unhealthy = !healthy(&server).await;
    fiu_ctrl(&server, dir.path(), &format!("disable name={point}"));
    if refused > 0 {
        assert!(unhealthy, "{point}: pushes refused, yet health said 200");
    }
    created.extend(during);
    drop(ws);
    all_delivered_after_kill9(&mut server, &uaid, &sub, &created).await;
    refused
}

#[tokio::test]
async fn a_failing_fdatasync_refuses_pushes_and_loses_none() {
    // EIO: the journal's (and redb's) data syncs fail.
    let refused = under("posix/io/sync/fdatasync", 5).await;
    assert!(refused > 0, "no push was refused while every sync failed");
}

#[tokio::test]
async fn a_disk_full_on_write_refuses_pushes_and_loses_none() {
    // ENOSPC on every pwrite (the journal's and redb's writes).
    let refused = under("posix/io/rw/pwrite", 28).await;
    assert!(refused > 0, "no push was refused while every write failed");
}

#[tokio::test]
async fn short_writes_lose_nothing() {
    // pwrite writing less than asked: written again from where it stopped.
    under("posix/io/rw/pwrite/reduce", 0).await;
}

/// A journal damaged between runs: a flipped bit in a record with whole
/// records after it. The node refuses to start, naming the file and the
/// offset; `autopush db replay-journal` on the file moved aside reads the
/// rest, and the node then delivers it.
#[tokio::test]
async fn a_damaged_journal_stops_the_node_and_replay_journal_recovers_the_rest() {
    let mut server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    let (created, _) = push_some(&sub, "kept", 3).await;
    assert_eq!(created.len(), 3);
    server.kill9();
    let journal = server.data_dir().join("direct.journal");
    let mut bytes = std::fs::read(&journal).unwrap();
    // The second message's record: 8-aligned after the first (past the 4
    // KiB page), its JSON 20 bytes in (each batch also starts with a
    // record of how far the file was synced).
    let magic = [0xa7, 0x4a, 0x9c, 0xf1];
    let starts: Vec<usize> = (4096..bytes.len() - 26)
        .step_by(8)
        .filter(|at| bytes[*at..*at + 4] == magic && bytes[*at + 20..].starts_with(b"{\"Put\""))
        .collect();
    assert!(
        starts.len() >= 3,
        "{} messages in the journal",
        starts.len()
    );
    bytes[starts[1] + 20] ^= 0x01;
    std::fs::write(&journal, &bytes).unwrap();
    let db = server.data_dir().display().to_string();
    let out = run_autopush(&[
        "--db",
        &db,
        "--port",
        "1",
        "--router-port",
        "2",
        "--endpoint-port",
        "3",
    ])
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the node started on a damaged journal"
    );
    assert!(
        stderr.contains(&journal.display().to_string())
            && stderr.contains(&format!("offset {}", starts[1]))
            && stderr.contains("replay-journal"),
        "{stderr}"
    );
    let aside = server.data_dir().join("direct.journal.unreadable");
    std::fs::rename(&journal, &aside).unwrap();
    let aside = aside.display().to_string();
    let out = run_autopush(&["db", "replay-journal", &aside, "--db", &db]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("offset {}", starts[1])),
        "{stdout}"
    );
    server.restart().await;
    let mut ws = server.reconnect(&uaid).await;
    let mut got = BTreeSet::new();
    for _ in 0..2 {
        let (notif, d) = sub.receive(&mut ws).await;
        ws.ack_notification(&notif).await;
        got.insert(d.text);
    }
    assert_eq!(
        got,
        BTreeSet::from(["kept 0".to_string(), "kept 2".to_string()])
    );
}

/// `kill -9` at random points of a load that rotates the journal every
/// few pushes (1 KiB) and settles with receipts on, round after round.
/// The model: every push answered 201 and not acked is delivered after the
/// restart (none lost); an acked one may come again (its tombstone waits
/// 10 ms in memory), unless its receipt has read `delivered` after a
/// restart: that receipt is in the store, and never goes back.
/// `JOURNAL_CRASH_ROUNDS` (default 2) makes the hunt longer,
/// `JOURNAL_CRASH_SEED` repeats one.
#[tokio::test]
async fn kill9_at_random_points_loses_nothing_and_no_receipt_goes_back() {
    // A receipt's state; "gone" for a 404 (a receipt whose tombstone a
    // kill took within its 10 ms, as README says).
    let state_of = async |location: &str| {
        let reply = get(location).await;
        match reply.status {
            404 => "gone".to_owned(),
            _ => autopush_tests::receipt::state(&reply),
        }
    };
    use autopush_tests::env_or;
    use std::collections::BTreeMap;
    let rounds = env_or("JOURNAL_CRASH_ROUNDS", 2);
    let seed = env_or("JOURNAL_CRASH_SEED", fastrand::u64(..));
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut server = Server::start_with_env(
        &["--receipt-retention", "3600"],
        &[("AUTOPUSH_TEST_JOURNAL_ROTATE_AT", "1024")],
    )
    .await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    // text -> Location, of pushes answered 201.
    let (mut unacked, mut acked) = (BTreeMap::new(), BTreeMap::new());
    let mut durable = BTreeSet::new();
    for round in 0..rounds {
        for i in 0..rng.usize(2..7) {
            let text = format!("round {round} push {i}");
            let res = sub.send(&SendOptions::text(&text)).await;
            let location = res.assert_created().header("location").unwrap().to_owned();
            // An acked push may come again after a restart: acked again.
            let (notif, d) = loop {
                let (notif, d) = sub.receive(&mut ws).await;
                if d.text == text {
                    break (notif, d);
                }
                assert!(
                    acked.contains_key(&d.text),
                    "seed {seed}: {} unexpected",
                    d.text
                );
                assert!(
                    !durable.contains(&d.text),
                    "seed {seed}: {} came back",
                    d.text
                );
                ws.ack_notification(&notif).await;
            };
            if rng.bool() {
                ws.ack_notification(&notif).await;
                acked.insert(d.text, location);
            } else {
                unacked.insert(text, location);
            }
        }
        // Somewhere among the acks' tombstones, rotations, checkpoints.
        tokio::time::sleep(std::time::Duration::from_millis(rng.u64(0..30))).await;
        drop(ws);
        server.kill9();
        server.restart().await;
        for text in &durable {
            let state = state_of(&acked[text]).await;
            assert_eq!(
                state, "delivered",
                "seed {seed}, round {round}: {text}'s receipt went back"
            );
        }
        for (text, location) in &acked {
            if state_of(location).await == "delivered" {
                durable.insert(text.clone());
            }
        }
        ws = server.reconnect(&uaid).await;
        while !unacked.is_empty() {
            let (notif, d) = sub.receive(&mut ws).await;
            assert!(
                !durable.contains(&d.text),
                "seed {seed}, round {round}: {} came back after its receipt was stored",
                d.text
            );
            ws.ack_notification(&notif).await;
            if let Some(location) = unacked.remove(&d.text) {
                acked.insert(d.text, location);
            }
        }
    }
}
