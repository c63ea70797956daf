//! Connecting to PostgreSQL, following its primary across a failover,
//! applying the embedded migrations, and the one classification of
//! database errors that every caller shares.

pub mod endpoints;
pub mod replication;

use std::str::FromStr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::migrate::MigrateDatabase;
use sqlx::pool::PoolConnectionMetadata;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool, Postgres};

use crate::config::DbConfig;
pub use endpoints::Endpoints;

/// The migrations in `migrations/`, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!();

/// Longest any statement of the service may run before PostgreSQL cancels
/// it. A posting is a few milliseconds of work; this bounds the rare
/// statement stuck on I/O or on a lock that `lock_timeout` does not cover,
/// so every transaction, and so every claim, ends within a known time.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// What [`connect`] does when the database named by `DATABASE_URL` does
/// not exist on its server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingDatabase {
    /// Create it (and say so): `serve` and `migrate`.
    Create,
    /// Fail, naming it: every other command, so that a typo in the URL is
    /// not a new, empty database that a command then writes to.
    Refuse,
}

/// Why [`connect`] could not give a pool, in words that name what was
/// tried: the database, host, port and user.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Url(#[from] endpoints::EndpointsError),
    #[error("database {target} does not exist; `nexo-transfers migrate` creates it")]
    Missing { target: String },
    #[error("cannot connect to database {target}: {source}")]
    Unreachable {
        target: String,
        #[source]
        source: sqlx::Error,
    },
}

/// What `DATABASE_URL` names, for an error message.
pub fn describe_database_url(url: &str) -> String {
    match Endpoints::parse(url) {
        Ok(endpoints) => describe(&endpoints.urls),
        Err(_) => "named by DATABASE_URL".to_owned(),
    }
}

/// `"nexo_transfers" on localhost:5432 as postgres`: what the URLs name
/// (several hosts are listed in their order).
fn describe<S: AsRef<str>>(urls: &[S]) -> String {
    let options: Vec<PgConnectOptions> = urls
        .iter()
        .filter_map(|u| PgConnectOptions::from_str(u.as_ref()).ok())
        .collect();
    let Some(first) = options.first() else {
        return "named by DATABASE_URL".to_owned();
    };
    let hosts: Vec<String> = options
        .iter()
        .map(|o| format!("{}:{}", o.get_host(), o.get_port()))
        .collect();
    format!(
        "{:?} on {} as {}",
        // libpq's default database is the user's name.
        first.get_database().unwrap_or(first.get_username()),
        hosts.join(", "),
        first.get_username()
    )
}

/// Opens a bounded pool whose statements run at most
/// [`STATEMENT_TIMEOUT`], after creating the database when it is missing
/// and `missing` says so. Row-lock waits are bounded where they can happen
/// (the posting path sets its own `lock_timeout`). With several hosts in
/// `DATABASE_URL` the pool connects to the primary, refuses a connection to
/// a server in recovery, and a task follows the primary when it changes
/// (see [`follow_primary`]).
pub async fn connect(config: &DbConfig, missing: MissingDatabase) -> Result<PgPool, ConnectError> {
    let endpoints = Endpoints::parse(&config.database_url)?;
    let unreachable = |urls: &[String]| {
        let target = describe(urls);
        move |source| ConnectError::Unreachable { target, source }
    };
    let url = endpoints
        .find_primary()
        .await
        .map_err(unreachable(&endpoints.urls))?
        .to_owned();
    let one = std::slice::from_ref(&url);
    if !Postgres::database_exists(&url)
        .await
        .map_err(unreachable(one))?
    {
        if missing == MissingDatabase::Refuse {
            return Err(ConnectError::Missing {
                target: describe(one),
            });
        }
        match Postgres::create_database(&url).await {
            Ok(()) => tracing::info!(database = %describe(one), "created the database"),
            // Another instance created it between our check and our CREATE.
            Err(e) if classify(&e) == Failure::AlreadyExists => {}
            Err(e) => return Err(unreachable(one)(e)),
        }
    }
    let options: PgConnectOptions = url.parse().map_err(unreachable(one))?;
    let pool = pool_options(endpoints.read_write)
        .max_connections(config.db_pool_max)
        .acquire_timeout(config.db_acquire_timeout)
        .connect_with(bounded_statements(options))
        .await
        .map_err(unreachable(one))?;
    if !endpoints.is_single() {
        tokio::spawn(follow_primary(pool.clone(), endpoints));
    }
    Ok(pool)
}

