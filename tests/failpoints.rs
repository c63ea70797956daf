#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The dangerous moments of a transfer, reached on purpose: the server binary
//! is built with the `failpoints` feature and started with FAILPOINTS set, so
//! one request stops (`pause`) exactly at a chosen point; the test then kills
//! the process with SIGKILL, starts a clean one and retries.
//!
//! Run with `cargo test --features failpoints --test failpoints`
//! (`.ci/steps/10-failpoints.sh`); plain `cargo test` skips this file.
mod common;

use std::time::Duration;

use common::process::*;
use common::*;
use sqlx::PgPool;
use tokio::time::Instant;

/// The lease of the restarted server: a claim orphaned by the kill blocks
/// its key this long.
const LEASE: &str = "2s";
const AMOUNT: i64 = 4_321;

/// Where the process dies, and what the database must show before the kill.
struct Moment {
    failpoint: &'static str,
    /// A query that turns true once the request sits at the fail point.
    reached: &'static str,
    /// Whether the money moved before the process died.
    committed: bool,
}

const AFTER_CLAIM: Moment = Moment {
    failpoint: "transfer::after_claim",
    reached: "SELECT count(*) FROM idempotency_keys WHERE status = 'IN_PROGRESS'",
    committed: false,
};

const IN_LEDGER_TRANSACTION: Moment = Moment {
    failpoint: "posting::before_commit",
    // The posting is written and its key completed, uncommitted, and the
    // connection waits (the completion is its last statement: another
    // transaction idle for a moment, the hold expiry's, is not it).
    reached: "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND state = 'idle in transaction'
                AND query LIKE 'UPDATE idempotency_keys%'",
    committed: false,
};

const AFTER_COMMIT: Moment = Moment {
    failpoint: "posting::after_commit",
    reached: "SELECT count(*) FROM idempotency_keys WHERE status = 'COMPLETED'",
    committed: true,
};

const BEFORE_RESPONSE: Moment = Moment {
    failpoint: "transfer::before_response",
    reached: "SELECT count(*) FROM idempotency_keys WHERE status = 'COMPLETED'",
    committed: true,
};

async fn wait_until(pool: &PgPool, sql: &'static str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while scalar(pool, sql).await == 0 {
        assert!(Instant::now() < deadline, "never reached: {sql}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends one transfer to a server paused at `moment`, kills it there, checks
/// the database, restarts and retries until answered, then checks that the
/// intent moved exactly once.
async fn crash_at(pool: PgPool, moment: Moment) {
    let url = database_url(&pool);
    let failpoints = format!("{}=pause", moment.failpoint);
    let server = ServerProcess::start(
        &url,
        &[
            ("FAILPOINTS", failpoints.as_str()),
            ("NEXO_IDEMPOTENCY_LEASE", LEASE),
        ],
    )
    .await;
    let client = fault_client(Duration::from_secs(60));
    let (key, body) = (new_key(), transfer(A_USD, B_USD, AMOUNT, "USD"));
    let request = {
        let (client, base, key, body) = (
            client.clone(),
            server.base.clone(),
            key.clone(),
            body.clone(),
        );
        tokio::spawn(async move { try_post_transfer(&client, &base, TOKEN_A, &key, &body).await })
    };
    wait_until(&pool, moment.reached, Duration::from_secs(30)).await;
    assert!(
        !request.is_finished(),
        "the request should be stuck at {}",
        moment.failpoint
    );
    server.kill().await;
    assert!(
        request.await.unwrap().is_err(),
        "a killed server answers nothing"
    );

    let (status, transfers): (String, i64) = sqlx::query_as(
        "SELECT k.status, (SELECT count(*) FROM transfers WHERE principal_id IS NOT NULL)
         FROM idempotency_keys k WHERE k.idempotency_key = $1",
    )
    .bind(&key)
    .fetch_one(&pool)
    .await
    .unwrap();
    if moment.committed {
        assert_eq!((status.as_str(), transfers), ("COMPLETED", 1));
        assert_eq!(balance(&pool, B_USD).await, AMOUNT);
    } else {
        // Nothing of the posting survived the process.
        assert_eq!((status.as_str(), transfers), ("IN_PROGRESS", 0));
        assert_eq!(balance(&pool, B_USD).await, 0);
    }
    assert_ledger_consistent(&pool).await;

    let restarted = ServerProcess::start(&url, &[("NEXO_IDEMPOTENCY_LEASE", LEASE)]).await;
    let started = Instant::now();
    let reply = send_until_answered(
        &client,
        &restarted.base,
        TOKEN_A,
        &key,
        &body,
        Instant::now() + Duration::from_secs(30),
    )
    .await;
    assert_eq!(reply.status, 201);
    // A committed intent replays at once; an orphaned claim is taken over
    // after its lease and executed, once.
    assert_eq!(reply.replayed(), moment.committed);
    assert_each_intent_moved_once(&pool, &[(key, vec![reply])]).await;
    assert_eq!(balance(&pool, B_USD).await, AMOUNT);
    assert_ledger_consistent(&pool).await;
    println!(
        "fail point {}: killed there, retry answered 201 ({}) after {:?}",
        moment.failpoint,
        if moment.committed {
            "replay"
        } else {
            "executed once after the lease"
        },
        started.elapsed()
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn killed_after_the_claim_the_retry_takes_over_after_the_lease(pool: PgPool) {
    crash_at(pool, AFTER_CLAIM).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn killed_inside_the_ledger_transaction_nothing_moves_until_the_retry(pool: PgPool) {
    crash_at(pool, IN_LEDGER_TRANSACTION).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn killed_after_the_commit_the_retry_replays(pool: PgPool) {
    crash_at(pool, AFTER_COMMIT).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn killed_before_the_response_is_written_the_retry_replays(pool: PgPool) {
    crash_at(pool, BEFORE_RESPONSE).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_panic_inside_the_ledger_transaction_commits_nothing_and_frees_the_key(pool: PgPool) {
    let url = database_url(&pool);
    // Panics on the first pass only; the retry runs clean.
    let server = ServerProcess::start(
        &url,
        &[
            ("FAILPOINTS", "posting::before_commit=1*panic(injected)"),
            ("NEXO_IDEMPOTENCY_LEASE", LEASE),
        ],
    )
    .await;
    let client = fault_client(Duration::from_secs(30));
    let (key, body) = (new_key(), transfer(A_USD, B_USD, AMOUNT, "USD"));
    let first = try_post_transfer(&client, &server.base, TOKEN_A, &key, &body)
        .await
        .unwrap();
    first.assert_problem(500, "internal-error");
    assert_eq!(customer_transfer_count(&pool).await, 0);
    assert_eq!(balance(&pool, B_USD).await, 0);

    // The key was marked FAILED: the retry executes at once, no lease to wait.
    assert_eq!(key_rows(&pool, &key).await, [("FAILED".to_owned(), None)]);
    let retry = try_post_transfer(&client, &server.base, TOKEN_A, &key, &body)
        .await
        .unwrap();
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_each_intent_moved_once(&pool, &[(key, vec![retry])]).await;
    assert_ledger_consistent(&pool).await;
    let logs = server.logs().join("\n");
    assert!(
        logs.contains("the posting did not finish"),
        "the panic is logged"
    );
}
