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

fn db_code(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}
