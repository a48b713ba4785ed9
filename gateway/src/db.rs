//! `autopush db ...`: DynamoDB, Bigtable and PostgreSQL maintenance for operators, and
//! the embedded store's recovery of a direct journal it refused.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Subcommand;

use crate::app::{open_bigtable, open_dynamodb, open_embedded, open_postgres};
use crate::settings::{Db, Settings};

#[derive(Subcommand, Debug)]
pub enum DbCommand {
    /// Create the router and message tables (on-demand capacity, the
    /// last_connect index, TTL on expiry) unless they exist, and warn on a
    /// server without TTL (dynalite); on Bigtable the table and its router,
    /// message and message_topic families with autopush-rs's GC policies; on
    /// PostgreSQL autopush-rs's tables and indexes, with our own columns
    CreateTables,
    /// Check that the tables exist and these credentials can read and write
    /// them; lists what is missing and exits non-zero if anything is (a
    /// message table without TTL is only a warning)
    Preflight,
    /// Remove webpush users last connected in the calendar month N months
    /// ago (UTC), with their subscriptions and messages
    DropOldUsers {
        /// How many months back: 2 drops the users last seen two months ago
        #[arg(long)]
        months: u32,
        /// Users removed between pauses
        #[arg(long, default_value_t = 25)]
        batch_size: usize,
        /// Seconds to pause after each batch, to stay inside the table's capacity
        #[arg(long, default_value_t = 0.2)]
        pause: f64,
    },
    /// Bigtable: move the `last_connect` and `over_msg_limit` cells older
    /// builds wrote in a user row's router family (where autopush-rs
    /// fails on them) to its message family, one conditional write per
    /// row; safe while nodes run, and again
    MoveLegacyCells,
    /// Embedded store (stopped): move every record that can be read from a
    /// direct journal file the node refused to start on, moved aside
    /// first, into the store at --db; prints what could not be read
    ReplayJournal {
        /// The journal file, moved aside (not <db>/direct.journal)
        file: PathBuf,
    },
}

const REPLAY_JOURNAL_ONLY_EMBEDDED: &str =
    "`autopush db replay-journal` works on the embedded store (--db DIR)";

pub async fn run(settings: &Settings, command: DbCommand) -> Result<(), String> {
    if let DbCommand::ReplayJournal { file } = &command {
        return match &settings.db {
            Db::Embedded(dir) => replay_journal(dir, settings.db_cache, file),
            _ => Err(REPLAY_JOURNAL_ONLY_EMBEDDED.into()),
        };
    }
    if let Db::Bigtable(bigtable) = &settings.db {
        return run_bigtable(bigtable, command).await;
    }
    if let Db::Postgres(postgres) = &settings.db {
        return run_postgres(postgres, command).await;
    }
    if let DbCommand::MoveLegacyCells = command {
        return nothing_to_move();
    }
    if settings.db != Db::DynamoDb {
        return Err(
            "`autopush db` works on --db dynamodb; the embedded store makes its own tables \
             and drops idle users itself (--drop-idle-users-after-days), and needs only \
             `autopush db replay-journal` (a journal it refused to read)"
                .into(),
        );
    }
    let store = open_dynamodb(settings).await?;
    match command {
        DbCommand::CreateTables => print_lines(store.create_tables().await),
        DbCommand::Preflight => {
            let found = store.preflight().await.map_err(|e| e.to_string())?;
            // With monthly rotation, the month tables checked, by name; the
            // round trip goes through the first.
            let router = &store.tables().router;
            let messages = store.message_tables_now();
            let written = match &messages[..] {
                [_] => "both".to_owned(),
                _ => format!("{router} and {}", messages[0]),
            };
            let result = verdict(
                &found.problems,
                format!(
                    "tables {router} and {} exist with the expected keys, and these credentials can write, read and delete in {written}",
                    messages.join(", ")
                ),
            );
            for warning in &found.warnings {
                println!("warning: {warning}");
            }
            result
        }
        DbCommand::DropOldUsers {
            months,
            batch_size,
            pause,
        } => {
            let pause = Duration::try_from_secs_f64(pause)
                .map_err(|_| "--pause must be a non-negative number of seconds".to_string())?;
            let dropped = store
                .drop_old_users(months, batch_size, pause, &mut |line| println!("{line}"))
                .await
                .map_err(|e| e.to_string())?;
            println!("dropped {dropped} users");
            Ok(())
        }
        DbCommand::MoveLegacyCells => nothing_to_move(),
        DbCommand::ReplayJournal { .. } => Err(REPLAY_JOURNAL_ONLY_EMBEDDED.into()),
    }
}

