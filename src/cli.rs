//! The command line: `serve`, `migrate`, `purge-expired`, `reconcile` and
//! the operator commands. Each prints a clear one-line error and exits
//! non-zero on failure.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand};
use sqlx::PgPool;
use uuid::Uuid;

use crate::admin;
use crate::config::{DbConfig, EventRetentionConfig, ServeConfig};
use crate::db::{self, MissingDatabase};
use crate::http::operations::Operations;
use crate::http::{self, AppConfig, AppState};
use crate::idempotency::store;
use crate::ledger::events;
use crate::reconcile;

#[derive(Debug, Parser)]
#[command(
    name = "nexo-transfers",
    version,
    about = "Money transfers that move effectively once"
)]
pub struct Cli {
    #[command(flatten)]
    pub db: DbConfig,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create the database if needed, migrate, and serve the HTTP API.
    Serve(Box<ServeConfig>),
    /// Apply pending migrations and exit.
    Migrate,
    /// Compact idempotency records past their TTL (their outcome stays),
    /// delete those past their retention and events past theirs, and print
    /// how many.
    PurgeExpired {
        /// Records compacted or deleted per statement: each batch holds its
        /// row locks for milliseconds.
        #[arg(long, env = "NEXO_PURGE_BATCH_ROWS", default_value_t = store::PURGE_BATCH_ROWS_MAX,
              value_parser = clap::value_parser!(i64).range(1..=100_000))]
        batch_rows: i64,
        #[command(flatten)]
        events: EventRetentionConfig,
    },
    /// Check that the ledger is whole and agrees with the idempotency
    /// records. Exit status 0 when every check holds, 1 when discrepancies
    /// were found (each listed), 2 when the checks could not run.
    Reconcile(ReconcileArgs),
    /// Create a principal and print its bearer token (shown only once).
    CreatePrincipal {
        /// A unique name, 1 to 64 characters (a service or a team).
        #[arg(long)]
        name: String,
    },
    /// Add a bearer token to a principal and print it (shown only once). A
    /// rotation is create-token, deploy the new token, revoke-token.
    CreateToken {
        /// The principal's name.
        #[arg(long)]
        principal: String,
        /// A name for the token among the principal's live ones (1 to 64
        /// visible ASCII characters), e.g. where it is deployed.
        #[arg(long)]
        label: String,
    },
    /// Revoke a principal's live token by its label. Instances stop
    /// accepting it within 10 seconds (their in-memory cache of tokens).
    RevokeToken {
        /// The principal's name.
        #[arg(long)]
        principal: String,
        /// The label of the live token to revoke.
        #[arg(long)]
        label: String,
    },
    /// List a principal's tokens, live and revoked (never the tokens
    /// themselves), with when each was created, last used and revoked.
    ListTokens {
        /// The principal's name.
        #[arg(long)]
        principal: String,
    },
    /// List principals (at most 1,000) with their live tokens and accounts.
    ListPrincipals,
    /// Show an account: owner, currency, balance and ledger activity.
    ShowAccount {
        /// The account id (acc_… or sys_…).
        #[arg(long)]
        account: String,
    },
    /// Open an account for a principal in a currency.
    OpenAccount {
        /// The owning principal's name.
        #[arg(long)]
        owner: String,
        /// ISO 4217 code, e.g. USD.
        #[arg(long)]
        currency: String,
        /// The account id (acc_ and 1 to 40 letters or digits); generated if absent.
        #[arg(long)]
        id: Option<String>,
    },
    /// Deposit money into an account from its currency's funding account.
    Deposit {
        /// The account credited (acc_…).
        #[arg(long)]
        account: String,
        /// Integer amount in the currency's minor unit (cents).
        #[arg(long)]
        amount_minor: i64,
        /// The deposit's idempotency key: the same reference never deposits twice.
        #[arg(long)]
        reference: Option<String>,
    },
}

