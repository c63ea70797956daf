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
const QUEUE: &str = "nexo_idempotency_claims_queued";
/// Claims sent while both claim statements are busy: 24 keys, one of them
/// sent twice more, another once more for another amount.
const QUEUED: usize = 27;
/// How long a test waits for a situation it set up before it fails. The
/// gated statements end at the key pool's 5 s statement timeout, and the
/// waits check they are still held.
const SITUATION_DEADLINE: Duration = Duration::from_secs(4);

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

/// A gate in the database: inserting a key listed in `claim_gate` waits
/// (sleeping, so no `lock_timeout` ends it; the key pool's 5 s
/// `statement_timeout` still does) until the test opens the gate. It makes
/// a claim statement busy for as long as the test needs, and nothing else.
async fn install_claim_gate(pool: &PgPool) {
    for statement in [
        "CREATE TABLE claim_gate (idempotency_key text PRIMARY KEY, open boolean NOT NULL DEFAULT false)",
        "CREATE FUNCTION wait_at_claim_gate() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             WHILE EXISTS (SELECT 1 FROM claim_gate
                           WHERE idempotency_key = NEW.idempotency_key AND NOT open) LOOP
                 PERFORM pg_sleep(0.005);
             END LOOP;
             RETURN NEW;
         END $$",
        "CREATE TRIGGER claim_gate BEFORE INSERT ON idempotency_keys
         FOR EACH ROW EXECUTE FUNCTION wait_at_claim_gate()",
    ] {
        sqlx::query(statement).execute(pool).await.unwrap();
    }
}

/// Claim statements of the service held at the gate right now.
async fn claims_at_the_gate(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event = 'PgSleep'
           AND query LIKE '%INSERT INTO idempotency_keys%'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Waits until `situation` holds, failing the test past [`SITUATION_DEADLINE`].
async fn until<F, Fut>(what: &str, mut situation: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !situation().await {
        assert!(
            started.elapsed() < SITUATION_DEADLINE,
            "never happened: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[sqlx::test]
async fn claims_queued_behind_busy_statements_share_one_and_each_key_executes_once(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    let app = Arc::new(TestApp::spawn(pool.clone()).await);
    // Connections (the client's, the key pool's) opened and the request path
    // run once, so what follows reaches its claims in milliseconds, well
    // inside the gated statements' 5 s statement timeout.
    let warm: Vec<(String, Value)> = (0..QUEUED + 2)
        .map(|_| (new_key(), transfer(A_USD, B_USD, 1, "USD")))
        .collect();
    for (key, reply) in send_all(Arc::clone(&app), warm).await {
        assert_eq!(reply.status, 201, "{key}: warming up");
    }
    install_claim_gate(&pool).await;
    let before = app.metrics().await;
    let a_before = app.balance(A_USD).await;

    // Both claim statements the service runs at once are made busy, one
    // after the other, so that each is a statement of its own.
    let gated: Vec<String> = (0..2).map(|_| new_key()).collect();
    let mut first = Vec::new();
    for (n, key) in gated.iter().enumerate() {
        sqlx::query("INSERT INTO claim_gate (idempotency_key) VALUES ($1)")
            .bind(key)
            .execute(&pool)
            .await
            .unwrap();
        first.push(tokio::spawn(send_all(
            Arc::clone(&app),
            vec![(key.clone(), transfer(A_USD, B_USD, 1, "USD"))],
        )));
        until(
            "each gated claim held in a statement of its own",
            || async { claims_at_the_gate(&pool).await == n as i64 + 1 },
        )
        .await;
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
    assert_eq!(requests.len(), QUEUED);
    let queued = tokio::spawn(send_all(Arc::clone(&app), requests));
    until(
        "every other claim queued while both statements were busy",
        || async {
            let in_queue = app.metrics().await.value(QUEUE, &[]);
            assert_eq!(
                claims_at_the_gate(&pool).await,
                2,
                "both statements stayed busy while the others queued ({in_queue} queued)"
            );
            in_queue >= QUEUED as f64
        },
    )
    .await;
    sqlx::query("UPDATE claim_gate SET open = true")
        .execute(&pool)
        .await
        .unwrap();

    for task in first {
        for (key, reply) in task.await.unwrap() {
            assert_eq!(
                reply.status,
                201,
                "{key}: {}",
                String::from_utf8_lossy(&reply.body)
            );
        }
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
    .bind(gated.iter().chain(&keys).cloned().collect::<Vec<_>>())
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
    assert_eq!(
        (attempts, statements),
        ((QUEUED + 2) as f64, 3.0),
        "each gated claim alone, then every queued claim in one statement"
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
