#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The posting layer's bounds, each with the situation it names made real:
//! a row lock held on one account by another transaction, a pool exhausted
//! by transfers waiting on locks, a shutdown with work queued whose clients
//! hung up. After every answer and every shutdown, no key is IN_PROGRESS,
//! and a retry moves the money exactly once.
mod common;

use std::time::Duration;

use common::process::*;
use common::*;
use serde_json::Value;
use sqlx::{PgPool, Postgres, Transaction};
use tokio::time::Instant;

/// Opens `count` USD accounts for a new principal, each funded with
/// `FUNDS`, plus one destination account; returns its token, the funded
/// accounts and the destination.
async fn principal_with_accounts(
    pool: &PgPool,
    name: &str,
    count: usize,
) -> (String, Vec<String>, String) {
    use nexo_transfers::admin;
    let created = admin::create_principal(pool, name).await.unwrap();
    let mut funded = Vec::new();
    for i in 0..count {
        let id = format!("acc_{name}{i}").replace('-', "");
        admin::open_account(pool, name, "USD", Some(&id))
            .await
            .unwrap();
        admin::deposit(pool, &id, FUNDS, &format!("{id}-opening"))
            .await
            .unwrap();
        funded.push(id);
    }
    let destination = format!("acc_{name}dest").replace('-', "");
    admin::open_account(pool, name, "USD", Some(&destination))
        .await
        .unwrap();
    (created.token, funded, destination)
}

const FUNDS: i64 = 1_000_000;
const AMOUNT: i64 = 2_500;

/// Holds the row lock of `account` in a transaction of its own, as an
/// operator's `SELECT … FOR UPDATE` or another instance's stuck batch would.
async fn lock_account(pool: &PgPool, account: &str) -> Transaction<'static, Postgres> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM accounts WHERE id = $1 FOR UPDATE")
        .bind(account)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

async fn keys_in_progress(pool: &PgPool) -> i64 {
    scalar(
        pool,
        "SELECT count(*) FROM idempotency_keys WHERE status = 'IN_PROGRESS'",
    )
    .await
}

