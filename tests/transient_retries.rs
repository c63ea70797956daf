#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Deadlocks (40P01) and serialization failures (40001) are retried inside
//! the service, each retry a fresh transaction, a bounded number of times;
//! past the bound the key is FAILED and the client gets a retryable 503.
//! The conflicts are provoked for real in PostgreSQL, through operations run
//! by the same `idempotency::execute` that runs transfers.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use bytes::Bytes;
use common::*;
use nexo_transfers::http::error::{ApiError, is_unavailable};
use nexo_transfers::idempotency::{
    self, Claim, ClaimOutcome, Completion, ExecuteError, Fingerprint, IdempotencyKey, Operation,
    OperationError, Scope, StoredResponse, TRANSIENT_RETRIES_MAX,
};
use sqlx::{PgConnection, PgPool};
use tokio::sync::Barrier;

fn done() -> Completion {
    Completion {
        response: StoredResponse {
            status: 200,
            headers: Vec::new(),
            body: Bytes::from_static(b"{}"),
        },
        transfer_id: None,
    }
}

async fn claim(pool: &PgPool, key: &str) -> Claim {
    let principal: uuid::Uuid =
        sqlx::query_scalar("SELECT id FROM principals WHERE name = 'demo-a'")
            .fetch_one(pool)
            .await
            .unwrap();
    let key = IdempotencyKey::from_inner(key.to_owned()).unwrap();
    let outcome = idempotency::store::claim(
        pool,
        default_policy(),
        Scope(principal),
        &key,
        "POST",
        "/probe",
        &Fingerprint::compute("POST", "/probe", key.as_str().as_bytes()),
    )
    .await
    .unwrap();
    match outcome {
        ClaimOutcome::Claimed(claim) => claim,
        other => panic!("not claimed: {other:?}"),
    }
}

async fn status_of(pool: &PgPool, key: &str) -> String {
    sqlx::query_scalar("SELECT status FROM idempotency_keys WHERE idempotency_key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Locks two rows in the given order; on its first attempt it waits for
/// its twin between the two locks, so the twins deadlock.
struct LockTwoRows {
    order: [i32; 2],
    meet: Arc<Barrier>,
    attempts: AtomicU32,
}

impl Operation for LockTwoRows {
    async fn execute(&self, conn: &mut PgConnection) -> Result<Completion, OperationError> {
        let attempt = self.attempts.fetch_add(1, Ordering::SeqCst) + 1;
        for (i, id) in self.order.iter().enumerate() {
            sqlx::query("UPDATE retry_probe SET hits = hits + 1 WHERE id = $1")
                .bind(id)
                .execute(&mut *conn)
                .await?;
            if i == 0 && attempt == 1 {
                self.meet.wait().await;
            }
        }
        Ok(done())
    }
}

/// Reads a row in REPEATABLE READ, waits for its twin, then updates the
/// row: the second writer cannot serialize and gets 40001.
struct ReadThenWrite {
    meet: Arc<Barrier>,
    attempts: AtomicU32,
}

impl Operation for ReadThenWrite {
    async fn execute(&self, conn: &mut PgConnection) -> Result<Completion, OperationError> {
        let attempt = self.attempts.fetch_add(1, Ordering::SeqCst) + 1;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *conn)
            .await?;
        sqlx::query("SELECT hits FROM retry_probe WHERE id = 1")
            .execute(&mut *conn)
            .await?;
        if attempt == 1 {
            self.meet.wait().await;
        }
        sqlx::query("UPDATE retry_probe SET hits = hits + 1 WHERE id = 1")
            .execute(&mut *conn)
            .await?;
        Ok(done())
    }
}

/// Fails with 40001 on every attempt.
struct AlwaysConflicts {
    attempts: AtomicU32,
}

impl Operation for AlwaysConflicts {
    async fn execute(&self, conn: &mut PgConnection) -> Result<Completion, OperationError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        sqlx::query(
            "DO $$ BEGIN RAISE EXCEPTION 'provoked' USING ERRCODE = 'serialization_failure'; END $$",
        )
        .execute(&mut *conn)
        .await?;
        Ok(done())
    }
}

async fn probe_table(pool: &PgPool) {
    nexo_transfers::admin::load_demo(pool).await.unwrap();
    sqlx::query("CREATE TABLE retry_probe (id int PRIMARY KEY, hits int NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO retry_probe VALUES (1, 0), (2, 0)")
        .execute(pool)
        .await
        .unwrap();
}

async fn hits(pool: &PgPool) -> i64 {
    scalar(pool, "SELECT sum(hits)::bigint FROM retry_probe").await
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_deadlock_is_retried_inside_and_both_complete_once(pool: PgPool) {
    probe_table(&pool).await;
    let meet = Arc::new(Barrier::new(2));
    let op = |order| LockTwoRows {
        order,
        meet: meet.clone(),
        attempts: AtomicU32::new(0),
    };
    let (one, two) = (op([1, 2]), op([2, 1]));
    let (claim_one, claim_two) = (
        claim(&pool, "deadlock-1").await,
        claim(&pool, "deadlock-2").await,
    );
    let (a, b) = tokio::join!(
        idempotency::execute(&pool, &claim_one, &one),
        idempotency::execute(&pool, &claim_two, &two)
    );
    assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
    let attempts = one.attempts.load(Ordering::SeqCst) + two.attempts.load(Ordering::SeqCst);
    assert_eq!(attempts, 3, "PostgreSQL picked one victim, retried once");
    // Each operation's effect landed once: the victim's first attempt rolled back.
    assert_eq!(hits(&pool).await, 4);
    assert_eq!(status_of(&pool, "deadlock-1").await, "COMPLETED");
    assert_eq!(status_of(&pool, "deadlock-2").await, "COMPLETED");
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_serialization_failure_is_retried_inside_and_both_complete_once(pool: PgPool) {
    probe_table(&pool).await;
    let meet = Arc::new(Barrier::new(2));
    let op = || ReadThenWrite {
        meet: meet.clone(),
        attempts: AtomicU32::new(0),
    };
    let (one, two) = (op(), op());
    let (claim_one, claim_two) = (
        claim(&pool, "serial-1").await,
        claim(&pool, "serial-2").await,
    );
    let (a, b) = tokio::join!(
        idempotency::execute(&pool, &claim_one, &one),
        idempotency::execute(&pool, &claim_two, &two)
    );
    assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
    let attempts = one.attempts.load(Ordering::SeqCst) + two.attempts.load(Ordering::SeqCst);
    assert_eq!(attempts, 3, "the second writer was retried once");
    assert_eq!(hits(&pool).await, 2);
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn past_the_retry_bound_the_key_is_failed_and_the_answer_retryable(pool: PgPool) {
    probe_table(&pool).await;
    let op = AlwaysConflicts {
        attempts: AtomicU32::new(0),
    };
    let claimed = claim(&pool, "hopeless").await;
    let result = idempotency::execute(&pool, &claimed, &op).await;
    assert_eq!(
        op.attempts.load(Ordering::SeqCst),
        TRANSIENT_RETRIES_MAX + 1
    );
    let Err(ExecuteError::Database(e)) = result else {
        panic!("expected a database error, got {result:?}");
    };
    assert!(idempotency::is_transient(&e));
    assert!(is_unavailable(&e));
    assert_eq!(ApiError::from(e).status().as_u16(), 503);
    // FAILED, so the client's retry executes at once instead of waiting.
    assert_eq!(status_of(&pool, "hopeless").await, "FAILED");
}
