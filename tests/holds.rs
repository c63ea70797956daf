#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Pending transfers (holds): created, posted in full or in part, voided,
//! expired, each under its own key, checked against the ledger.

mod common;

use std::time::Duration;

use common::*;
use nexo_transfers::transfers::lifecycle::expire_due_holds;
use serde_json::{Value, json};
use sqlx::PgPool;

const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

fn hold(from: &str, to: &str, amount_minor: i64, expires_in_seconds: Option<i64>) -> Value {
    let mut body = transfer(from, to, amount_minor, "USD");
    body["mode"] = json!("pending");
    if let Some(secs) = expires_in_seconds {
        body["expires_in_seconds"] = json!(secs);
    }
    body
}

async fn create_hold(app: &TestApp, amount_minor: i64, expires_in_seconds: Option<i64>) -> String {
    let reply = app
        .post_transfer(
            TOKEN_A,
            &new_key(),
            &hold(A_USD, B_USD, amount_minor, expires_in_seconds),
        )
        .await;
    assert_eq!(
        reply.status,
        201,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let created = reply.json();
    assert_eq!(created["status"], "pending");
    created["transfer_id"]
        .as_str()
        .expect("transfer_id")
        .to_owned()
}

async fn post_hold(app: &TestApp, key: &str, id: &str, body: &Value) -> Reply {
    app.post_json(TOKEN_A, key, &format!("/transfers/{id}/post"), body)
        .await
}

async fn void_hold(app: &TestApp, key: &str, id: &str) -> Reply {
    app.post_json(TOKEN_A, key, &format!("/transfers/{id}/void"), &json!({}))
        .await
}

async fn held(pool: &PgPool, account: &str) -> i64 {
    sqlx::query_scalar("SELECT held_minor FROM accounts WHERE id = $1")
        .bind(account)
        .fetch_one(pool)
        .await
        .expect("held read")
}

async fn hold_status(pool: &PgPool, id: &str) -> String {
    sqlx::query_scalar("SELECT status FROM holds WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(pool)
        .await
        .expect("hold status")
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_hold_reserves_then_posts_once_and_every_retry_gets_the_same_bytes(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let key = new_key();
    let body = hold(A_USD, B_USD, 5_000, None);
    let created = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(created.status, 201);
    let view = created.json();
    let id = view["transfer_id"].as_str().expect("id").to_owned();
    assert_eq!(view["status"], "pending");
    assert_eq!(view["hold"]["amount_minor"], 5_000);
    assert_eq!(view["receipt"], Value::Null);
    assert_eq!(
        created.header("location"),
        Some(format!("/transfers/{id}").as_str())
    );

    // Reserved, not moved: the source's balance stands, its available
    // balance dropped; the destination sees nothing.
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE);
    assert_eq!(held(&pool, A_USD).await, 5_000);
    assert_eq!(app.balance(B_USD).await, 0);
    let account = app.get(TOKEN_A, &format!("/accounts/{A_USD}")).await.json();
    assert_eq!(account["balance_minor"], OPENING_BALANCE);
    assert_eq!(account["held_minor"], 5_000);
    assert_eq!(account["available_minor"], OPENING_BALANCE - 5_000);
    assert_eq!(
        entry_count(&pool, A_USD).await,
        1,
        "only the opening deposit"
    );

    // The creation's retry, from another instance too, is the same bytes.
    let again = app
        .another_instance()
        .await
        .post_transfer(TOKEN_A, &key, &body)
        .await;
    assert_eq!((again.status, &again.body), (201, &created.body));
    assert!(again.replayed());

    let post_key = new_key();
    let posted = post_hold(&app, &post_key, &id, &json!({})).await;
    assert_eq!(
        posted.status,
        200,
        "{}",
        String::from_utf8_lossy(&posted.body)
    );
    let view = posted.json();
    assert_eq!(view["status"], "posted");
    assert_eq!(view["amount_minor"], 5_000);
    assert!(view["receipt"]["receipt_id"].is_string());
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - 5_000);
    assert_eq!(app.balance(B_USD).await, 5_000);
    assert_eq!(held(&pool, A_USD).await, 0);

    // The post's retry replays; spelling the whole amount out is the same
    // intent; a post or void with another key is refused and stored.
    let replay = post_hold(&app, &post_key, &id, &json!({"amount_minor": 5_000})).await;
    assert_eq!((replay.status, &replay.body), (200, &posted.body));
    assert!(replay.replayed());
    let second_key = new_key();
    let twice = post_hold(&app, &second_key, &id, &json!({})).await;
    twice.assert_problem(409, "transfer-not-pending");
    let twice_again = post_hold(&app, &second_key, &id, &json!({})).await;
    assert_eq!(twice_again.body, twice.body, "the refusal is stored");
    void_hold(&app, &new_key(), &id)
        .await
        .assert_problem(409, "transfer-not-pending");

    // The same transfer, read back, is what the post answered.
    let read = app.get(TOKEN_A, &format!("/transfers/{id}")).await;
    assert_eq!(read.body, posted.body);
    let as_destination = app.get(TOKEN_B, &format!("/transfers/{id}")).await;
    assert_eq!(as_destination.body, posted.body);

    assert_eq!(transfers_under(&pool, &post_key).await, 1);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - 5_000);
    assert_reconciles(&pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_partial_post_moves_part_and_releases_the_rest(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let id = create_hold(&app, 10_000, None).await;

    // More than was held is refused before the claim: the key stays free.
    let key = new_key();
    let over = post_hold(&app, &key, &id, &json!({"amount_minor": 10_001})).await;
    over.assert_problem(422, "invalid-amount");
    assert_eq!(over.json()["param"], "amount_minor");
    assert!(key_rows(&pool, &key).await.is_empty());
    post_hold(&app, &new_key(), &id, &json!({"amount_minor": 0}))
        .await
        .assert_problem(422, "invalid-amount");

    let posted = post_hold(&app, &key, &id, &json!({"amount_minor": 3_000})).await;
    assert_eq!(
        posted.status,
        200,
        "{}",
        String::from_utf8_lossy(&posted.body)
    );
    let view = posted.json();
    assert_eq!(view["amount_minor"], 3_000);
    assert_eq!(view["hold"]["amount_minor"], 10_000);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - 3_000);
    assert_eq!(app.balance(B_USD).await, 3_000);
    assert_eq!(held(&pool, A_USD).await, 0, "the other 7,000 are released");
    // The same key with another amount is another request.
    post_hold(&app, &key, &id, &json!({"amount_minor": 2_000}))
        .await
        .assert_problem(422, "idempotency-key-reused");
    assert_reconciles(&pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_void_releases_everything_and_moves_nothing(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let id = create_hold(&app, 7_000, None).await;
    let key = new_key();
    // No body at all is an empty void.
    let voided = app
        .client
        .post(app.url(&format!("/transfers/{id}/void")))
        .bearer_auth(TOKEN_A)
        .header("Idempotency-Key", &key)
        .send()
        .await
        .expect("sent");
    let voided = Reply::read(voided).await;
    assert_eq!(
        voided.status,
        200,
        "{}",
        String::from_utf8_lossy(&voided.body)
    );
    assert_eq!(voided.json()["status"], "voided");
    assert!(voided.json()["hold"]["resolved_at"].is_string());
    assert_eq!(held(&pool, A_USD).await, 0);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE);
    assert_eq!(app.balance(B_USD).await, 0);
    let again = void_hold(&app, &key, &id).await;
    assert_eq!((again.status, &again.body), (200, &voided.body));
    post_hold(&app, &new_key(), &id, &json!({}))
        .await
        .assert_problem(409, "transfer-not-pending");
    // Unknown fields are refused, like everywhere.
    app.post_json(
        TOKEN_A,
        &new_key(),
        &format!("/transfers/{id}/void"),
        &json!({"reason": "x"}),
    )
    .await
    .assert_problem(400, "malformed-request");
    assert_eq!(customer_transfer_count(&pool).await, 0);
    assert_reconciles(&pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn only_the_holds_maker_may_post_or_void_it(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let id = create_hold(&app, 1_000, None).await;
    // The destination's owner sees it, but cannot act on it.
    assert_eq!(
        app.get(TOKEN_B, &format!("/transfers/{id}")).await.status,
        200
    );
    for path in [
        format!("/transfers/{id}/post"),
        format!("/transfers/{id}/void"),
    ] {
        app.post_json(TOKEN_B, &new_key(), &path, &json!({}))
            .await
            .assert_problem(404, "not-found");
    }
    // An unknown id, and a transfer that was never pending.
    post_hold(
        &app,
        &new_key(),
        &uuid::Uuid::now_v7().to_string(),
        &json!({}),
    )
    .await
    .assert_problem(404, "not-found");
    let immediate = app
        .post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, 10, "USD"))
        .await
        .json();
    let immediate_id = immediate["transfer_id"].as_str().expect("id");
    void_hold(&app, &new_key(), immediate_id)
        .await
        .assert_problem(409, "transfer-not-pending");
    assert_eq!(hold_status(&pool, &id).await, "pending");
    assert_eq!(held(&pool, A_USD).await, 1_000);
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn immediate_transfers_spend_only_the_available_balance(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    create_hold(&app, OPENING_BALANCE - 100, None).await;
    app.post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, 101, "USD"))
        .await
        .assert_problem(422, "insufficient-funds");
    let fits = app
        .post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, 100, "USD"))
        .await;
    assert_eq!(fits.status, 201);
    // A second hold cannot reserve what is no longer available either.
    app.post_transfer(TOKEN_A, &new_key(), &hold(A_USD, B_USD, 1, None))
        .await
        .assert_problem(422, "insufficient-funds");
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - 100);
    assert_reconciles(&pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn holds_bad_terms_are_refused_before_the_claim(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    for (body, slug, param) in [
        (
            json!({"from": A_USD, "to": B_USD, "amount_minor": 5, "currency": "USD", "mode": "later"}),
            "invalid-mode",
            "mode",
        ),
        (
            json!({"from": A_USD, "to": B_USD, "amount_minor": 5, "currency": "USD", "expires_in_seconds": 60}),
            "invalid-expiry",
            "expires_in_seconds",
        ),
        (
            hold(A_USD, B_USD, 5, Some(0)),
            "invalid-expiry",
            "expires_in_seconds",
        ),
        (
            hold(A_USD, B_USD, 5, Some(30 * 24 * 3600 + 1)),
            "invalid-expiry",
            "expires_in_seconds",
        ),
    ] {
        let key = new_key();
        let reply = app.post_transfer(TOKEN_A, &key, &body).await;
        reply.assert_problem(422, slug);
        assert_eq!(reply.json()["param"], param);
        assert!(key_rows(&pool, &key).await.is_empty());
    }
    assert_eq!(held(&pool, A_USD).await, 0);
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn an_expired_hold_is_released_once_and_can_no_longer_be_posted(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let expiring = create_hold(&app, 2_000, Some(1)).await;
    let found_due = create_hold(&app, 3_000, Some(1)).await;
    let lasting = create_hold(&app, 4_000, None).await;
    assert_eq!(held(&pool, A_USD).await, 9_000);
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    // A post that finds its hold due expires it itself, and is refused.
    post_hold(&app, &new_key(), &found_due, &json!({}))
        .await
        .assert_problem(409, "transfer-not-pending");
    assert_eq!(hold_status(&pool, &found_due).await, "expired");
    assert_eq!(held(&pool, A_USD).await, 6_000);

    // The task expires the rest, once: running it again finds nothing.
    assert_eq!(
        expire_due_holds(&pool, LOCK_TIMEOUT).await.expect("expiry"),
        1
    );
    assert_eq!(
        expire_due_holds(&pool, LOCK_TIMEOUT).await.expect("expiry"),
        0
    );
    assert_eq!(hold_status(&pool, &expiring).await, "expired");
    assert_eq!(hold_status(&pool, &lasting).await, "pending");
    assert_eq!(held(&pool, A_USD).await, 4_000);
    let view = app
        .get(TOKEN_A, &format!("/transfers/{expiring}"))
        .await
        .json();
    assert_eq!(view["status"], "expired");
    assert!(view["hold"]["resolved_at"].is_string());
    void_hold(&app, &new_key(), &expiring)
        .await
        .assert_problem(409, "transfer-not-pending");
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE);
    assert_eq!(customer_transfer_count(&pool).await, 0);
    assert_reconciles(&pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_hold_can_only_change_its_status_once_whatever_sql_tries(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let id = create_hold(&app, 1_000, None).await;
    void_hold(&app, &new_key(), &id).await;
    let reopened = sqlx::query("UPDATE holds SET status = 'pending', resolved_at = NULL, resolved_key = NULL, resolved_fingerprint = NULL WHERE id = $1::uuid")
        .bind(&id)
        .execute(&pool)
        .await;
    assert!(reopened.is_err(), "a voided hold was reopened");
    let posted_without_transfer = sqlx::query(
        "UPDATE holds SET status = 'posted', resolved_at = now(), resolved_key = 'k',
                          resolved_fingerprint = decode(repeat('00', 32), 'hex'), posted_amount_minor = 1
         WHERE id = $1::uuid",
    )
    .bind(create_hold(&app, 1_000, None).await)
    .execute(&pool)
    .await;
    assert!(
        posted_without_transfer.is_err(),
        "a hold was marked posted without its transfer"
    );
}

/// The outcome of a storm on one hold: the final answers, per key.
struct Storm {
    winners: Vec<(String, Value)>,
    refused: usize,
}

/// 25 posts and 25 voids, each under its own key and each sent three times
/// at once (a duplicate storm), all on one hold. Every copy of a request
/// gets the same final bytes.
async fn storm(app: &TestApp, id: &str) -> Storm {
    let requests: Vec<(String, String, Value)> = (0..50)
        .map(|n| {
            let (path, body) = if n % 2 == 0 {
                (
                    format!("/transfers/{id}/post"),
                    json!({"amount_minor": 1_000 + n}),
                )
            } else {
                (format!("/transfers/{id}/void"), json!({}))
            };
            (new_key(), path, body)
        })
        .collect();
    let by_key = app.duplicate_storm(TOKEN_A, &requests, 3).await;
    let mut winners = Vec::new();
    let mut refused = 0;
    for (key, reply) in by_key {
        match reply.status {
            200 => winners.push((key, reply.json())),
            _ => {
                reply.assert_problem(409, "transfer-not-pending");
                refused += 1;
            }
        }
    }
    Storm { winners, refused }
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn fifty_racing_posts_voids_and_the_expiry_end_a_hold_exactly_once(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let expiry = tokio::spawn({
        let pool = pool.clone();
        async move {
            loop {
                let _ = expire_due_holds(&pool, LOCK_TIMEOUT).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });

    // A live hold: exactly one of the fifty wins, the other 49 were refused
    // once they got the hold's lock after it.
    let live = create_hold(&app, 5_000, None).await;
    let first = storm(&app, &live).await;
    assert_eq!(first.winners.len(), 1, "exactly one request ends the hold");
    assert_eq!(first.refused, 49);
    let (_, won) = &first.winners[0];
    let moved = match won["status"].as_str() {
        Some("posted") => won["amount_minor"].as_i64().expect("amount"),
        Some("voided") => 0,
        other => panic!("a winner ended the hold as {other:?}"),
    };
    assert_eq!(
        hold_status(&pool, &live).await,
        won["status"].as_str().unwrap()
    );
    assert_eq!(app.balance(B_USD).await, moved);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - moved);

    // A hold already due when the storm arrives: the expiry wins, whether
    // the task or a request got to it first, and it is released once.
    let due = create_hold(&app, 5_000, Some(1)).await;
    let due_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT expires_at FROM holds WHERE id = $1::uuid")
            .bind(&due)
            .fetch_one(&pool)
            .await
            .unwrap();
    while sqlx::query_scalar::<_, bool>("SELECT now() < $1")
        .bind(due_at)
        .fetch_one(&pool)
        .await
        .unwrap()
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second = storm(&app, &due).await;
    assert!(second.winners.is_empty(), "a due hold was posted or voided");
    assert_eq!(second.refused, 50);
    assert_eq!(hold_status(&pool, &due).await, "expired");

    // A hold that expires while the storm runs: whoever got there first.
    let racing = create_hold(&app, 5_000, Some(1)).await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    let third = storm(&app, &racing).await;
    assert!(third.winners.len() <= 1);
    assert_eq!(third.winners.len() + third.refused, 50);
    let status = hold_status(&pool, &racing).await;
    match third.winners.first() {
        Some((_, won)) => assert_eq!(won["status"].as_str(), Some(status.as_str())),
        None => assert_eq!(status, "expired"),
    }
    expiry.abort();

    assert_eq!(
        held(&pool, A_USD).await,
        0,
        "every reservation released once"
    );
    let posted: i64 = sqlx::query_scalar(
        "SELECT COALESCE(sum(posted_amount_minor), 0)::bigint FROM holds WHERE status = 'posted'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(app.balance(B_USD).await, posted);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - posted);
    assert_reconciles(&pool).await;
}