async fn key_status(pool: &PgPool, key: &str) -> Option<String> {
    sqlx::query_scalar("SELECT status FROM idempotency_keys WHERE idempotency_key = $1")
        .bind(key)
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// Backends of this test's database waiting on a row lock.
async fn lock_waiters(pool: &PgPool) -> i64 {
    scalar(
        pool,
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .await
}

async fn wait_for(what: &str, within: Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A request's answer and how long it took.
async fn timed(request: impl Future<Output = Reply>) -> (Reply, Duration) {
    let started = Instant::now();
    (request.await, started.elapsed())
}

fn assert_retryable_503(reply: &Reply) {
    reply.assert_problem(503, "service-unavailable");
    assert_eq!(reply.header("retry-after"), Some("1"), "{:?}", reply.body);
}

#[track_caller]
fn assert_retryable_503_within(reply: &Reply, took: Duration, bound: Duration) {
    assert_retryable_503(reply);
    assert!(took < bound, "answered after {took:?}, bound {bound:?}");
}

/// A row lock held 12 s on one account: transfers of another principal
/// between accounts that never touch it are all answered at once; the
/// transfer from the locked account gets a bounded, retryable answer and
/// its key is FAILED, never IN_PROGRESS; after the lock goes, its retry
/// moves the money once.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_locked_account_holds_up_only_its_own_transfers(pool: PgPool) {
    const HELD: Duration = Duration::from_secs(12);
    let app = TestApp::spawn(pool).await;
    let (token_c, sources, destination) = principal_with_accounts(&app.pool, "c", 8).await;
    let lock = lock_account(&app.pool, A_USD).await;
    let locked_at = Instant::now();

    let blocked_key = new_key();
    let blocked_body = transfer(A_USD, B_USD, AMOUNT, "USD");
    let blocked = {
        let (client, url, key, body) = (
            app.client.clone(),
            app.url("/transfers"),
            blocked_key.clone(),
            blocked_body.clone(),
        );
        tokio::spawn(async move {
            let started = Instant::now();
            let response = client
                .post(url)
                .bearer_auth(TOKEN_A)
                .header("Idempotency-Key", key)
                .json(&body)
                .send()
                .await
                .unwrap();
            (Reply::read(response).await, started.elapsed())
        })
    };
    // The transfer from the locked account is waiting on the lock before
    // any other is sent: the situation this test is about.
    wait_for(
        "a posting waiting on the row lock",
        Duration::from_secs(5),
        async || lock_waiters(&app.pool).await >= 1,
    )
    .await;

    let others = futures::future::join_all(sources.iter().map(|source| {
        let body = transfer(source, &destination, AMOUNT, "USD");
        let app = &app;
        let token = token_c.as_str();
        async move {
            let started = Instant::now();
            let reply = app.post_transfer(token, &new_key(), &body).await;
            (reply, started.elapsed())
        }
    }))
    .await;
    for (reply, took) in &others {
        assert_eq!(reply.status, 201, "{:?}", reply.body);
        assert!(
            *took < Duration::from_secs(1),
            "an unrelated transfer took {took:?}"
        );
    }
    assert_eq!(balance(&app.pool, &destination).await, 8 * AMOUNT);
    assert!(
        !blocked.is_finished(),
        "the locked transfer was still waiting while the others were answered"
    );

    let (reply, took) = blocked.await.unwrap();
    // Bounded by the lock timeout (2 s by default), twice at most: once in
    // the queue, once on the row lock.
    assert_retryable_503_within(&reply, took, Duration::from_secs(5));
    assert_eq!(
        key_status(&app.pool, &blocked_key).await.as_deref(),
        Some("FAILED")
    );
    assert_eq!(keys_in_progress(&app.pool).await, 0);
    assert_eq!(
        balance(&app.pool, B_USD).await,
        0,
        "nothing moved from the locked account"
    );

    tokio::time::sleep_until(locked_at + HELD).await;
    lock.commit().await.unwrap();
    let retry = app
        .post_transfer(TOKEN_A, &blocked_key, &blocked_body)
        .await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert_eq!(balance(&app.pool, B_USD).await, AMOUNT);
    assert_eq!(
        scalar(
            &app.pool,
            "SELECT count(*) FROM transfers WHERE from_account = 'acc_00001'"
        )
        .await,
        1
    );
    assert_ledger_consistent(&app.pool).await;
}

/// The same lock, held on a hold's source account: a new hold from it and
/// the post of an existing one each wait at most the lock timeout and get
/// a retryable 503 with their keys FAILED, nothing reserved or moved;
/// another principal's holds on other accounts are answered at once
/// meanwhile; once the lock goes, each retry takes effect once.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_locked_account_holds_up_only_its_own_holds_and_their_posts(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (token_c, sources, destination) = principal_with_accounts(&app.pool, "c", 4).await;
    let pending = |from: &str, to: &str| {
        let mut body = transfer(from, to, AMOUNT, "USD");
        body["mode"] = "pending".into();
        body
    };
    let existing = app
        .post_transfer(TOKEN_A, &new_key(), &pending(A_USD, B_USD))
        .await;
    assert_eq!(existing.status, 201, "{:?}", existing.body);
    let hold_id = existing.json()["transfer_id"].as_str().unwrap().to_owned();
    let post_path = format!("/transfers/{hold_id}/post");
    let lock = lock_account(&app.pool, A_USD).await;

    let (hold_key, post_key) = (new_key(), new_key());
    let (new_hold_body, post_body) = (pending(A_USD, B_USD), serde_json::json!({}));
    let blocked = async {
        tokio::join!(
            timed(app.post_transfer(TOKEN_A, &hold_key, &new_hold_body)),
            timed(app.post_json(TOKEN_A, &post_key, &post_path, &post_body)),
        )
    };
    let unrelated = async {
        // Both blocked requests wait on the row lock before any other is
        // sent: the situation this test is about.
        wait_for(
            "a hold and a post waiting on the row lock",
            Duration::from_secs(5),
            async || lock_waiters(&app.pool).await >= 2,
        )
        .await;
        futures::future::join_all(sources.iter().map(|source| async {
            let (key, body) = (new_key(), pending(source, &destination));
            timed(app.post_transfer(&token_c, &key, &body)).await
        }))
        .await
    };
    let (((new_hold, new_took), (post, post_took)), others) = tokio::join!(blocked, unrelated);

    for (reply, took) in &others {
        assert_eq!(reply.status, 201, "{:?}", reply.body);
        assert!(
            *took < Duration::from_secs(1),
            "an unrelated hold took {took:?}"
        );
    }
    assert_retryable_503_within(&new_hold, new_took, Duration::from_secs(5));
    assert_retryable_503_within(&post, post_took, Duration::from_secs(5));
    for key in [&hold_key, &post_key] {
        assert_eq!(key_status(&app.pool, key).await.as_deref(), Some("FAILED"));
    }
    assert_eq!(keys_in_progress(&app.pool).await, 0);
    let reserved = "SELECT held_minor FROM accounts WHERE id = 'acc_00001'";
    assert_eq!(
        scalar(&app.pool, reserved).await,
        AMOUNT,
        "only the first hold"
    );
    assert_eq!(
        scalar(
            &app.pool,
            "SELECT count(*) FROM holds WHERE status = 'pending'"
        )
        .await,
        1 + 4,
        "the first hold is still pending, beside the other principal's four"
    );
    assert_eq!(balance(&app.pool, B_USD).await, 0);

    lock.commit().await.unwrap();
    let hold_retry = app
        .post_transfer(TOKEN_A, &hold_key, &pending(A_USD, B_USD))
        .await;
    assert_eq!(hold_retry.status, 201, "{:?}", hold_retry.body);
    let post_retry = app
        .post_json(TOKEN_A, &post_key, &post_path, &serde_json::json!({}))
        .await;
    assert_eq!(post_retry.status, 200, "{:?}", post_retry.body);
    assert_eq!(post_retry.json()["status"], "posted");
    assert_eq!(balance(&app.pool, B_USD).await, AMOUNT);
    assert_eq!(scalar(&app.pool, reserved).await, AMOUNT, "the second hold");
    assert_reconciles(&app.pool).await;
}

/// A pool of two connections, both taken by transfers waiting on locks held
/// elsewhere: every other request is answered within the acquire timeout
/// plus a margin, the waiting ones within their lock timeout; no key is
/// left IN_PROGRESS; once the locks go, every retry moves money once.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn an_exhausted_pool_answers_every_request_within_its_bounds(pool: PgPool) {
    nexo_transfers::admin::load_demo(&pool).await.unwrap();
    let (token_c, sources, destination) = principal_with_accounts(&pool, "d", 4).await;
    let server = ServerProcess::start(
        &database_url(&pool),
        &[
            ("NEXO_DB_POOL_MAX", "2"),
            ("NEXO_DB_ACQUIRE_TIMEOUT", "1s"),
            ("NEXO_POSTING_LOCK_TIMEOUT", "3s"),
            ("NEXO_POSTING_LOCK_WAITERS_MAX", "2"),
        ],
    )
    .await;
    let client = fault_client(Duration::from_secs(30));
    let usd_lock = lock_account(&pool, A_USD).await;
    let eur_lock = lock_account(&pool, A_EUR).await;

    let mut intents: Vec<(String, String, Value)> = vec![
        (
            TOKEN_A.to_owned(),
            new_key(),
            transfer(A_USD, B_USD, AMOUNT, "USD"),
        ),
        (
            TOKEN_A.to_owned(),
            new_key(),
            transfer(A_EUR, B_EUR, AMOUNT, "EUR"),
        ),
    ];
    let waiting: Vec<_> = intents
        .iter()
        .cloned()
        .map(|(token, key, body)| {
            let (client, base) = (client.clone(), server.base.clone());
            tokio::spawn(async move {
                let started = Instant::now();
                let reply = try_post_transfer(&client, &base, &token, &key, &body)
                    .await
                    .unwrap();
                (reply, started.elapsed())
            })
        })
        .collect();
    // Both pooled connections are now held by postings waiting on a lock.
    wait_for(
        "two postings waiting on row locks",
        Duration::from_secs(5),
        async || lock_waiters(&pool).await >= 2,
    )
    .await;

    let others: Vec<(String, String, Value)> = sources
        .iter()
        .map(|s| {
            (
                token_c.clone(),
                new_key(),
                transfer(s, &destination, AMOUNT, "USD"),
            )
        })
        .collect();
    let answered = futures::future::join_all(others.iter().map(|(token, key, body)| {
        let (client, base) = (&client, &server.base);
        async move {
            let started = Instant::now();
            let reply = try_post_transfer(client, base, token, key, body)
                .await
                .unwrap();
            (reply, started.elapsed())
        }
    }))
    .await;
    for (reply, took) in &answered {
        assert!(
            reply.status == 201 || reply.status == 503,
            "{}: {:?}",
            reply.status,
            reply.body
        );
        if reply.status == 503 {
            assert_retryable_503(reply);
        }
        assert!(
            *took < Duration::from_millis(2_500),
            "answered after {took:?}"
        );
    }
    assert!(
        answered.iter().any(|(r, _)| r.status == 503),
        "the pool was exhausted, so some request must have been refused"
    );
    for handle in waiting {
        let (reply, took) = handle.await.unwrap();
        assert_retryable_503_within(&reply, took, Duration::from_secs(8));
    }
    assert_eq!(
        keys_in_progress(&pool).await,
        0,
        "every answered claim ended"
    );

    usd_lock.commit().await.unwrap();
    eur_lock.commit().await.unwrap();
    intents.extend(others);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut replies = Vec::new();
    for (token, key, body) in &intents {
        let reply = send_until_answered(&client, &server.base, token, key, body, deadline).await;
        assert_eq!(reply.status, 201, "{:?}", reply.body);
        replies.push((key.clone(), vec![reply]));
    }
    assert_each_intent_moved_once(&pool, &replies).await;
    assert_eq!(balance(&pool, &destination).await, 4 * AMOUNT);
    assert_eq!(balance(&pool, B_USD).await, AMOUNT);
    assert_ledger_consistent(&pool).await;
    server.kill().await;
}

