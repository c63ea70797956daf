#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Claims that arrive together share one statement (ADR-006), and stay
//! what they were alone: each key claimed once, insert-first, each request
//! answered for its own key (a duplicate 409 or its replay, a reuse 422),
//! a key whose row someone else holds locked holds up neither its own
//! duplicate nor anybody else's claim, and a statement of several claims
//! that fails is split, so one key's trouble stays that key's.

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
const SPLIT: &str = "nexo_idempotency_claim_batches_split_total";
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

/// Opens the connections (the client's, the key pool's) and runs the
/// request path `requests` times at once, so that what a test sends next
/// reaches its claims in milliseconds, well inside the gated statements'
/// 5 s statement timeout.
async fn warm_up(app: &Arc<TestApp>, requests: usize) {
    let warm: Vec<(String, Value)> = (0..requests)
        .map(|_| (new_key(), transfer(A_USD, B_USD, 1, "USD")))
        .collect();
    for (key, reply) in send_all(Arc::clone(app), warm).await {
        assert_eq!(reply.status, 201, "{key}: warming up");
    }
}

/// Both claim statements the service runs at once, held at the gate: each
/// carries one transfer of 1 under a key of its own.
struct BusyStatements {
    keys: Vec<String>,
    requests: Vec<tokio::task::JoinHandle<Vec<(String, Reply)>>>,
}

impl BusyStatements {
    /// One after the other, so that each is a statement of its own.
    async fn start(app: &Arc<TestApp>, pool: &PgPool) -> Self {
        let keys: Vec<String> = (0..2).map(|_| new_key()).collect();
        let mut requests = Vec::new();
        for (n, key) in keys.iter().enumerate() {
            sqlx::query("INSERT INTO claim_gate (idempotency_key) VALUES ($1)")
                .bind(key)
                .execute(pool)
                .await
                .unwrap();
            requests.push(tokio::spawn(send_all(
                Arc::clone(app),
                vec![(key.clone(), transfer(A_USD, B_USD, 1, "USD"))],
            )));
            until(
                "each gated claim held in a statement of its own",
                || async { claims_at_the_gate(pool).await == n as i64 + 1 },
            )
            .await;
        }
        Self { keys, requests }
    }

    /// Opens the gate; the two transfers are made. Returns their keys.
    async fn release(self, pool: &PgPool) -> Vec<String> {
        sqlx::query("UPDATE claim_gate SET open = true")
            .execute(pool)
            .await
            .unwrap();
        for task in self.requests {
            for (key, reply) in task.await.unwrap() {
                assert_eq!(
                    reply.status,
                    201,
                    "{key}: {}",
                    String::from_utf8_lossy(&reply.body)
                );
            }
        }
        self.keys
    }
}

#[sqlx::test]
async fn claims_queued_behind_busy_statements_share_one_and_each_key_executes_once(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    let app = Arc::new(TestApp::spawn(pool.clone()).await);
    warm_up(&app, QUEUED + 2).await;
    install_claim_gate(&pool).await;
    let before = app.metrics().await;
    let a_before = app.balance(A_USD).await;

    let gated = BusyStatements::start(&app, &pool).await;

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
    let gated = gated.release(&pool).await;
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

/// A statement of several claims that fails is split: each claim is tried
/// alone, so one key's trouble stays that key's. Here one key of the pair
/// is being inserted by a transaction that outlasts the key pool's 1 s
/// lock timeout: the pair's statement times out, the other claim is then
/// made and its transfer posted, and only the held key's request gets a
/// retryable 503, with nothing claimed for it; its retry is made once the
/// key is free.
#[sqlx::test]
async fn a_failed_statement_of_several_claims_is_retried_claim_by_claim(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    let app = Arc::new(TestApp::spawn(pool.clone()).await);
    warm_up(&app, 4).await;
    install_claim_gate(&pool).await;
    let before = app.metrics().await;
    let a_before = app.balance(A_USD).await;

    let held = new_key();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO idempotency_keys (principal_id, idempotency_key, request_method, request_path,
                                       fingerprint, status, lock_token, locked_until, expires_at,
                                       retain_until)
         SELECT principal_id, $2, 'POST', '/transfers', decode(repeat('00', 32), 'hex'),
                'IN_PROGRESS', gen_random_uuid(), now() + interval '30 seconds',
                now() + interval '1 day', now() + interval '2 days'
         FROM accounts WHERE id = $1",
    )
    .bind(A_USD)
    .bind(&held)
    .execute(&mut *holder)
    .await
    .unwrap();

    // The pair queues behind two busy statements, so it is sent as one.
    let busy = BusyStatements::start(&app, &pool).await;
    let free = new_key();
    let pair = tokio::spawn(send_all(
        Arc::clone(&app),
        vec![
            (held.clone(), transfer(A_USD, B_USD, 4, "USD")),
            (free.clone(), transfer(A_USD, B_USD, 6, "USD")),
        ],
    ));
    until("the pair queued together", || async {
        app.metrics().await.value(QUEUE, &[]) >= 2.0
    })
    .await;
    let gated = busy.release(&pool).await;

    let replies: HashMap<String, Reply> = pair.await.unwrap().into_iter().collect();
    let after = app.metrics().await;
    assert_eq!(
        after.delta(&before, SPLIT, &[]),
        1.0,
        "the pair's statement failed and was split"
    );
    let made = &replies[&free];
    assert_eq!(
        made.status,
        201,
        "the free key is made: {}",
        String::from_utf8_lossy(&made.body)
    );
    let refused = &replies[&held];
    assert_eq!(
        refused.status,
        503,
        "{}",
        String::from_utf8_lossy(&refused.body)
    );
    assert_eq!(
        refused.headers["content-type"], "application/problem+json",
        "a problem document"
    );
    assert!(
        refused.headers.contains_key("retry-after"),
        "a retryable refusal"
    );
    holder.rollback().await.unwrap();
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE idempotency_key = $1")
            .bind(&held)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(rows, 0, "nothing was claimed for the refused request");
    assert_eq!(transfers_under(&pool, &held).await, 0);

    let retried = app
        .post_transfer(TOKEN_A, &held, &transfer(A_USD, B_USD, 4, "USD"))
        .await;
    assert_eq!(
        retried.status, 201,
        "the retry is made once the key is free"
    );
    for key in gated.iter().chain([&held, &free]) {
        assert_eq!(transfers_under(&pool, key).await, 1, "{key} executed once");
    }
    assert_eq!(
        a_before - app.balance(A_USD).await,
        1 + 1 + 4 + 6,
        "the ledger moved the four transfers, each once"
    );
    assert_ledger_consistent(&pool).await;
}
