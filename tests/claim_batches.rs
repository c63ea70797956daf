#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Claims that arrive together share one statement (ADR-006), and stay
//! what they were alone: each key claimed once, insert-first, each request
//! answered for its own key (a duplicate 409 or its replay, a reuse 422),
//! and a key whose row someone else holds locked holds up neither its own
//! duplicate nor anybody else's claim.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;
use sqlx::PgPool;

/// The claim counters are global to the test process: one test at a time
/// here, so each reads only its own claims.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const STATEMENTS: &str = "nexo_idempotency_claim_statements_total";
const ATTEMPTS: &str = "nexo_idempotency_claim_attempts_total";

async fn principal_of(pool: &PgPool, account: &str) -> uuid::Uuid {
    sqlx::query_scalar("SELECT principal_id FROM accounts WHERE id = $1")
        .bind(account)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Claim statements of the service waiting for a lock right now.
async fn claims_waiting_on_a_lock(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND query LIKE '%INSERT INTO idempotency_keys%'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Sends every (key, body) at once, each on its own connection.
async fn send_all(app: Arc<TestApp>, requests: Vec<(String, Value)>) -> Vec<(String, Reply)> {
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|(key, body)| {
            let app = Arc::clone(&app);
            tokio::spawn(async move {
                let reply = app.post_transfer(TOKEN_A, &key, &body).await;
                (key, reply)
            })
        })
        .collect();
    let mut replies = Vec::new();
    for task in tasks {
        replies.push(task.await.unwrap());
    }
    replies
}

#[sqlx::test]
async fn claims_queued_behind_busy_statements_share_one_and_each_key_executes_once(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    let app = Arc::new(TestApp::spawn(pool.clone()).await);
    let principal = principal_of(&pool, A_USD).await;
    let before = app.metrics().await;
    let a_before = app.balance(A_USD).await;

    // Both claim statements the service runs at once are made to wait: each
    // inserts a key another transaction is inserting too.
    let blocked: Vec<String> = (0..2).map(|_| new_key()).collect();
    let mut blocker = pool.begin().await.unwrap();
    for key in &blocked {
        sqlx::query(
            "INSERT INTO idempotency_keys (principal_id, idempotency_key, request_method, request_path,
                                           fingerprint, status, lock_token, locked_until, expires_at,
                                           retain_until)
             VALUES ($1, $2, 'POST', '/transfers', decode(repeat('00', 32), 'hex'), 'IN_PROGRESS',
                     gen_random_uuid(), now() + interval '30 seconds', now() + interval '1 day',
                     now() + interval '2 days')",
        )
        .bind(principal)
        .bind(key)
        .execute(&mut *blocker)
        .await
        .unwrap();
    }
    let first = tokio::spawn(send_all(
        Arc::clone(&app),
        blocked
            .iter()
            .map(|k| (k.clone(), transfer(A_USD, B_USD, 1, "USD")))
            .collect(),
    ));
    let started = Instant::now();
    while claims_waiting_on_a_lock(&pool).await < 2 {
        assert!(
            started.elapsed() < Duration::from_millis(800),
            "the two claims never waited"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // Meanwhile: 24 new keys, one of them sent three times, another sent
    // again for a different amount.
    let keys: Vec<String> = (0..24).map(|_| new_key()).collect();
    let mut requests: Vec<(String, Value)> = keys
        .iter()
        .map(|k| (k.clone(), transfer(A_USD, B_USD, 2, "USD")))
        .collect();
    requests.push((keys[0].clone(), transfer(A_USD, B_USD, 2, "USD")));
    requests.push((keys[0].clone(), transfer(A_USD, B_USD, 2, "USD")));
    requests.push((keys[1].clone(), transfer(A_USD, B_USD, 3, "USD")));
    let queued = tokio::spawn(send_all(Arc::clone(&app), requests));
    // Time for the requests to reach the claim queue; the blocked claims'
    // lock timeout is 1 s.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        claims_waiting_on_a_lock(&pool).await,
        2,
        "both statements still waited while the others queued"
    );
    blocker.rollback().await.unwrap();

    for (key, reply) in first.await.unwrap() {
        assert_eq!(
            reply.status,
            201,
            "{key}: {}",
            String::from_utf8_lossy(&reply.body)
        );
    }
    let replies = queued.await.unwrap();
    let mut by_key: HashMap<&str, Vec<&Reply>> = HashMap::new();
    for (key, reply) in &replies {
        by_key.entry(key.as_str()).or_default().push(reply);
    }
    for (key, got) in &by_key {
        let created: Vec<&&Reply> = got.iter().filter(|r| r.status == 201).collect();
        assert!(
            !created.is_empty(),
            "{key}: {:?}",
            got.iter().map(|r| r.status).collect::<Vec<_>>()
        );
        assert!(
            created.iter().all(|r| r.body == created[0].body),
            "{key}: every 201 is the one answer, byte for byte"
        );
        assert!(
            got.iter().all(|r| matches!(r.status, 201 | 409 | 422)),
            "{key}: {:?}",
            got.iter().map(|r| r.status).collect::<Vec<_>>()
        );
        assert_eq!(transfers_under(&pool, key).await, 1, "{key} executed once");
    }
    let reused = &by_key[keys[1].as_str()];
    assert!(
        reused.iter().any(|r| r.status == 422) || reused.iter().any(|r| r.status == 409),
        "the key sent for two amounts got one of them refused"
    );
    let moved: i64 = a_before - app.balance(A_USD).await;
    let amounts: i64 = sqlx::query_scalar(
        "SELECT COALESCE(sum(amount_minor), 0)::int8 FROM transfers WHERE idempotency_key = ANY($1)",
    )
    .bind(blocked.iter().chain(&keys).cloned().collect::<Vec<_>>())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(moved, amounts, "the ledger moved what the 26 transfers say");
    assert_ledger_consistent(&pool).await;

    let after = app.metrics().await;
    let (statements, attempts) = (
        after.delta(&before, STATEMENTS, &[]),
        after.delta(&before, ATTEMPTS, &[]),
    );
    println!("{attempts} claim attempts in {statements} statements");
    assert!(
        attempts >= statements + 10.0,
        "the queued claims shared statements: {attempts} attempts in {statements} statements"
    );
}

#[sqlx::test]
async fn a_key_row_locked_elsewhere_holds_up_neither_its_duplicate_nor_other_claims(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    let app = TestApp::spawn(pool.clone()).await;
    let done = new_key();
    let original = app
        .post_transfer(TOKEN_A, &done, &transfer(A_USD, B_USD, 5, "USD"))
        .await;
    assert_eq!(original.status, 201);
    // Another instance remembers no answer: its duplicate goes to the
    // database.
    let other = Arc::new(app.another_instance().await);

    // A transaction holds the completed key's row, as a ledger transaction
    // completing it would, and keeps it for longer than the key pool's
    // 1 s lock timeout.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("UPDATE idempotency_keys SET updated_at = updated_at WHERE idempotency_key = $1")
        .bind(&done)
        .execute(&mut *holder)
        .await
        .unwrap();

    let mut requests: Vec<(String, Value)> = (0..10)
        .map(|_| (new_key(), transfer(A_USD, B_USD, 1, "USD")))
        .collect();
    requests.push((done.clone(), transfer(A_USD, B_USD, 5, "USD")));
    let started = Instant::now();
    let replies = send_all(other, requests).await;
    let took = started.elapsed();
    let still_held: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                        WHERE l.locktype = 'transactionid' AND a.state = 'idle in transaction'
                          AND a.datname = current_database())",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(still_held, "the row stayed locked while the requests ran");
    for (key, reply) in &replies {
        assert_eq!(
            reply.status,
            201,
            "{key}: {}",
            String::from_utf8_lossy(&reply.body)
        );
    }
    let replay = &replies.last().unwrap().1;
    assert_eq!(replay.body, original.body, "the duplicate is the replay");
    println!("11 requests answered in {took:?} beside a locked key row");
    holder.rollback().await.unwrap();
    assert_eq!(transfers_under(&pool, &done).await, 1);
    assert_ledger_consistent(&pool).await;
}