/// SIGTERM while transfers are queued behind a lock held forever and their
/// clients have hung up: the process exits within the shutdown timeout, no
/// key is left IN_PROGRESS, and each retry, on a new process, moves the
/// money once.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn sigterm_with_queued_work_and_a_lock_held_forever_ends_every_claim(pool: PgPool) {
    const QUEUED: usize = 5;
    let env = [
        ("NEXO_POSTING_LOCK_TIMEOUT", "10s"),
        ("NEXO_SHUTDOWN_TIMEOUT", "2s"),
    ];
    let mut server = ServerProcess::start(&database_url(&pool), &env).await;
    let lock = lock_account(&pool, A_USD).await;
    let hanging_up = fault_client(Duration::from_millis(300));
    let intents: Vec<(String, Value)> = (0..QUEUED)
        .map(|i| (new_key(), transfer(A_USD, B_USD, AMOUNT + i as i64, "USD")))
        .collect();
    for (key, body) in &intents {
        let sent = try_post_transfer(&hanging_up, &server.base, TOKEN_A, key, body).await;
        assert!(
            sent.is_err(),
            "the client hangs up before any answer: {sent:?}"
        );
    }
    // The work is really in flight: every key claimed, one posting waiting
    // on the lock, the rest queued behind it.
    let keys: Vec<String> = intents.iter().map(|(k, _)| k.clone()).collect();
    let claimed = async || {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM idempotency_keys
             WHERE idempotency_key = ANY($1) AND status = 'IN_PROGRESS'",
        )
        .bind(&keys)
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    wait_for("every key claimed", Duration::from_secs(5), async || {
        claimed().await == QUEUED as i64
    })
    .await;
    assert!(
        lock_waiters(&pool).await >= 1,
        "a posting waits on the lock"
    );

    server.terminate();
    let signalled = Instant::now();
    let status = server.wait(Duration::from_secs(15)).await;
    let exited_in = signalled.elapsed();
    assert!(status.success(), "{status:?}");
    // The shutdown timeout (2 s), its margin (1 s) and the bounded close of
    // the pool (2 s).
    assert!(
        exited_in < Duration::from_secs(6),
        "exited after {exited_in:?}"
    );
    assert_eq!(
        claimed().await,
        0,
        "no key left IN_PROGRESS; the server's log:\n{}",
        server.logs().join("\n")
    );
    assert_eq!(keys_in_progress(&pool).await, 0);
    for key in &keys {
        assert_eq!(key_status(&pool, key).await.as_deref(), Some("FAILED"));
    }
    assert_eq!(balance(&pool, B_USD).await, 0);

    lock.commit().await.unwrap();
    let server = ServerProcess::start(&database_url(&pool), &[]).await;
    let client = fault_client(Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut replies = Vec::new();
    for (key, body) in &intents {
        let reply = send_until_answered(&client, &server.base, TOKEN_A, key, body, deadline).await;
        assert_eq!(reply.status, 201, "{:?}", reply.body);
        assert!(!reply.replayed(), "the FAILED key executes on its retry");
        replies.push((key.clone(), vec![reply]));
    }
    assert_each_intent_moved_once(&pool, &replies).await;
    let moved: i64 = (0..QUEUED as i64).map(|i| AMOUNT + i).sum();
    assert_eq!(balance(&pool, B_USD).await, moved);
    assert_ledger_consistent(&pool).await;
    println!(
        "shutdown with {QUEUED} transfers queued behind a lock held forever: exit 0 after {exited_in:?}"
    );
    server.kill().await;
}

