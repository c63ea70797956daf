//! Connecting to PostgreSQL, applying the embedded migrations, and the one
//! classification of database errors that every caller shares.

use std::time::Duration;

use sqlx::migrate::MigrateDatabase;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

use crate::config::DbConfig;

/// The migrations in `migrations/`, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!();

/// Longest any statement of the service may run before PostgreSQL cancels
/// it. A posting is a few milliseconds of work; this bounds the rare
/// statement stuck on I/O or on a lock that `lock_timeout` does not cover,
/// so every transaction, and so every claim, ends within a known time.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Creates the database if it is missing, then opens a bounded pool whose
/// statements run at most [`STATEMENT_TIMEOUT`]. Row-lock waits are
/// bounded where they can happen (the posting path sets its own
/// `lock_timeout`).
pub async fn connect(config: &DbConfig) -> Result<PgPool, sqlx::Error> {
    let url = &config.database_url;
    if !Postgres::database_exists(url).await? {
        match Postgres::create_database(url).await {
            Ok(()) => tracing::info!("created the database"),
            // Another instance created it between our check and our CREATE.
            Err(e) if classify(&e) == Failure::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    let options: PgConnectOptions = url.parse()?;
    PgPoolOptions::new()
        .max_connections(config.db_pool_max)
        .acquire_timeout(config.db_acquire_timeout)
        .connect_with(bounded_statements(options))
        .await
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
    /// Opens lazily beside `pool`, on the same database; closes with it.
    pub fn beside(pool: &PgPool) -> Self {
        let options = bounded_statements((*pool.connect_options()).clone()).options([
            ("synchronous_commit", "off".to_owned()),
            (
                "lock_timeout",
                format!("{}ms", KEY_POOL_LOCK_TIMEOUT.as_millis()),
            ),
        ]);
        let keys = PgPoolOptions::new()
            .max_connections((pool.options().get_max_connections() / KEY_POOL_SHARE_DIVISOR).max(1))
            .acquire_timeout(pool.options().get_acquire_timeout())
            .connect_lazy_with(options);
        let (main, closing) = (pool.clone(), keys.clone());
        tokio::spawn(async move {
            main.close_event().await;
            closing.close().await;
        });
        Self(keys)
    }

    pub(crate) fn pool(&self) -> &PgPool {
        &self.0
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
    /// too many connections (class 08, 53, 57P01 to 57P03).
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
