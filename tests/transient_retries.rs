#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Deadlocks (40P01) and serialization failures (40001) are retried inside
//! the posting layer, each retry a fresh transaction, a bounded number of
//! times; past the bound the key is FAILED and the client gets a retryable
//! 503. The failures are raised by PostgreSQL itself, from a trigger on the
//! transfers table that this test installs, so the real posting statement
//! of a real request is the one that fails.
mod common;

use common::*;
use nexo_transfers::transfers::posting::TRANSIENT_RETRIES_MAX;
use sqlx::PgPool;

/// Makes the next `failures` transfer inserts fail with `sqlstate`. The
/// count lives in a sequence: `nextval` is not rolled back with the failed
/// transaction, so it counts attempts.
async fn provoke(pool: &PgPool, sqlstate: &str, failures: i64) {
    sqlx::query("CREATE SEQUENCE provoked_attempts")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION provoke() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('provoked_attempts') <= {failures} THEN
                 RAISE EXCEPTION 'provoked' USING ERRCODE = '{sqlstate}';
             END IF;
             RETURN NULL;
         END $$"
    )))
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "CREATE TRIGGER provoke BEFORE INSERT ON transfers
         FOR EACH STATEMENT EXECUTE FUNCTION provoke()",
    )
    .execute(pool)
    .await
    .unwrap();
}

async fn attempts(pool: &PgPool) -> i64 {
    scalar(pool, "SELECT last_value FROM provoked_attempts").await
}

async fn status_of(pool: &PgPool, key: &str) -> String {
    sqlx::query_scalar("SELECT status FROM idempotency_keys WHERE idempotency_key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn retried_once_then_posted(pool: PgPool, sqlstate: &str) {
    let app = TestApp::spawn(pool).await;
    provoke(&app.pool, sqlstate, 1).await;
    let key = new_key();
    let reply = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, 700, "USD"))
        .await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    assert_eq!(attempts(&app.pool).await, 2, "one failure, one retry");
    assert_eq!(status_of(&app.pool, &key).await, "COMPLETED");
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(app.balance(B_USD).await, 700);
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_serialization_failure_is_retried_inside_and_the_transfer_posts_once(pool: PgPool) {
    retried_once_then_posted(pool, "40001").await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_deadlock_is_retried_inside_and_the_transfer_posts_once(pool: PgPool) {
    retried_once_then_posted(pool, "40P01").await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn past_the_retry_bound_the_key_is_failed_and_the_answer_retryable(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    provoke(&app.pool, "40001", 1_000).await;
    let key = new_key();
    let body = transfer(A_USD, B_USD, 700, "USD");
    let reply = app.post_transfer(TOKEN_A, &key, &body).await;
    reply.assert_problem(503, "service-unavailable");
    assert!(reply.header("retry-after").is_some());
    assert_eq!(
        attempts(&app.pool).await,
        i64::from(TRANSIENT_RETRIES_MAX) + 1
    );
    // FAILED, so the client's retry executes at once instead of waiting.
    assert_eq!(status_of(&app.pool, &key).await, "FAILED");
    assert_eq!(customer_transfer_count(&app.pool).await, 0);
    assert_eq!(app.balance(B_USD).await, 0);

    sqlx::query("DROP TRIGGER provoke ON transfers")
        .execute(&app.pool)
        .await
        .unwrap();
    let retry = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(!retry.replayed());
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(app.balance(B_USD).await, 700);
    assert_ledger_consistent(&app.pool).await;
}