/// A key whose record passed its retention and was deleted is reused with
/// another body:
/// that body is refused (its transfer exists under the original intent),
/// and the original intent's retries still get their original 201, byte
/// for byte, from a fresh instance (no answer remembered in memory).
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_purged_key_reused_with_another_body_keeps_answering_the_original(pool: PgPool) {
    let first_instance = TestApp::spawn(pool.clone()).await;
    let key = new_key();
    let original = transfer(A_USD, B_USD, AMOUNT, "USD");
    let other = transfer(A_USD, B_USD, AMOUNT + 1, "USD");
    let created = first_instance.post_transfer(TOKEN_A, &key, &original).await;
    assert_eq!(created.status, 201);
    drop(first_instance);

    sqlx::query("UPDATE idempotency_keys SET created_at = now() - interval '2 days', expires_at = now() - interval '1 second', retain_until = now() - interval '1 second'")
        .execute(&pool)
        .await
        .unwrap();
    let purged = nexo_transfers::idempotency::store::purge_expired(&pool, 100)
        .await
        .unwrap();
    assert_eq!(purged.deleted, 1);
    assert!(
        key_status(&pool, &key).await.is_none(),
        "the record is gone"
    );

    let app = TestApp::spawn(pool).await;
    for _ in 0..2 {
        let refused = app.post_transfer(TOKEN_A, &key, &other).await;
        refused.assert_problem(422, "idempotency-key-reused");
    }
    for _ in 0..2 {
        let replayed = app.post_transfer(TOKEN_A, &key, &original).await;
        assert_eq!(replayed.status, 201);
        assert_eq!(replayed.body, created.body, "byte for byte");
        assert_eq!(replayed.header("location"), created.header("location"));
        assert!(replayed.replayed());
    }
    let refused = app.post_transfer(TOKEN_A, &key, &other).await;
    refused.assert_problem(422, "idempotency-key-reused");
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(app.balance(B_USD).await, AMOUNT);
    assert_eq!(keys_in_progress(&app.pool).await, 0);
    assert_ledger_consistent(&app.pool).await;
}

