//! Connecting to PostgreSQL and applying the embedded migrations.

use sqlx::migrate::MigrateDatabase;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres};

use crate::config::DbConfig;

/// The migrations in `migrations/`, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!();

/// Creates the database if it is missing, then opens a bounded pool.
pub async fn connect(config: &DbConfig) -> Result<PgPool, sqlx::Error> {
    let url = &config.database_url;
    if !Postgres::database_exists(url).await? {
        match Postgres::create_database(url).await {
            Ok(()) => tracing::info!("created the database"),
            // Another instance created it between our check and our CREATE.
            Err(e) if db_code(&e).as_deref() == Some("42P04") => {}
            Err(e) => return Err(e),
        }
    }
    PgPoolOptions::new()
        .max_connections(config.db_pool_max)
        .acquire_timeout(config.db_acquire_timeout)
        .connect(url)
        .await
}

/// Applies pending migrations; concurrent instances serialise on sqlx's
/// advisory lock, so starting three at once is safe.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}

/// The share of the main pool's connections the claim pool may open: a
/// claim is one short statement that no longer waits for a WAL flush, so
/// few connections keep up with many requests.
pub const CLAIM_POOL_SHARE_DIVISOR: u32 = 2;

/// A small pool, on the same database as `pool`, whose sessions commit with
/// `synchronous_commit = off`: only the idempotency claim (the insert-first
/// statement, the read of a colliding row, a takeover) runs on it. The claim
/// then returns without waiting for its WAL flush, which on a machine whose
/// fsync takes milliseconds halves a transfer's latency. It is safe because
/// the ledger transaction that completes the claim commits synchronously
/// after it, and WAL is flushed in order: once a transfer is answered, its
/// claim is durable too. A database crash can only lose a claim whose
/// ledger transaction had not committed, which leaves the key as if it had
/// never been claimed and a retry executes normally. ADR-006 has the
/// argument in full. Closes with `pool`.
pub fn claim_pool(pool: &PgPool) -> PgPool {
    let options = (*pool.connect_options())
        .clone()
        .options([("synchronous_commit", "off")]);
    let claims = PgPoolOptions::new()
        .max_connections((pool.options().get_max_connections() / CLAIM_POOL_SHARE_DIVISOR).max(1))
        .acquire_timeout(pool.options().get_acquire_timeout())
        .connect_lazy_with(options);
    let (main, closing) = (pool.clone(), claims.clone());
    tokio::spawn(async move {
        main.close_event().await;
        closing.close().await;
    });
    claims
}

fn db_code(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}
