//! `autopush`: a Web Push service (Mozilla autopush compatible).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use autopush_gateway::app::{self, Mode};
use autopush_gateway::settings::{Settings, SettingsLayer};
use autopush_gateway::{check, db, diagnose, logging};
use clap::{Parser, Subcommand};
use db::DbCommand;

#[derive(Parser)]
#[command(
    name = "autopush",
    version,
    about = "A Web Push service, compatible with Mozilla autopush"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// TOML settings file (keys as the flags, with underscores)
    #[arg(long, env = "AUTOPUSH_CONFIG", global = true)]
    config: Option<PathBuf>,
    #[command(flatten)]
    settings: SettingsLayer,
}

#[derive(Subcommand)]
enum Command {
    /// Connection and endpoint node in one process, on the embedded store (default)
    All,
    /// Connection node only: websockets and the internal router API
    Connection,
    /// Endpoint node only: the public HTTP API
    Endpoint,
    /// Print a new endpoint crypto key
    Keygen,
    /// Decode a push endpoint URL and show the subscription behind it
    Diagnose { url: String },
    /// Test a running service end to end, as a user agent and an application
    /// server: subscribe, push in both encodings, decrypt, offline delivery, 410
    Check {
        /// The service's websocket URL, as Firefox's dom.push.serverURL holds it
        /// (e.g. ws://localhost:8080/)
        url: String,
        /// Seconds any single wait may take before its check fails
        #[arg(long, default_value_t = 10.0)]
        timeout: f64,
        /// The VAPID `sub` claim (a contact) of the test pushes
        #[arg(long, default_value = "mailto:autopush-check@example.com")]
        vapid_sub: String,
        /// A CA certificate (PEM) to trust for wss:// and https://, beyond
        /// the system's roots (for a private CA)
        #[arg(long, value_name = "FILE")]
        ca: Option<PathBuf>,
    },
    /// DynamoDB maintenance (with --db dynamodb)
    Db {
        #[command(subcommand)]
        action: DbCommand,
    },
}

/// mimalloc, not glibc's malloc: what a task allocates on one worker thread
/// is often freed on the other, and glibc then locks the first thread's
/// arena. At 4 000 pushes/s mimalloc took the server's `futex` calls from
/// 1.0 to 0.5 per push, and from 1.7 to 0.5 with durable delivery. Built
/// without transparent huge pages (`no_thp`), which raised the memory of
/// idle connections by a quarter.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let command = cli.command.unwrap_or(Command::All);
    if let Command::Keygen = command {
        println!("{}", autopush_common::endpoint::generate_key());
        return ExitCode::SUCCESS;
    }
    if let Command::Check {
        url,
        timeout,
        vapid_sub,
        ca,
    } = command
    {
        return run_check(url, timeout, vapid_sub, ca);
    }
    let settings = match Settings::resolve(cli.settings, cli.config.as_deref()) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("autopush: {e}");
            return ExitCode::from(2);
        }
    };
    logging::init(settings.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("autopush: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match command {
            Command::All => app::run(Mode::All, settings).await,
            Command::Connection => app::run(Mode::Connection, settings).await,
            Command::Endpoint => app::run(Mode::Endpoint, settings).await,
            Command::Diagnose { url } => {
                let found = diagnose::run(&settings, &url).await?;
                println!(
                    "{}",
                    serde_json::to_string_pretty(&found.report).unwrap_or_default()
                );
                match found.user_error {
                    Some(e) => Err(format!("could not read the user: {e}")),
                    None => Ok(()),
                }
            }
            Command::Db { action } => db::run(&settings, action).await,
            Command::Keygen | Command::Check { .. } => Ok(()),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("autopush: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `autopush check`: needs no settings of its own service, only the URL.
fn run_check(url: String, timeout: f64, vapid_sub: String, ca: Option<PathBuf>) -> ExitCode {
    let Ok(wait) = Duration::try_from_secs_f64(timeout) else {
        eprintln!("autopush check: --timeout must be a positive number of seconds");
        return ExitCode::from(2);
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("autopush: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let options = check::Options {
        url,
        ca,
        wait,
        vapid_sub,
    };
    if runtime.block_on(check::run(&options)) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
