#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Long memory at low cost: past `NEXO_IDEMPOTENCY_TTL` a key's record is
//! compacted to its outcome, and until `NEXO_IDEMPOTENCY_RETENTION` no key
//! executes twice. A business rejection, a cancellation and a success are
//! answered as they were, by an instance that remembers nothing in memory,
//! and the ledger shows nothing moved again.
mod common;

use common::*;
use nexo_transfers::admin;
use nexo_transfers::idempotency::store::{Purged, purge_expired};
use sqlx::PgPool;

const AMOUNT: i64 = 2_500;

/// Moves every record of the test past its TTL (but not its retention).
async fn pass_the_ttl(pool: &PgPool) {
    sqlx::query(
        "UPDATE idempotency_keys SET created_at = now() - interval '3 days',
                expires_at = now() - interval '2 days', locked_until = now() - interval '2 days'",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// A claim released after a failure, its TTL over.
async fn failed_past_the_ttl(pool: &PgPool, key: &str) {
    sqlx::query(
        "UPDATE idempotency_keys SET status = 'FAILED', locked_until = now(),
                created_at = now() - interval '3 days', expires_at = now() - interval '2 days'
         WHERE idempotency_key = $1",
    )
    .bind(key)
    .execute(pool)
    .await
    .unwrap();
}

async fn pass_the_retention(pool: &PgPool) {
    sqlx::query("UPDATE idempotency_keys SET retain_until = now() - interval '1 second'")
        .execute(pool)
        .await
        .unwrap();
}

async fn purge(pool: &PgPool) -> Purged {
    purge_expired(pool, 100).await.unwrap()
}

async fn record_is_compact(pool: &PgPool, key: &str) -> bool {
    sqlx::query_scalar(
        "SELECT compacted_at IS NOT NULL AND response_body IS NULL AND response_headers IS NULL
         FROM idempotency_keys WHERE idempotency_key = $1",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// B holds nothing, so B's transfer is refused; then B is funded. Were the
/// refused intent forgotten, its retry would now move money. Within the
/// retention it is refused again, past the TTL and past the compaction,
/// and the body a retry gets is the original refusal's.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_business_rejection_stays_refused_past_the_ttl_and_the_purge(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let body = transfer(B_USD, A_USD, AMOUNT, "USD");
    let refused = app.post_transfer(TOKEN_B, &key, &body).await;
    refused.assert_problem(422, "insufficient-funds");
    admin::deposit(&app.pool, B_USD, 1_000_000, "fund-b")
        .await
        .unwrap();
    let a_before = app.balance(A_USD).await;

    pass_the_ttl(&app.pool).await;
    let past_ttl = app
        .another_instance()
        .await
        .post_transfer(TOKEN_B, &key, &body)
        .await;
    assert_eq!((past_ttl.status, &past_ttl.body), (422, &refused.body));
    assert!(past_ttl.replayed());

    assert_eq!(
        purge(&app.pool).await,
        Purged {
            compacted: 1,
            deleted: 0
        }
    );
    assert!(record_is_compact(&app.pool, &key).await);
    for _ in 0..2 {
        let compacted = app
            .another_instance()
            .await
            .post_transfer(TOKEN_B, &key, &body)
            .await;
        assert_eq!(
            (compacted.status, &compacted.body),
            (422, &refused.body),
            "rebuilt byte for byte"
        );
        assert!(compacted.replayed());
        assert_eq!(
            compacted.header("content-type"),
            refused.header("content-type")
        );
    }
    // Another body under the key is a reused key, as it always was.
    app.another_instance()
        .await
        .post_transfer(TOKEN_B, &key, &transfer(B_USD, A_USD, 1, "USD"))
        .await
        .assert_problem(422, "idempotency-key-reused");

    assert_eq!(transfers_under(&app.pool, &key).await, 0);
    assert_eq!(app.balance(A_USD).await, a_before, "nothing executed");
    assert_eq!(app.balance(B_USD).await, 1_000_000);
    assert_ledger_consistent(&app.pool).await;

    // Past its retention the key is free: the intent is new again. This is
    // the horizon the setting promises, and no longer.
    pass_the_retention(&app.pool).await;
    assert_eq!(
        purge(&app.pool).await,
        Purged {
            compacted: 0,
            deleted: 1
        }
    );
    let new_life = app.post_transfer(TOKEN_B, &key, &body).await;
    assert_eq!(new_life.status, 201, "{:?}", new_life.body);
    assert_eq!(transfers_under(&app.pool, &key).await, 1);
    assert_eq!(app.balance(A_USD).await, a_before + AMOUNT);
    assert_ledger_consistent(&app.pool).await;
}

/// A cancellation is remembered like an answer: past the TTL and the
/// compaction, the original still cannot execute, and the lookup says why
/// and until when.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_cancellation_outlives_the_ttl_and_the_purge(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let cancelled = app
        .client
        .post(app.url(&format!("/idempotency-keys/{key}/cancel")))
        .bearer_auth(TOKEN_A)
        .send()
        .await
        .unwrap();
    assert_eq!(cancelled.status(), 200);
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");
    let refused = app.post_transfer(TOKEN_A, &key, &body).await;
    refused.assert_problem(409, "intent-cancelled");

    pass_the_ttl(&app.pool).await;
    let purged = purge(&app.pool).await;
    assert_eq!((purged.compacted, purged.deleted), (1, 0));
    assert!(
        sqlx::query_scalar::<_, bool>(
            "SELECT compacted_at IS NOT NULL AND status = 'CANCELLED' FROM idempotency_keys
             WHERE idempotency_key = $1"
        )
        .bind(&key)
        .fetch_one(&app.pool)
        .await
        .unwrap()
    );
    let later = app
        .another_instance()
        .await
        .post_transfer(TOKEN_A, &key, &body)
        .await;
    assert_eq!((later.status, &later.body), (409, &refused.body));
    let view = app
        .get(TOKEN_A, &format!("/idempotency-keys/{key}"))
        .await
        .json();
    assert_eq!(view["state"], "cancelled");
    assert!(view["retained_until"].is_string());
    assert_eq!(transfers_under(&app.pool, &key).await, 0);
    assert_eq!(app.balance(B_USD).await, 0);
}

/// A success past the TTL and compacted: the same request replays the
/// original 201 (rebuilt from the transfer, byte for byte, with its
/// Location); another body is refused by the record itself, before any
/// posting is attempted.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_compacted_success_replays_byte_for_byte_and_refuses_another_body(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");
    let created = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(created.status, 201);
    pass_the_ttl(&app.pool).await;
    purge(&app.pool).await;
    assert!(record_is_compact(&app.pool, &key).await);

    let fresh = app.another_instance().await;
    let replayed = fresh.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!((replayed.status, &replayed.body), (201, &created.body));
    assert_eq!(replayed.header("location"), created.header("location"));
    assert!(replayed.replayed());
    fresh
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, AMOUNT + 1, "USD"))
        .await
        .assert_problem(422, "idempotency-key-reused");
    assert_eq!(transfers_under(&app.pool, &key).await, 1);
    assert_eq!(app.balance(B_USD).await, AMOUNT);
    assert_ledger_consistent(&app.pool).await;
}