#[derive(Debug, clap::Args)]
pub struct ReconcileArgs {
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// The idempotency record TTL the server runs with: transfers younger
    /// than this must still have their key's record.
    #[arg(long, env = "NEXO_IDEMPOTENCY_TTL", default_value = "24h", value_parser = crate::config::parse_duration)]
    pub idempotency_ttl: Duration,
}

/// Parses the command line; on a bad value prints one line naming the
/// setting (flag and environment variable) instead of clap's full report.
pub fn parse() -> Result<Cli, ExitCode> {
    Cli::try_parse().map_err(|e| {
        use clap::error::{ContextKind, ErrorKind};
        match e.kind() {
            ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                let _ = e.print();
                ExitCode::SUCCESS
            }
            ErrorKind::InvalidValue | ErrorKind::ValueValidation => {
                let arg = e
                    .get(ContextKind::InvalidArg)
                    .map(ToString::to_string)
                    .unwrap_or_default();
                let first_line = e.to_string().lines().next().unwrap_or_default().to_owned();
                match env_of(&arg) {
                    Some(env) => eprintln!("{first_line} (setting {env})"),
                    None => eprintln!("{first_line}"),
                }
                ExitCode::from(2)
            }
            _ => {
                let _ = e.print();
                ExitCode::from(2)
            }
        }
    })
}

/// The environment variable behind a flag such as `--idempotency-ttl <DURATION>`.
fn env_of(arg: &str) -> Option<String> {
    let long = arg
        .strip_prefix("--")?
        .split_whitespace()
        .next()?
        .to_owned();
    let command = Cli::command();
    std::iter::once(&command)
        .chain(command.get_subcommands())
        .flat_map(|c| c.get_arguments())
        .find(|a| a.get_long() == Some(long.as_str()))
        .and_then(|a| a.get_env())
        .map(|env| env.to_string_lossy().into_owned())
}