/// `db replay-journal`: what can be read of `file` into the store at `dir`.
fn replay_journal(dir: &Path, cache: usize, file: &Path) -> Result<(), String> {
    let own = dir.join("direct.journal");
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same(file, &own) {
        return Err(format!(
            "{} is the store's own journal: move it aside first (mv {0} {0}.unreadable)",
            own.display()
        ));
    }
    // Opening the store fails while a node runs on it.
    let store = open_embedded(dir, cache)?;
    let found = store.replay_journal(file).map_err(|e| e.to_string())?;
    let file = file.display();
    for at in &found.skipped {
        println!("lost: nothing whole at offset {at} of {file}, before records that were read");
    }
    match found.epoch {
        None => println!("{file} holds no whole record: nothing to move"),
        Some(epoch) => println!(
            "moved {} record(s) of epoch {epoch} from {file} into the store ({} stretch(es) lost); \
             the node can start",
            found.records,
            found.skipped.len()
        ),
    }
    Ok(())
}

/// `db create-tables` and `db preflight` on Bigtable (the table and
/// families autopush-rs's setup_bt.sh makes), and `db move-legacy-cells`.
async fn run_bigtable(
    settings: &crate::settings::BigtableSettings,
    command: DbCommand,
) -> Result<(), String> {
    let store = open_bigtable(settings).await?;
    match command {
        DbCommand::CreateTables => print_lines(store.create_tables().await),
        DbCommand::Preflight => {
            let found = store.preflight().await.map_err(|e| e.to_string())?;
            for note in &found.notes {
                println!("note: {note}");
            }
            let families = &settings.families;
            verdict(
                &found.problems,
                format!(
                    "table {} has the families {}, {} and {}, and these credentials can write, read and delete in it",
                    settings.table_name, families.router, families.message, families.message_topic
                ),
            )
        }
        DbCommand::DropOldUsers { .. } => Err(
            "`autopush db drop-old-users` works on --db dynamodb: a Bigtable table has no \
             index on last_connect to find them by"
                .into(),
        ),
        DbCommand::MoveLegacyCells => {
            let done = store
                .move_legacy_cells(&mut |line| println!("{line}"))
                .await
                .map_err(|e| e.to_string())?;
            println!("scanned {} user rows", done.scanned);
            println!(
                "moved last_connect/over_msg_limit from the router to the message family in {} rows",
                done.moved
            );
            println!(
                "skipped {} rows that changed while read (a node connected or removed the user: \
                 nothing left to move)",
                done.changed
            );
            for uaid in &done.left {
                println!("left: {uaid} changed on every try");
            }
            match done.left.len() {
                0 => Ok(()),
                n => Err(format!(
                    "{n} rows still hold router cells autopush-rs cannot read: run it again"
                )),
            }
        }
        DbCommand::ReplayJournal { .. } => Err(REPLAY_JOURNAL_ONLY_EMBEDDED.into()),
    }
}

/// `db create-tables` and `db preflight` on PostgreSQL (autopush-rs's
/// tables, and our own columns and index in them).
async fn run_postgres(
    settings: &crate::settings::PostgresSettings,
    command: DbCommand,
) -> Result<(), String> {
    let store = open_postgres(settings)?;
    match command {
        DbCommand::CreateTables => print_lines(store.create_tables().await),
        DbCommand::Preflight => {
            let found = store.preflight().await.map_err(|e| e.to_string())?;
            verdict(
                &found.problems,
                format!(
                    "tables {}, {} and {} have every column used here, and these credentials can write, read and delete in them",
                    settings.qualified(&settings.router_table),
                    settings.qualified(&settings.meta_table),
                    settings.qualified(&settings.message_table),
                ),
            )
        }
        DbCommand::DropOldUsers { .. } => Err(
            "`autopush db drop-old-users` works on --db dynamodb; on PostgreSQL the node's \
             sweep drops idle users (--drop-idle-users-after-days)"
                .into(),
        ),
        DbCommand::MoveLegacyCells => nothing_to_move(),
        DbCommand::ReplayJournal { .. } => Err(REPLAY_JOURNAL_ONLY_EMBEDDED.into()),
    }
}

/// `db move-legacy-cells` off Bigtable: only our Bigtable rows ever held
/// those cells where autopush-rs reads.
fn nothing_to_move() -> Result<(), String> {
    println!(
        "nothing to do: `autopush db move-legacy-cells` is for Bigtable (--db grpc://... or \
         bigtable); this store never held those cells"
    );
    Ok(())
}

/// What `create-tables` did, a line each.
fn print_lines(lines: autopush_storage::Result<Vec<String>>) -> Result<(), String> {
    for line in lines.map_err(|e| e.to_string())? {
        println!("{line}");
    }
    Ok(())
}

/// `preflight`'s answer: `ready: {ready}`, or each problem and an error.
fn verdict(problems: &[String], ready: String) -> Result<(), String> {
    if problems.is_empty() {
        println!("ready: {ready}");
        return Ok(());
    }
    for problem in problems {
        println!("missing: {problem}");
    }
    Err(format!("preflight found {} problem(s)", problems.len()))
}
