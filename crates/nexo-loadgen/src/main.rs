//! The load generator: drives a running nexo-transfers server over real HTTP
//! with one of six scenarios, prints throughput, latency percentiles and the
//! count of each answer, then checks on the database that the ledger
//! reconciles and that every intent it sent executed at most once.
//!
//! `loadgen setup` creates the principals and funded accounts the scenarios
//! use (through the server library's operator actions, `nexo_transfers::admin`,
//! so the ledger stays consistent) and writes their tokens to a fixture file;
//! `loadgen run` reads that file and sends its requests with `nexo-client`,
//! one attempt each, so that every request is measured and checked alone.

mod check;
mod fixture;
mod observation;
mod run;
mod scenario;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use nexo_transfers::config::parse_duration;

pub type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Parser)]
#[command(name = "loadgen", about = "Load generator for nexo-transfers")]
struct Cli {
    /// PostgreSQL URL of the server's database: `setup` writes to it, the
    /// checks after a run read it.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true,
          default_value = nexo_transfers::config::DEFAULT_DATABASE_URL)]
    database_url: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create principals and funded accounts on a fresh database and write
    /// their tokens to the fixture file.
    Setup(fixture::SetupArgs),
    /// Run one scenario against a server and check the ledger afterwards.
    Run(RunArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    /// Distinct keys, random accounts.
    New,
    /// The same completed intents sent again.
    Replay,
    /// Many concurrent requests per key.
    Storm,
    /// Every transfer debits one account.
    Hot,
    /// Every transfer debits one account as a hold that is then posted:
    /// two requests (the hold, its post), each under its own key.
    Hold,
    /// Mostly new intents, with retries, concurrent duplicates, reused keys
    /// and overdrafts mixed in.
    Mixed,
}

#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    #[arg(long, value_enum)]
    pub scenario: Scenario,
    /// Base URL of the server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Requests in flight at once (one connection each).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=CONCURRENCY_MAX))]
    pub concurrency: u32,
    /// How long to measure (after the warm-up), e.g. 10s.
    #[arg(long, value_parser = parse_duration, conflicts_with = "requests")]
    pub duration: Option<Duration>,
    /// How many requests to measure (after the warm-up).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=REQUESTS_MAX))]
    pub requests: Option<u64>,
    /// Unmeasured load before measuring, so connections, caches and plans
    /// are warm.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub warmup: Duration,
    /// The fixture file written by `loadgen setup`.
    #[arg(long, default_value = "target/loadgen-fixture.json")]
    pub fixture: PathBuf,
    /// Use only the first N accounts of the fixture (random accounts are
    /// drawn from these).
    #[arg(long)]
    pub accounts: Option<u32>,
    /// Requests that share one key in the `storm` scenario.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(2..=1000))]
    pub storm_fanout: u32,
    /// Completed intents the `replay` scenario creates first and then
    /// sends again.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub replay_intents: u32,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The server's process id: its peak resident memory (VmHWM) is read
    /// from /proc after the run.
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// Skip the database checks after the run.
    #[arg(long)]
    pub no_check: bool,
    /// Exit non-zero when any request failed in transport or got a 5xx,
    /// not only when a check fails.
    #[arg(long)]
    pub fail_on_errors: bool,
}

/// Bounds one run: beyond this many connections the client, not the server,
/// becomes what is measured on a small machine.
pub const CONCURRENCY_MAX: i64 = 1_024;
/// Bounds one run's memory: every request's outcome is kept for the checks.
pub const REQUESTS_MAX: u64 = 5_000_000;
/// A run without `--duration` or `--requests` measures this long.
pub const DEFAULT_DURATION: Duration = Duration::from_secs(10);

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command {
        Command::Setup(args) => fixture::setup(&cli.database_url, &args).await,
        Command::Run(args) => run::run(&cli.database_url, &args).await,
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