pub async fn run(cli: Cli) -> ExitCode {
    if let Command::Reconcile(args) = &cli.command {
        return reconcile_command(&cli.db, args).await;
    }
    match execute(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Connects and migrates. Only `serve` and `migrate` pass
/// `MissingDatabase::Create`: any other command on a missing database is a
/// mistake in `DATABASE_URL`, not a database to make.
async fn connect(db: &DbConfig, missing: MissingDatabase) -> Result<PgPool, String> {
    let pool = db::connect(db, missing).await.map_err(|e| e.to_string())?;
    db::migrate(&pool)
        .await
        .map_err(|e| format!("cannot apply migrations: {e}"))?;
    Ok(pool)
}

fn print_json(value: &impl serde::Serialize) {
    match serde_json::to_string_pretty(value) {
        Ok(text) => print_out(&text),
        Err(e) => eprintln!("error: cannot print the result: {e}"),
    }
}

/// Writes a line of a command's output. A reader that went away (`| head`)
/// is not an error of the command: the rest of the output is dropped and
/// the command ends with its own exit status. (`println!` would panic.)
fn print_out(text: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{text}").and_then(|()| stdout.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(e) => eprintln!("error: cannot print the result: {e}"),
    }
}

async fn execute(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Serve(config) => serve(&cli.db, *config).await,
        // `run` answers it: it has exit statuses of its own.
        Command::Reconcile(ref args) => match reconcile_command(&cli.db, args).await {
            code if code == ExitCode::SUCCESS => Ok(()),
            _ => Err("reconciliation did not pass".to_owned()),
        },
        Command::Migrate => connect(&cli.db, MissingDatabase::Create)
            .await
            .map(|_| print_out("migrations applied")),
        Command::PurgeExpired { batch_rows, events } => {
            let pool = connect(&cli.db, MissingDatabase::Refuse).await?;
            let purged = store::purge_expired(&pool, batch_rows)
                .await
                .map_err(|e| format!("purge failed: {e}"))?;
            let events = purge_events(&pool, events.event_retention, batch_rows)
                .await
                .map_err(|e| format!("purge of events failed: {e}"))?;
            print_out(&format!(
                "compacted {} idempotency records past their TTL, deleted {}; deleted {} events past their retention",
                purged.compacted, purged.deleted, events.deleted
            ));
            Ok(())
        }
        Command::CreatePrincipal { name } => {
            let pool = connect(&cli.db, MissingDatabase::Refuse).await?;
            let created = admin::create_principal(&pool, &name)
                .await
                .map_err(|e| e.to_string())?;
            print_json(&created);
            eprintln!("store the token now: only its SHA-256 is kept, it cannot be shown again");
            Ok(())
        }
        Command::CreateToken { principal, label } => {
            let pool = connect(&cli.db, MissingDatabase::Refuse).await?;
            let created = admin::create_token(&pool, &principal, &label)
                .await
                .map_err(|e| e.to_string())?;
            print_json(&created);
            eprintln!("store the token now: only its SHA-256 is kept, it cannot be shown again");
            Ok(())
        }
        Command::RevokeToken { principal, label } => {
            let pool = connect(&cli.db, MissingDatabase::Refuse).await?;
            let revoked = admin::revoke_token(&pool, &principal, &label)
                .await
                .map_err(|e| e.to_string())?;
            print_json(&revoked);
            eprintln!(
                "revoked: instances stop accepting it within {} s",
                crate::caches::PRINCIPAL_CACHE_TTL.as_secs()
            );
            Ok(())
        }
        Command::ListTokens { principal } => {
            let pool = connect(&cli.db, MissingDatabase::Refuse).await?;
            let tokens = admin::list_tokens(&pool, &principal)
                .await
                .map_err(|e| e.to_string())?;
            print_json(&tokens);
            Ok(())
        }
        Command::ListPrincipals => {
            let pool = connect(&cli.db, MissingDatabase::Refuse).await?;
            let principals = admin::list_principals(&pool)
                .await
                .map_err(|e| e.to_string())?;
            print_json(&principals);
            Ok(())
        }
        Command::ShowAccount { account } => {
            let pool = connect(&cli.db, MissingDatabase::Refuse).await?;
            let info = admin::show_account(&pool, &account)
                .await
                .map_err(|e| e.to_string())?;
            print_json(&info);
            Ok(())
        }
        Command::OpenAccount {
            owner,
            currency,
            id,
        } => {
            let pool = connect(&cli.db, MissingDatabase::Refuse).await?;
            let account = admin::open_account(&pool, &owner, &currency, id.as_deref())
                .await
                .map_err(|e| e.to_string())?;
            print_json(&serde_json::json!({
                "account_id": account.as_str(),
                "owner": owner,
                "currency": currency,
            }));
            Ok(())
        }
        Command::Deposit {
            account,
            amount_minor,
            reference,
        } => {
            let pool = connect(&cli.db, MissingDatabase::Refuse).await?;
            let reference = reference.unwrap_or_else(|| format!("dep_{}", Uuid::new_v4()));
            let deposit = admin::deposit(&pool, &account, amount_minor, &reference)
                .await
                .map_err(|e| e.to_string())?;
            print_json(&deposit);
            Ok(())
        }
    }
}

