#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `GET /idempotency-keys/{key}`: every state of a key, as its owner sees
//! it, read without a side effect; another principal sees nothing.
mod common;

use common::*;
use serde_json::Value;
use sqlx::PgPool;

const AMOUNT: i64 = 1_500;

async fn lookup(app: &TestApp, token: &str, key: &str) -> Reply {
    app.get(token, &format!("/idempotency-keys/{key}")).await
}

/// The record's columns, to show that a lookup changes none of them.
async fn record_row(pool: &PgPool, key: &str) -> Option<Value> {
    sqlx::query_scalar(
        "SELECT to_jsonb(k) - 'response_body' FROM idempotency_keys k WHERE idempotency_key = $1",
    )
    .bind(key)
    .fetch_optional(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_key_never_used_is_not_found_and_the_lookup_creates_nothing(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    lookup(&app, TOKEN_A, &key)
        .await
        .assert_problem(404, "not-found");
    assert_eq!(record_row(&app.pool, &key).await, None);
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_completed_key_links_its_transfer_in_both_key_forms_and_stays_as_it_was(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let created = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, AMOUNT, "USD"))
        .await;
    assert_eq!(created.status, 201);
    let transfer_id = created.json()["transfer_id"].clone();
    let before = record_row(&app.pool, &key).await;

    for form in [key.clone(), format!("%22{key}%22")] {
        let reply = lookup(&app, TOKEN_A, &form).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let view = reply.json();
        assert_eq!(view["idempotency_key"], key.as_str());
        assert_eq!(view["state"], "completed");
        assert_eq!(view["response_status"], 201);
        assert_eq!(view["transfer_id"], transfer_id);
        assert_eq!(
            view["transfer_url"],
            format!("/transfers/{}", transfer_id.as_str().unwrap())
        );
        assert!(view["completed_at"].is_string() && view["expires_at"].is_string());
        assert!(view["retained_until"].is_string());
        assert_eq!(view["answer"], "stored");
        assert_eq!(view["retry_after_seconds"], Value::Null);
    }
    assert_eq!(record_row(&app.pool, &key).await, before, "no side effect");
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_business_rejection_is_completed_without_a_transfer(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let refused = app
        .post_transfer(TOKEN_B, &key, &transfer(B_USD, A_USD, AMOUNT, "USD"))
        .await;
    refused.assert_problem(422, "insufficient-funds");
    let view = lookup(&app, TOKEN_B, &key).await.json();
    assert_eq!(view["state"], "completed");
    assert_eq!(view["response_status"], 422);
    assert_eq!(view["transfer_id"], Value::Null);
    assert_eq!(view["transfer_url"], Value::Null);
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_key_in_flight_says_when_to_ask_again_and_a_failed_one_that_it_may_run_again(
    pool: PgPool,
) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");
    claim_for_a(&app.pool, &key, &body).await;
    let view = lookup(&app, TOKEN_A, &key).await.json();
    assert_eq!(view["state"], "in_flight");
    assert!(view["retry_after_seconds"].as_u64().is_some_and(|s| s >= 1));
    assert_eq!(view["transfer_id"], Value::Null);
    let in_flight = record_row(&app.pool, &key).await;
    assert_eq!(record_row(&app.pool, &key).await, in_flight);

    sqlx::query("UPDATE idempotency_keys SET status = 'FAILED', locked_until = now() WHERE idempotency_key = $1")
        .bind(&key)
        .execute(&app.pool)
        .await
        .unwrap();
    assert_eq!(lookup(&app, TOKEN_A, &key).await.json()["state"], "failed");
    // Failed means the same request executes: and it does, once.
    let retry = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(retry.status, 201);
    assert_eq!(
        lookup(&app, TOKEN_A, &key).await.json()["state"],
        "completed"
    );
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
}

/// Past the TTL a key is still `completed` (its answer rebuilt once the
/// purge compacted it); past its retention it is `expired`, and still links
/// the transfer it moved.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn an_expired_or_purged_key_still_links_the_transfer_it_moved(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (moved, refused) = (new_key(), new_key());
    let created = app
        .post_transfer(TOKEN_A, &moved, &transfer(A_USD, B_USD, AMOUNT, "USD"))
        .await;
    app.post_transfer(
        TOKEN_B,
        &refused,
        &transfer(B_USD, A_USD, AMOUNT * 1_000, "USD"),
    )
    .await
    .assert_problem(422, "insufficient-funds");
    sqlx::query(
        "UPDATE idempotency_keys SET created_at = now() - interval '2 days',
                expires_at = now() - interval '1 second'",
    )
    .execute(&app.pool)
    .await
    .unwrap();

    let past_ttl = lookup(&app, TOKEN_A, &moved).await.json();
    assert_eq!(
        (&past_ttl["state"], &past_ttl["answer"]),
        (&Value::from("completed"), &Value::from("stored")),
        "not purged yet: the bytes are still there"
    );

    let purged = nexo_transfers::idempotency::store::purge_expired(&app.pool, 100)
        .await
        .unwrap();
    assert_eq!((purged.compacted, purged.deleted), (2, 0));
    let compacted = lookup(&app, TOKEN_A, &moved).await.json();
    assert_eq!(compacted["state"], "completed");
    assert_eq!(compacted["answer"], "rebuilt");
    assert_eq!(compacted["response_status"], 201);
    assert_eq!(compacted["transfer_id"], created.json()["transfer_id"]);
    let rejection = lookup(&app, TOKEN_B, &refused).await.json();
    assert_eq!(rejection["state"], "completed");
    assert_eq!(rejection["answer"], "rebuilt");
    assert_eq!(rejection["response_status"], 422);
    assert_eq!(rejection["transfer_id"], Value::Null);

    sqlx::query("UPDATE idempotency_keys SET retain_until = now() - interval '1 second'")
        .execute(&app.pool)
        .await
        .unwrap();
    let past_retention = lookup(&app, TOKEN_A, &moved).await.json();
    assert_eq!(past_retention["state"], "expired");
    assert_eq!(past_retention["transfer_id"], created.json()["transfer_id"]);
    let purged = nexo_transfers::idempotency::store::purge_expired(&app.pool, 100)
        .await
        .unwrap();
    assert_eq!((purged.compacted, purged.deleted), (0, 2));
    let deleted = lookup(&app, TOKEN_A, &moved).await.json();
    assert_eq!(deleted["state"], "expired");
    assert_eq!(deleted["transfer_id"], created.json()["transfer_id"]);
    lookup(&app, TOKEN_B, &refused)
        .await
        .assert_problem(404, "not-found");
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn another_principal_never_sees_a_key_and_malformed_keys_are_refused(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    app.post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, AMOUNT, "USD"))
        .await;
    lookup(&app, TOKEN_B, &key)
        .await
        .assert_problem(404, "not-found");
    lookup(&app, "tok_nobody", &key)
        .await
        .assert_problem(401, "unauthorized");
    let too_long = "k".repeat(256);
    lookup(&app, TOKEN_A, &too_long)
        .await
        .assert_problem(400, "invalid-idempotency-key");
    lookup(&app, TOKEN_A, "%22unterminated")
        .await
        .assert_problem(400, "invalid-idempotency-key");
}