/// The same past the TTL without a purge: the record still binds the key
/// (it is within its retention), so the other body is refused by the
/// record itself and the original replays its stored bytes.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn an_expired_key_reused_with_another_body_keeps_answering_the_original(pool: PgPool) {
    let first_instance = TestApp::spawn(pool.clone()).await;
    let key = new_key();
    let original = transfer(A_USD, B_USD, AMOUNT, "USD");
    let created = first_instance.post_transfer(TOKEN_A, &key, &original).await;
    assert_eq!(created.status, 201);
    drop(first_instance);
    sqlx::query("UPDATE idempotency_keys SET created_at = now() - interval '2 days', expires_at = now() - interval '1 second'")
        .execute(&pool)
        .await
        .unwrap();

    let app = TestApp::spawn(pool).await;
    let refused = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, 7, "USD"))
        .await;
    refused.assert_problem(422, "idempotency-key-reused");
    let replayed = app.post_transfer(TOKEN_A, &key, &original).await;
    assert_eq!((replayed.status, &replayed.body), (201, &created.body));
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_ledger_consistent(&app.pool).await;
}

/// Strict replication (`NEXO_REQUIRE_SYNC_STANDBY`) on a server without a
/// standby: the transfer commits, but no answer that promises it is given
/// (503, key COMPLETED), and its retry is not replayed either until a
/// standby confirms it; the money moved exactly once all along.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn without_a_confirming_standby_strict_mode_acknowledges_nothing(pool: PgPool) {
    let posting = nexo_transfers::config::PostingConfig {
        require_sync_standby: true,
        replication_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let app = TestApp::spawn_with_posting(pool, posting).await;
    let key = new_key();
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");
    for _ in 0..2 {
        let reply = app.post_transfer(TOKEN_A, &key, &body).await;
        assert_retryable_503(&reply);
        let detail = reply.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(detail.contains("synchronous standby"), "{detail}");
        assert!(!reply.replayed());
    }
    assert_eq!(
        key_status(&app.pool, &key).await.as_deref(),
        Some("COMPLETED")
    );
    assert_eq!(
        customer_transfer_count(&app.pool).await,
        1,
        "committed once"
    );
    assert_eq!(app.balance(B_USD).await, AMOUNT);
    assert_ledger_consistent(&app.pool).await;
}