async fn serve(db: &DbConfig, config: ServeConfig) -> Result<(), String> {
    let policy = config.idempotency.policy()?;
    let posting = config.posting.validated()?;
    let webhook_worker = match config.webhooks.settings()? {
        Some(settings) => Some((
            settings,
            crate::webhooks::client::DeliveryClient::new(
                config.webhooks.webhook_ca_file.as_deref(),
                settings.timeout,
            )?,
        )),
        None => None,
    };
    // The port first: when it is taken, nothing else (creating the
    // database, migrating, loading the demo) should have happened.
    let listener = tokio::net::TcpListener::bind(&config.bind)
        .await
        .map_err(|e| format!("cannot listen on {} (NEXO_BIND): {e}", config.bind))?;
    let pool = connect(db, MissingDatabase::Create).await?;
    if config.demo {
        admin::load_demo(&pool)
            .await
            .map_err(|e| format!("cannot load the demo fixtures: {e}"))?;
        tracing::warn!(
            "demo fixtures loaded: the public tokens tok_test_A and tok_test_B are active; never run --demo in production"
        );
    }
    let reconcile_every = config.operations.reconcile_every()?;
    let last_reconciliation = Arc::new(reconcile::LastRunCell::new(reconcile_every));
    let operations = Operations::new(
        config.operations.admin_token.as_deref(),
        last_reconciliation.clone(),
    )?;
    let state = AppState::new(
        pool.clone(),
        AppConfig {
            idempotency: policy,
            http: config.http.clone(),
            posting,
        },
    )
    .await
    .map_err(|e| format!("cannot read the supported currencies: {e}"))?
    .with_operations(operations)
    .with_rate_limit(config.rate_limit);
    let purge = (!config.purge.purge_interval.is_zero()).then(|| {
        tokio::spawn(purge_periodically(
            pool.clone(),
            config.purge.purge_interval,
            config.purge.purge_batch_rows,
            config.purge.events.event_retention,
        ))
    });
    let expiry = (!config.posting.hold_expiry_interval.is_zero()).then(|| {
        tokio::spawn(crate::transfers::lifecycle::expire_holds_periodically(
            pool.clone(),
            config.posting.hold_expiry_interval,
            config.posting.posting_lock_timeout,
        ))
    });
    let reconciliation = match reconcile_every {
        Some(every) => {
            let reconcile_pool = reconcile::connect(&db.database_url, db.db_acquire_timeout, false)
                .await
                .map_err(|e| format!("invalid DATABASE_URL: {e}"))?;
            let options = reconcile::Options {
                key_ttl: policy.ttl,
            };
            Some(tokio::spawn(reconcile_periodically(
                reconcile_pool,
                every,
                options,
                last_reconciliation,
            )))
        }
        None => None,
    };
    let webhooks = webhook_worker.map(|(settings, client)| {
        let mut closing = state.closing.subscribe();
        tokio::spawn(crate::webhooks::worker::run(
            pool.clone(),
            settings,
            client,
            async move {
                // A dropped sender is a server that is gone: stop as well.
                let _ = closing.wait_for(|closing| *closing).await;
            },
        ))
    });
    // The bound address, not the configured one: with port 0 the kernel
    // picks the port, and whoever started the process reads it here.
    match listener.local_addr() {
        Ok(addr) => tracing::info!(%addr, "listening"),
        Err(_) => tracing::info!(bind = %config.bind, "listening"),
    }
    let served = http::serve(listener, state, shutdown_signal())
        .await
        .map_err(|e| format!("server error: {e}"));
    for task in [purge, expiry, reconciliation].into_iter().flatten() {
        task.abort();
    }
    // Deliveries in flight at the signal finish (each within
    // NEXO_WEBHOOK_TIMEOUT); one still running past that is retried by the
    // next worker once its lease runs out.
    if let Some(worker) = webhooks {
        let bound = config.webhooks.webhook_timeout + crate::webhooks::worker::LEASE_MARGIN;
        let abort = worker.abort_handle();
        if tokio::time::timeout(bound, worker).await.is_err() {
            abort.abort();
        }
    }
    // Every claim has ended by now; a connection stuck in the database must
    // not hold the exit.
    if tokio::time::timeout(POOL_CLOSE_TIMEOUT, pool.close())
        .await
        .is_err()
    {
        tracing::warn!("database connections still busy at exit, leaving them");
    }
    tracing::info!("stopped");
    served
}