/// A claim that failed promised nothing: past its TTL the purge deletes
/// it, and the key then executes whatever the body; so it does before the
/// purge ran. A claim still in flight is never touched by the purge.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn failed_claims_are_forgotten_at_the_ttl_and_live_claims_are_left_alone(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (failed, live) = (new_key(), new_key());
    claim_for_a(&app.pool, &failed, &transfer(A_USD, B_USD, 5, "USD")).await;
    claim_for_a(&app.pool, &live, &transfer(A_USD, B_USD, 6, "USD")).await;
    failed_past_the_ttl(&app.pool, &failed).await;
    // A live lease past the TTL: a claim taken over just before its expiry
    // keeps the expiry it had. The purge must not take the key from it.
    sqlx::query(
        "UPDATE idempotency_keys SET created_at = now() - interval '3 days',
                expires_at = now() - interval '2 days'
         WHERE idempotency_key = $1",
    )
    .bind(&live)
    .execute(&app.pool)
    .await
    .unwrap();

    // A second failed claim, taken by a request before any purge ran.
    let unpurged = new_key();
    claim_for_a(&app.pool, &unpurged, &transfer(A_USD, B_USD, 7, "USD")).await;

    let purged = purge(&app.pool).await;
    assert_eq!(
        purged,
        Purged {
            compacted: 0,
            deleted: 1
        },
        "the failed claim is deleted, the live ones are left alone"
    );
    assert!(key_rows(&app.pool, &failed).await.is_empty());
    failed_past_the_ttl(&app.pool, &unpurged).await;

    let other_body = transfer(A_USD, B_USD, AMOUNT, "USD");
    for key in [&failed, &unpurged] {
        let executed = app.post_transfer(TOKEN_A, key, &other_body).await;
        assert_eq!(executed.status, 201, "{:?}", executed.body);
        assert!(!executed.replayed());
        assert_eq!(transfers_under(&app.pool, key).await, 1);
    }
    assert_eq!(
        key_rows(&app.pool, &live).await,
        vec![("IN_PROGRESS".to_owned(), None)]
    );
    assert_eq!(app.balance(B_USD).await, 2 * AMOUNT);
    assert_ledger_consistent(&app.pool).await;
}

