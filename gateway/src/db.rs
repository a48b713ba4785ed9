//! `autopush db ...`: DynamoDB maintenance for operators.

use std::time::Duration;

use clap::Subcommand;

use crate::app::open_dynamodb;
use crate::settings::{Db, Settings};

#[derive(Subcommand, Debug)]
pub enum DbCommand {
    /// Create the router and message tables (on-demand capacity, the
    /// last_connect index, TTL on expiry) unless they exist; a server
    /// without TTL (dynalite) gets a warning
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
}

pub async fn run(settings: &Settings, command: DbCommand) -> Result<(), String> {
    if settings.db != Db::DynamoDb {
        return Err(
            "`autopush db` works on --db dynamodb; the embedded store makes its own tables \
             and drops idle users itself (--drop-idle-users-after-days)"
                .into(),
        );
    }
    let store = open_dynamodb(settings).await?;
    match command {
        DbCommand::CreateTables => {
            for line in store.create_tables().await.map_err(|e| e.to_string())? {
                println!("{line}");
            }
            Ok(())
        }
        DbCommand::Preflight => {
            let found = store.preflight().await.map_err(|e| e.to_string())?;
            let warn = || {
                for warning in &found.warnings {
                    println!("warning: {warning}");
                }
            };
            let problems = &found.problems;
            if problems.is_empty() {
                // With monthly rotation, the month tables checked, by name;
                // the round trip goes through the first.
                let router = &store.tables().router;
                let messages = store.message_tables_now();
                let written = match &messages[..] {
                    [_] => "both".to_owned(),
                    _ => format!("{router} and {}", messages[0]),
                };
                println!(
                    "ready: tables {router} and {} exist with the expected keys, and these credentials can write, read and delete in {written}",
                    messages.join(", ")
                );
                warn();
                return Ok(());
            }
            for problem in problems {
                println!("missing: {problem}");
            }
            warn();
            Err(format!("preflight found {} problem(s)", problems.len()))
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
    }
}