/// How long `serve` waits for its database connections to close at exit.
pub const POOL_CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// A single read-only snapshot, without creating the database or migrating
/// it: a check must not change what it checks.
async fn reconcile_command(db: &DbConfig, args: &ReconcileArgs) -> ExitCode {
    const COULD_NOT_RUN: u8 = 2;
    let pool = match reconcile::connect(&db.database_url, db.db_acquire_timeout, true).await {
        Ok(pool) => pool,
        Err(e) => {
            eprintln!(
                "error: cannot connect to database {}: {e}",
                db::describe_database_url(&db.database_url)
            );
            return ExitCode::from(COULD_NOT_RUN);
        }
    };
    let options = reconcile::Options {
        key_ttl: args.idempotency_ttl,
    };
    let report = match reconcile::run(&pool, options).await {
        Ok(report) => report,
        Err(e) => {
            eprintln!("error: the reconciliation could not run: {e}");
            return ExitCode::from(COULD_NOT_RUN);
        }
    };
    pool.close().await;
    if args.json {
        print_json(&report);
    } else {
        print_out(&report.to_string());
    }
    if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

async fn purge_periodically(
    pool: PgPool,
    every: Duration,
    batch_rows: i64,
    event_retention: Duration,
) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match store::purge_expired(&pool, batch_rows).await {
            Ok(store::Purged {
                compacted: 0,
                deleted: 0,
            }) => {}
            Ok(purged) => tracing::info!(
                compacted = purged.compacted,
                deleted = purged.deleted,
                "purged idempotency records"
            ),
            Err(e) => tracing::warn!(error = %e, "purge of expired idempotency records failed"),
        }
        match purge_events(&pool, event_retention, batch_rows).await {
            Ok(purged) if purged.deleted == 0 => {}
            Ok(purged) => tracing::info!(deleted = purged.deleted, "purged events"),
            Err(e) => tracing::warn!(error = %e, "purge of events past their retention failed"),
        }
    }
}

/// Deletes events past `retention`, except those an enabled webhook
/// endpoint has not passed yet, and meters what it did; then the webhook
/// attempts as old.
pub async fn purge_events(
    pool: &PgPool,
    retention: Duration,
    batch_rows: i64,
) -> Result<events::EventsPurged, sqlx::Error> {
    let result = match crate::webhooks::store::oldest_pending_txid(pool).await {
        Ok(keep_from_txid) => events::purge(pool, retention, batch_rows, keep_from_txid).await,
        Err(e) => Err(e),
    };
    match crate::webhooks::store::purge_attempts(pool, retention, batch_rows).await {
        Ok(0) => {}
        Ok(deleted) => tracing::info!(deleted, "purged webhook attempts"),
        Err(e) => tracing::warn!(error = %e, "purge of webhook attempts failed"),
    }
    crate::telemetry::events_purge(&result, chrono::Utc::now());
    result
}

/// Runs the reconciliation every `every`, logs and meters each result, and
/// leaves it in `cell`. The first run starts one interval after start-up, so
/// a fleet restarting together does not scan the ledger all at once.
pub async fn reconcile_periodically(
    pool: PgPool,
    every: Duration,
    options: reconcile::Options,
    cell: Arc<reconcile::LastRunCell>,
) {
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let result = reconcile::run(&pool, options).await;
        crate::telemetry::reconciliation(&result);
        match &result {
            Ok(report) if report.ok => {
                tracing::info!(
                    duration_ms = report.duration_ms,
                    "reconciliation: all checks hold"
                );
            }
            Ok(report) => {
                for check in report.checks.iter().filter(|c| !c.holds()) {
                    tracing::error!(
                        check = check.check.name(),
                        found = check.discrepancies_total,
                        first = ?check.discrepancies.first(),
                        "reconciliation found discrepancies"
                    );
                }
            }
            Err(e) => tracing::error!(error = %e, "reconciliation could not run"),
        }
        cell.record(result);
    }
}

/// Resolves on SIGINT or SIGTERM; the server then stops accepting and lets
/// in-flight requests finish.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutdown signal received, finishing in-flight requests");
}