/// Records written by the version before these horizons: a claim inserted
/// without `retain_until` (an old instance during a rolling upgrade) gets
/// the default retention; a refusal stored without its problem type and
/// request id replays its stored bytes exactly, and is kept whole past its
/// TTL rather than compacted into an answer with other bytes; an old
/// tombstone's refusal repeats byte for byte.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn records_from_the_previous_version_keep_their_answers(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let principal: uuid::Uuid =
        sqlx::query_scalar("SELECT id FROM principals WHERE name = 'demo-b'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    let (refused, cancelled) = (new_key(), new_key());
    let legacy_body = r#"{"type":"https://nexo-transfers.example/problems/insufficient-funds","title":"Insufficient funds","status":422,"detail":"the source account balance cannot cover this transfer"}"#;
    let body = transfer(B_USD, A_USD, AMOUNT, "USD");
    let fingerprint = nexo_transfers::transfers::intent::TransferIntent::parse(
        &serde_json::from_value(body.clone()).unwrap(),
    )
    .unwrap()
    .fingerprint();
    // The previous version's INSERTs: no retain_until, problem_type or request_id.
    sqlx::query(
        "INSERT INTO idempotency_keys (principal_id, idempotency_key, request_method, request_path,
             fingerprint, status, lock_token, locked_until, response_status, response_headers,
             response_body, expires_at)
         VALUES ($1, $2, 'POST', '/transfers', $3, 'COMPLETED', gen_random_uuid(), now(), 422,
                 '[[\"content-type\",\"application/problem+json\"]]', convert_to($4, 'UTF8'),
                 now() + interval '1 day'),
                ($1, $5, 'POST', '/transfers', decode(repeat('00', 32), 'hex'), 'CANCELLED',
                 gen_random_uuid(), now(), NULL, NULL, NULL, now() + interval '1 day')",
    )
    .bind(principal)
    .bind(&refused)
    .bind(fingerprint.as_bytes().as_slice())
    .bind(legacy_body)
    .bind(&cancelled)
    .execute(&app.pool)
    .await
    .unwrap();
    let retained_days: f64 = sqlx::query_scalar(
        "SELECT min(extract(epoch FROM retain_until - created_at) / 86400)::float8
         FROM idempotency_keys WHERE idempotency_key = ANY($1)",
    )
    .bind(vec![refused.clone(), cancelled.clone()])
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!((399.9..=400.1).contains(&retained_days), "{retained_days}");

    for _ in 0..2 {
        let replay = app
            .another_instance()
            .await
            .post_transfer(TOKEN_B, &refused, &body)
            .await;
        assert_eq!(replay.status, 422);
        assert_eq!(
            replay.body,
            legacy_body.as_bytes(),
            "the stored bytes, nothing added"
        );
    }
    let tombstone: Vec<bytes::Bytes> = futures::future::join_all(
        (0..2).map(|_| async { app.post_transfer(TOKEN_B, &cancelled, &body).await.body }),
    )
    .await;
    assert_eq!(
        tombstone[0], tombstone[1],
        "an old tombstone refuses byte for byte"
    );

    pass_the_ttl(&app.pool).await;
    let purged = purge(&app.pool).await;
    assert_eq!(purged.compacted, 1, "only the tombstone is compacted");
    assert!(
        !record_is_compact(&app.pool, &refused).await,
        "the old refusal is kept whole"
    );
    let past_ttl = app
        .another_instance()
        .await
        .post_transfer(TOKEN_B, &refused, &body)
        .await;
    assert_eq!(past_ttl.body, legacy_body.as_bytes());
    assert_eq!(transfers_under(&app.pool, &refused).await, 0);
    assert_eq!(transfers_under(&app.pool, &cancelled).await, 0);
}
