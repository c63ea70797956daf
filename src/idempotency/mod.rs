//! Idempotency keys: parse the key, fingerprint the request, claim the key
//! insert-first, and run an operation whose completion is written into the
//! same transaction as its effects. Knows nothing of the ledger or of HTTP
//! routing: an operation is anything that can run in a transaction and
//! produce a response to store.

mod fingerprint;
mod key;
pub mod store;

use std::future::Future;
use std::time::Duration;

use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

pub use fingerprint::Fingerprint;
pub use key::{HEADER_NAME, IDEMPOTENCY_KEY_LEN_MAX, IdempotencyKey, KeyError};
pub use store::{Claim, ClaimOutcome, Policy, Scope, StoredResponse};

/// What an operation produced: the response to store and replay, and the
/// transfer it created, if any (kept on the record for reconciliation).
#[derive(Debug, Clone)]
pub struct Completion {
    pub response: StoredResponse,
    pub transfer_id: Option<Uuid>,
}

/// Work that runs once per claimed key, inside a transaction the
/// idempotency layer owns, so the completion of the key commits with it.
pub trait Operation: Send + Sync + 'static {
    fn execute<'c>(
        &'c self,
        conn: &'c mut PgConnection,
    ) -> impl Future<Output = Result<Completion, OperationError>> + Send + 'c;
}

/// Why an operation could not produce a response to store.
#[derive(Debug, thiserror::Error)]
pub enum OperationError {
    #[error("database error")]
    Database(#[from] sqlx::Error),
    /// A broken invariant (an account that vanished, a currency that no
    /// longer matches): the key is marked FAILED and the client gets a 500.
    #[error("{0}")]
    Invariant(String),
}

#[derive(Debug, thiserror::Error)]
pub enum ExecuteError {
    /// The claim was taken over while this execution ran; everything it did
    /// was rolled back. The new owner answers for the key.
    #[error("the claim was taken over by another request")]
    FenceLost,
    #[error("database error")]
    Database(#[source] sqlx::Error),
    #[error("operation failed: {0}")]
    Invariant(String),
}

/// Serialization failures and deadlocks are retried this many times inside
/// the service before the client sees a 5xx. Each retry is a fresh
/// transaction, so nothing of a failed attempt survives.
pub const TRANSIENT_RETRIES_MAX: u32 = 3;

/// Runs the operation and completes the claim in one transaction. On a
/// technical failure the transaction rolls back and the claim is marked
/// FAILED, so a retry with the same key executes again (once).
#[tracing::instrument(skip_all, fields(key = %claim.key))]
pub async fn execute<O: Operation>(
    pool: &PgPool,
    claim: &Claim,
    operation: &O,
) -> Result<Completion, ExecuteError> {
    let mut attempt = 0;
    let outcome = loop {
        attempt += 1;
        match execute_once(pool, claim, operation).await {
            Err(ExecuteError::Database(e))
                if is_transient(&e) && attempt <= TRANSIENT_RETRIES_MAX =>
            {
                tracing::warn!(attempt, error = %e, "transient database failure, retrying");
                tokio::time::sleep(Duration::from_millis(5 * u64::from(attempt))).await;
            }
            other => break other,
        }
    };
    if let Err(e) = &outcome
        && !matches!(e, ExecuteError::FenceLost)
        && let Err(mark_error) = store::mark_failed(pool, claim).await
    {
        // The lease still frees the key; the client is told to retry.
        tracing::error!(error = %mark_error, "could not mark the claim FAILED");
    }
    outcome
}

async fn execute_once<O: Operation>(
    pool: &PgPool,
    claim: &Claim,
    operation: &O,
) -> Result<Completion, ExecuteError> {
    let mut tx = pool.begin().await.map_err(ExecuteError::Database)?;
    let completion = match operation.execute(&mut tx).await {
        Ok(c) => c,
        Err(OperationError::Database(e)) => return Err(ExecuteError::Database(e)),
        Err(OperationError::Invariant(msg)) => return Err(ExecuteError::Invariant(msg)),
    };
    #[cfg(feature = "failpoints")]
    fail::fail_point!("idempotency::in_transaction");
    let completed = store::complete(&mut tx, claim, &completion.response, completion.transfer_id)
        .await
        .map_err(ExecuteError::Database)?;
    if !completed {
        tx.rollback().await.map_err(ExecuteError::Database)?;
        return Err(ExecuteError::FenceLost);
    }
    tx.commit().await.map_err(ExecuteError::Database)?;
    #[cfg(feature = "failpoints")]
    fail::fail_point!("idempotency::after_commit");
    Ok(completion)
}

/// SQLSTATE 40001 (serialization_failure) and 40P01 (deadlock_detected):
/// the transaction was rolled back whole and may simply run again.
pub fn is_transient(error: &sqlx::Error) -> bool {
    matches!(
        error.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("40001" | "40P01")
    )
}
