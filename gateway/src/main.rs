//! `autopush`: a Web Push service (Mozilla autopush compatible).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use autopush_common::router::RouterRegistry;
use autopush_gateway::app::{self, Mode};
use autopush_gateway::owner::Owner;
use autopush_gateway::settings::{Settings, SettingsLayer};
use autopush_gateway::sources::Sources;
use autopush_gateway::{check, db, diagnose, logging};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
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
    /// Print the effective settings (flags over environment over --config
    /// file over defaults: what `autopush all` would run with) as a TOML
    /// file that --config reads back; keys and other secrets show as
    /// "[redacted]" unless --show-secrets
    Config {
        /// Print secrets (keys, inline bridge credentials) as they are
        #[arg(long)]
        show_secrets: bool,
    },
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
    /// Store maintenance: create and check tables (DynamoDB, Bigtable), drop old users, move
    /// legacy Bigtable cells, replay a refused journal (embedded store)
    Db {
        #[command(subcommand)]
        action: DbCommand,
    },
    /// Write the manual pages, autopush(8) and one per command, into DIR
    /// (the package installs them)
    #[command(hide = true)]
    Man { dir: PathBuf },
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
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    cli.settings.sources = Sources::of_matches(&matches);
    let command = cli.command.unwrap_or(Command::All);
    if let Command::Keygen = command {
        println!("{}", autopush_common::endpoint::generate_key());
        return ExitCode::SUCCESS;
    }
    if let Command::Man { dir } = command {
        return finish(write_man_pages(&dir));
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
    let layer = match SettingsLayer::merged(cli.settings, cli.config.as_deref()) {
        Ok(layer) => layer.with_defaults(),
        Err(e) => return settings_error(&e),
    };
    if let Command::Config { show_secrets } = command {
        return print_config(&layer, show_secrets);
    }
    let (settings, problems) = Settings::checked(layer.clone());
    let mode = match command {
        Command::All => Some(Mode::All),
        Command::Connection => Some(Mode::Connection),
        Command::Endpoint => Some(Mode::Endpoint),
        _ => None,
    };
    // A service checks its keys and addresses too, and names every problem
    // together (`app::check`); a tool needs its settings right now.
    let (settings, problems) = match mode {
        Some(_) => (settings, problems),
        None => match problems.or(settings) {
            Ok(settings) => (settings, Default::default()),
            Err(e) => return settings_error(&e),
        },
    };
    logging::init(settings.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("autopush: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(mode) = mode {
        // Bridges build their clients in the runtime's context.
        let checked = match runtime.block_on(async { app::check(mode, settings, problems) }) {
            Ok(checked) => checked,
            Err(e) => return settings_error(&e),
        };
        log_settings(&layer);
        let result = runtime
            .block_on(async { checked.start(RouterRegistry::default()).await?.wait().await });
        return finish(result);
    }
    // As root on the service's data directory, what a tool writes stays
    // the service's (`owner`).
    let owner = match &settings.db {
        autopush_gateway::settings::Db::Embedded(dir) => Owner::of(dir),
        _ => Ok(None),
    };
    let owner = match owner {
        Ok(owner) => owner,
        Err(e) => return finish(Err(e)),
    };
    let result = runtime.block_on(async {
        match command {
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
            _ => Ok(()),
        }
    });
    let handed = owner.map_or(Ok(()), Owner::hand_over);
    finish(result.and(handed))
}

/// A setting (or several) that cannot work: exit code 2, as for clap's
/// own refusals.
fn settings_error(e: &str) -> ExitCode {
    eprintln!("autopush: {e}");
    ExitCode::from(2)
}

fn finish(result: Result<(), String>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("autopush: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `autopush config`: the effective settings as a settings file.
fn print_config(layer: &SettingsLayer, show_secrets: bool) -> ExitCode {
    // Checked as `autopush all` checks them, so that what is printed runs.
    if let Err(e) = Settings::from_layer(layer.clone()) {
        return settings_error(&e);
    }
    let lines = match layer.lines(show_secrets) {
        Ok(lines) => lines,
        Err(e) => return settings_error(&e),
    };
    let text = format!(
        "# autopush {}: effective settings\n{}\n",
        env!("CARGO_PKG_VERSION"),
        lines.join("\n")
    );
    // A closed pipe (`| head`) is the reader's choice, not a failure.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
    ExitCode::SUCCESS
}

/// The effective settings, first in the log, one line per setting: each
/// is found with grep, and in JSON logs each is an event of its own,
/// where one line of 60 settings would be unreadable. Secrets redacted.
fn log_settings(layer: &SettingsLayer) {
    match layer.lines(false) {
        Ok(lines) => {
            for line in &lines {
                // `# key: not set` reads as `setting key: not set`.
                let line = line.strip_prefix("# ").unwrap_or(line);
                tracing::info!("setting {line}");
            }
        }
        Err(e) => tracing::warn!("cannot show the settings: {e}"),
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

/// `autopush man DIR`: the manual pages in roff, from the command line's
/// definitions: autopush(8), with where the package puts things, and
/// autopush-COMMAND(8) for each command it lists.
fn write_man_pages(dir: &std::path::Path) -> Result<(), String> {
    fn write(dir: &std::path::Path, command: clap::Command, top: bool) -> std::io::Result<()> {
        for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
            write(dir, sub.clone(), false)?;
        }
        let man = clap_mangen::Man::new(command)
            .section("8")
            .manual("autopush");
        let mut page = Vec::new();
        man.render(&mut page)?;
        if top {
            page.extend_from_slice(MAN_FILES.as_bytes());
        }
        std::fs::write(dir.join(man.get_filename()), page)
    }
    // Built first, so that each command's page has its name (autopush-db)
    // and the options it takes from autopush (the settings).
    let mut command = Cli::command().disable_help_subcommand(true);
    command.build();
    std::fs::create_dir_all(dir)
        .and_then(|()| write(dir, command, true))
        .map_err(|e| format!("cannot write the manual pages into {}: {e}", dir.display()))
}

/// autopush(8)'s sections beyond the command line: where the package puts
/// things, and its documents.
const MAN_FILES: &str = r#".SH FILES
.TP
/etc/autopush/autopush.toml
The settings: keys as the options, with underscores. It holds no secret.
.TP
/etc/autopush/credentials/
Keys and bridge credentials, readable by root only; the unit passes them to
the service with LoadCredential=.
.TP
/etc/autopush/tls/
The TLS certificate and key, readable by the group autopush, which the
service joins.
.TP
/var/lib/autopush
The embedded store and the keys the service generates (a link to
/var/lib/private/autopush).
.TP
/usr/lib/systemd/system/autopush.service
The systemd unit.
.SH SEE ALSO
The documents in /usr/share/doc/autopush/: README.md, and in docs/ settings.md
(every setting), package.md (the service), operations.md (the commands, and a
journal the service refuses to read), tls.md and the rest.
"#;