/// How often the pool checks that it still talks to the primary.
pub const PRIMARY_CHECK_INTERVAL: Duration = Duration::from_millis(500);

/// When the pools last switched to another host: connections opened before
/// it are dropped instead of used (a demoted primary still answers pings).
static LAST_SWITCH: Mutex<Option<Instant>> = Mutex::new(None);

/// How many times this process switched to another primary. A commit is
/// acknowledged only from a confirmation read on the same primary
/// (`replication`), so a switch in between refuses the acknowledgement.
pub static PRIMARY_SWITCHES: AtomicU64 = AtomicU64::new(0);

fn pool_options(read_write: bool) -> PgPoolOptions {
    PgPoolOptions::new()
        .after_connect(move |conn, _| {
            Box::pin(async move {
                if read_write {
                    refuse_standby(conn).await?;
                }
                Ok(())
            })
        })
        // sqlx's own check pings every connection at every acquire: one
        // round trip more per claim and per posting batch. The hook pings
        // only a connection that sat idle (HikariCP's alive-bypass window):
        // one in steady use has just proven itself.
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if !opened_since_switch(&meta) {
                    return Ok(false);
                }
                if meta.idle_for >= ALIVE_CHECK_AFTER_IDLE {
                    // An error closes the connection, and the pool takes
                    // another or opens one.
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
}

async fn refuse_standby(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(conn)
        .await?;
    if in_recovery {
        return Err(sqlx::Error::Configuration(
            "connected to a server in recovery, not to the primary".into(),
        ));
    }
    Ok(())
}

fn opened_since_switch(meta: &PoolConnectionMetadata) -> bool {
    let last = *LAST_SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    last.is_none_or(|at| meta.age <= at.elapsed())
}

/// Checks every [`PRIMARY_CHECK_INTERVAL`] that the pool's host is still a
/// writable primary; when it is not (it died, or it was demoted), finds the
/// host that is and points the pool there. Connections to the old host are
/// dropped at their next use; requests meanwhile get 503.
pub async fn follow_primary(pool: PgPool, endpoints: Endpoints) {
    let mut ticker = tokio::time::interval(PRIMARY_CHECK_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        if pool.is_closed() {
            return;
        }
        let check = sqlx::query_scalar::<_, bool>("SELECT pg_is_in_recovery()").fetch_one(&pool);
        if let Ok(Ok(false)) = tokio::time::timeout(endpoints::PROBE_TIMEOUT, check).await {
            continue;
        }
        let Ok(url) = endpoints.find_primary().await else {
            tracing::warn!("no primary reachable among the database hosts");
            continue;
        };
        let Ok(options) = PgConnectOptions::from_str(url) else {
            continue;
        };
        let current = pool.connect_options();
        if current.get_host() == options.get_host() && current.get_port() == options.get_port() {
            continue;
        }
        tracing::warn!(
            host = options.get_host(),
            port = options.get_port(),
            "the primary moved: following it"
        );
        *LAST_SWITCH.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        PRIMARY_SWITCHES.fetch_add(1, Ordering::SeqCst);
        pool.set_connect_options(bounded_statements(options));
    }
}

/// The session setting that bounds how long any statement runs.
fn bounded_statements(options: PgConnectOptions) -> PgConnectOptions {
    options.options([(
        "statement_timeout",
        format!("{}ms", STATEMENT_TIMEOUT.as_millis()),
    )])
}

/// Applies pending migrations; concurrent instances serialise on sqlx's
/// advisory lock, so starting three at once is safe.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}

/// How long a pooled connection may sit idle and still be handed out
/// without a ping. Under load connections come back within milliseconds
/// and are never pinged; one idle for longer (a quiet spell, a database
/// restart meanwhile) is pinged first and replaced if dead. HikariCP's
/// `aliveBypassWindowMs` is the same idea, with the same 500 ms.
pub const ALIVE_CHECK_AFTER_IDLE: Duration = Duration::from_millis(500);

/// The share of the main pool's connections the key pool may open: a
/// claim is one short statement that no longer waits for a WAL flush, so
/// few connections keep up with many requests.
pub const KEY_POOL_SHARE_DIVISOR: u32 = 2;

/// Longest a statement on the key pool waits for a row lock: a key row is
/// locked only by a posting transaction completing it (milliseconds), so a
/// longer wait means that transaction is stuck, and giving up lets the
/// caller answer instead of waiting with it.
pub const KEY_POOL_LOCK_TIMEOUT: Duration = Duration::from_secs(1);

/// The pool where idempotency records are claimed and released: its own
/// connections, so that claiming a key, and marking one FAILED after a
/// posting could not run, never waits on the pool the posting just failed
/// to get (an exhausted main pool must not leave keys IN_PROGRESS). A
/// distinct type so that ledger code, which must run on the main pool's
/// synchronous commits, cannot be handed it.
///
/// Its sessions commit with `synchronous_commit = off`: a claim returns
/// without waiting for its WAL flush, which on a machine whose fsync takes
/// milliseconds halves a transfer's latency. It is safe because the ledger
/// transaction that completes the claim commits synchronously after it,
/// and WAL is flushed in order: once a transfer is answered, its claim is
/// durable too. A database crash can only lose a claim whose ledger
/// transaction had not committed (the retry then executes normally), or a
/// FAILED mark (the lease then frees the key). ADR-006 has the argument in
/// full.
#[derive(Clone, Debug)]
pub struct KeyPool(PgPool);

impl KeyPool {
    /// Opens lazily beside `pool`, on the same database; closes with it,
    /// and follows it to another host when it follows the primary.
    pub fn beside(pool: &PgPool) -> Self {
        let keys = pool_options(false)
            .max_connections((pool.options().get_max_connections() / KEY_POOL_SHARE_DIVISOR).max(1))
            .acquire_timeout(pool.options().get_acquire_timeout())
            .connect_lazy_with(key_options(&pool.connect_options()));
        tokio::spawn(follow_pool(pool.clone(), keys.clone()));
        Self(keys)
    }

    pub(crate) fn pool(&self) -> &PgPool {
        &self.0
    }
}

fn key_options(base: &PgConnectOptions) -> PgConnectOptions {
    bounded_statements(base.clone()).options([
        ("synchronous_commit", "off".to_owned()),
        (
            "lock_timeout",
            format!("{}ms", KEY_POOL_LOCK_TIMEOUT.as_millis()),
        ),
    ])
}

/// Points `keys` wherever `main` points, until `main` closes (then closes
/// `keys`). A connection to a server in recovery fails at its first write,
/// which answers 503; the key pool does not probe on its own.
async fn follow_pool(main: PgPool, keys: PgPool) {
    let mut following = main.connect_options();
    loop {
        tokio::select! {
            () = main.close_event() => {
                keys.close().await;
                return;
            }
            () = tokio::time::sleep(PRIMARY_CHECK_INTERVAL) => {}
        }
        let now = main.connect_options();
        if !std::sync::Arc::ptr_eq(&now, &following) {
            keys.set_connect_options(key_options(&now));
            following = now;
        }
    }
}

/// What a database error means to the service. Every decision that depends
/// on an error's kind (retry inside, answer 503, answer 500) reads this,
/// never a SQLSTATE of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// 40001 serialization_failure, 40P01 deadlock_detected: the
    /// transaction was rolled back whole and may simply run again.
    Transient,
    /// 55P03 lock_not_available: a row lock stayed held past `lock_timeout`.
    LockTimeout,
    /// 57014 query_canceled: `statement_timeout`, or an operator's cancel.
    Canceled,
    /// The database is away or shedding load: no connection from the pool
    /// in time, a dropped connection, a server shutting down or starting,
    /// too many connections, a server that is not (or no longer) the
    /// primary (class 08, 53, 57P01 to 57P03, 25006).
    Unavailable,
    /// 42P04 duplicate_database.
    AlreadyExists,
    /// Anything else: a bug or a broken invariant.
    Other,
}

impl Failure {
    /// Worth a retry by the client (503 with `Retry-After`): nothing was
    /// committed, and the same request may well succeed in a moment.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            Self::Transient | Self::LockTimeout | Self::Canceled | Self::Unavailable
        )
    }
}

pub fn classify(error: &sqlx::Error) -> Failure {
    match error {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => Failure::Unavailable,
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some("40001" | "40P01") => Failure::Transient,
            Some("55P03") => Failure::LockTimeout,
            Some("57014") => Failure::Canceled,
            Some("42P04") => Failure::AlreadyExists,
            // 25006 read_only_sql_transaction: a standby, or a primary
            // being demoted, until the pools follow the new primary.
            Some("25006") => Failure::Unavailable,
            Some(code)
                if code.starts_with("08")
                    || code.starts_with("53")
                    || matches!(code, "57P01" | "57P02" | "57P03") =>
            {
                Failure::Unavailable
            }
            _ => Failure::Other,
        },
        _ => Failure::Other,
    }
}
