#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Reversals (a transfer given back, in whole or in parts that never add up
//! to more than it moved) and atomic batches (every leg posts or none
//! does), each under its own key, under duplicate storms, checked against
//! the ledger.

mod common;

use std::collections::HashMap;

use common::*;
use serde_json::{Value, json};
use sqlx::PgPool;

async fn pay_b(app: &TestApp, amount: i64) -> String {
    let reply = app
        .post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, amount, "USD"))
        .await;
    assert_eq!(reply.status, 201);
    reply.json()["transfer_id"].as_str().unwrap().to_owned()
}

async fn reverse(app: &TestApp, token: &str, key: &str, id: &str, body: &Value) -> Reply {
    app.post_json(token, key, &format!("/transfers/{id}/reverse"), body)
        .await
}

/// Sends every (key, body) to `path` three times at once; each key's
/// copies must get the same final bytes.
async fn storm(
    app: &TestApp,
    token: &str,
    path: &str,
    requests: &[(String, Value)],
) -> HashMap<String, Reply> {
    let requests: Vec<(String, String, Value)> = requests
        .iter()
        .map(|(key, body)| (key.clone(), path.to_owned(), body.clone()))
        .collect();
    app.duplicate_storm(token, &requests, 3).await
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_partial_capture_and_its_reversals_add_up(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let mut hold = transfer(A_USD, B_USD, 10_000, "USD");
    hold["mode"] = json!("pending");
    let held = app.post_transfer(TOKEN_A, &new_key(), &hold).await.json();
    let id = held["transfer_id"].as_str().unwrap().to_owned();

    // Not posted yet: nothing to give back.
    reverse(&app, TOKEN_B, &new_key(), &id, &json!({}))
        .await
        .assert_problem(409, "transfer-not-posted");
    let posted = app
        .post_json(
            TOKEN_A,
            &new_key(),
            &format!("/transfers/{id}/post"),
            &json!({"amount_minor": 6_000}),
        )
        .await;
    assert_eq!(posted.status, 200);

    // Only the destination's owner gives money back.
    reverse(&app, TOKEN_A, &new_key(), &id, &json!({}))
        .await
        .assert_problem(404, "not-found");
    let key = new_key();
    let first = reverse(&app, TOKEN_B, &key, &id, &json!({"amount_minor": 2_000})).await;
    assert_eq!(
        first.status,
        201,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    let reversal = first.json();
    assert_eq!(reversal["reverses"], id.as_str());
    assert_eq!(reversal["from"], B_USD);
    assert_eq!(reversal["to"], A_USD);
    let again = reverse(&app, TOKEN_B, &key, &id, &json!({"amount_minor": 2_000})).await;
    assert_eq!((again.status, &again.body), (201, &first.body));
    assert!(again.replayed());

    // No amount: whatever is left (4,000).
    let rest = reverse(&app, TOKEN_B, &new_key(), &id, &json!({})).await;
    assert_eq!(rest.status, 201);
    assert_eq!(rest.json()["amount_minor"], 4_000);
    let over_key = new_key();
    let over = reverse(&app, TOKEN_B, &over_key, &id, &json!({"amount_minor": 1})).await;
    over.assert_problem(422, "reversal-exceeds-transfer");
    let over_again = reverse(&app, TOKEN_B, &over_key, &id, &json!({"amount_minor": 1})).await;
    assert_eq!(over_again.body, over.body, "the refusal is stored");
    reverse(
        &app,
        TOKEN_B,
        &new_key(),
        &id,
        &json!({"amount_minor": 6_001}),
    )
    .await
    .assert_problem(422, "invalid-amount");

    let original = app.get(TOKEN_A, &format!("/transfers/{id}")).await.json();
    assert_eq!(original["reversed_minor"], 6_000);
    let read_back = app
        .get(
            TOKEN_B,
            &format!("/transfers/{}", reversal["transfer_id"].as_str().unwrap()),
        )
        .await
        .json();
    assert_eq!(read_back["reverses"], id.as_str());
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE);
    assert_eq!(app.balance(B_USD).await, 0);
    assert_reconciles(&pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn racing_reversals_under_duplicate_storms_never_give_back_more_than_moved(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let id = pay_b(&app, 5_000).await;
    let requests: Vec<(String, Value)> = (0..10)
        .map(|_| (new_key(), json!({"amount_minor": 1_000})))
        .collect();
    let answers = storm(
        &app,
        TOKEN_B,
        &format!("/transfers/{id}/reverse"),
        &requests,
    )
    .await;
    let given = answers.values().filter(|r| r.status == 201).count();
    let refused: Vec<&Reply> = answers.values().filter(|r| r.status != 201).collect();
    assert_eq!(given, 5, "five of 1,000 fit in 5,000");
    for reply in &refused {
        reply.assert_problem(422, "reversal-exceeds-transfer");
    }
    assert_eq!(refused.len(), 5);
    let reversals: i64 =
        sqlx::query_scalar("SELECT count(*) FROM transfers WHERE reverses = $1::uuid")
            .bind(&id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(reversals, 5);
    assert_eq!(app.balance(B_USD).await, 0);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE);
    assert_reconciles(&pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_reversal_the_destination_cannot_cover_is_refused(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let id = pay_b(&app, 5_000).await;
    // B spends most of it elsewhere.
    let spent = app
        .post_transfer(TOKEN_B, &new_key(), &transfer(B_USD, A_USD, 4_500, "USD"))
        .await;
    assert_eq!(spent.status, 201);
    reverse(&app, TOKEN_B, &new_key(), &id, &json!({}))
        .await
        .assert_problem(422, "insufficient-funds");
    let part = reverse(
        &app,
        TOKEN_B,
        &new_key(),
        &id,
        &json!({"amount_minor": 500}),
    )
    .await;
    assert_eq!(part.status, 201);
    assert_eq!(app.balance(B_USD).await, 0);
    assert_reconciles(&pool).await;
}

fn leg(from: &str, to: &str, amount: i64, currency: &str) -> Value {
    transfer(from, to, amount, currency)
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_batch_whose_third_leg_overdraws_moves_nothing(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let eur_before = app.balance(A_EUR).await;
    let key = new_key();
    let body = json!({"transfers": [
        leg(A_USD, B_USD, 60_000_000, "USD"),
        leg(A_EUR, B_EUR, 1, "EUR"),
        leg(A_USD, B_USD, 50_000_000, "USD"),
    ]});
    let refused = app
        .post_json(TOKEN_A, &key, "/transfer-batches", &body)
        .await;
    refused.assert_problem(422, "insufficient-funds");
    assert_eq!(refused.json()["param"], "transfers[2].amount_minor");
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE);
    assert_eq!(app.balance(A_EUR).await, eur_before);
    assert_eq!(app.balance(B_EUR).await, 0);
    assert_eq!(customer_transfer_count(&pool).await, 0);
    // Stored under its key like any refusal: the same bytes again.
    let again = app
        .post_json(TOKEN_A, &key, "/transfer-batches", &body)
        .await;
    assert_eq!((again.status, &again.body), (422, &refused.body));

    // Under a storm of duplicates, a batch that fits posts once.
    let body = json!({"transfers": [
        leg(A_USD, B_USD, 60_000_000, "USD"),
        leg(A_EUR, B_EUR, 1, "EUR"),
        leg(A_USD, B_USD, 40_000_000, "USD"),
    ]});
    let key = new_key();
    let answers = storm(
        &app,
        TOKEN_A,
        "/transfer-batches",
        &[(key.clone(), body.clone())],
    )
    .await;
    let created = &answers[&key];
    assert_eq!(
        created.status,
        201,
        "{}",
        String::from_utf8_lossy(&created.body)
    );
    let batch = created.json();
    let legs = batch["transfers"].as_array().unwrap();
    assert_eq!(legs.len(), 3);
    assert!(legs.iter().all(|l| l["batch_id"] == batch["batch_id"]));
    assert_eq!(app.balance(A_USD).await, 0);
    assert_eq!(app.balance(B_USD).await, OPENING_BALANCE);
    assert_eq!(app.balance(B_EUR).await, 1);
    assert_eq!(customer_transfer_count(&pool).await, 3);
    let location = created.header("location").unwrap().to_owned();
    assert_eq!(app.get(TOKEN_A, &location).await.body, created.body);
    app.get(TOKEN_B, &location)
        .await
        .assert_problem(404, "not-found");
    // The batch's key with another body is another request.
    let other = json!({"transfers": [leg(A_EUR, B_EUR, 2, "EUR")]});
    app.post_json(TOKEN_A, &key, "/transfer-batches", &other)
        .await
        .assert_problem(422, "idempotency-key-reused");
    assert_reconciles(&pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_batch_is_checked_leg_by_leg_before_its_key_is_claimed(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let too_many: Vec<Value> = (0..101).map(|_| leg(A_USD, B_USD, 1, "USD")).collect();
    let mut pending = leg(A_USD, B_USD, 1, "USD");
    pending["mode"] = json!("pending");
    for (legs, status, slug) in [
        (vec![], 422, "invalid-batch"),
        (too_many, 422, "invalid-batch"),
        (
            vec![leg(A_USD, B_USD, 1, "USD"), pending],
            422,
            "invalid-mode",
        ),
        (
            vec![leg(A_USD, B_USD, 1, "USD"), leg(A_USD, B_USD, 0, "USD")],
            422,
            "invalid-amount",
        ),
        (
            vec![leg(A_USD, B_USD, 1, "USD"), leg(B_USD, A_USD, 1, "USD")],
            404,
            "not-found",
        ),
    ] {
        let key = new_key();
        let reply = app
            .post_json(
                TOKEN_A,
                &key,
                "/transfer-batches",
                &json!({"transfers": legs}),
            )
            .await;
        reply.assert_problem(status, slug);
        assert!(key_rows(&pool, &key).await.is_empty(), "{slug}: key stored");
    }
    assert_eq!(customer_transfer_count(&pool).await, 0);
}
