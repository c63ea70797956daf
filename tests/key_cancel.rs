#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `POST /idempotency-keys/{key}/cancel`: an intent cancelled by its key
//! never executes, whenever its original arrives; one that moved money or
//! is running is not cancelled; a cancel racing its original ends one way
//! or the other, never both. Every claim is checked against the ledger.
mod common;

use common::*;
use serde_json::Value;
use sqlx::PgPool;

const AMOUNT: i64 = 2_000;

async fn cancel(app: &TestApp, token: &str, key: &str) -> Reply {
    let response = app
        .client
        .post(app.url(&format!("/idempotency-keys/{key}/cancel")))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    Reply::read(response).await
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn cancelled_before_the_original_arrives_the_original_never_executes(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let cancelled = cancel(&app, TOKEN_A, &key).await;
    assert_eq!(cancelled.status, 200, "{:?}", cancelled.body);
    let view = cancelled.json();
    assert_eq!(view["state"], "cancelled");
    assert!(view["cancelled_at"].is_string() && view["retained_until"].is_string());
    // Cancelling again answers the same, byte for byte.
    let again = cancel(&app, TOKEN_A, &key).await;
    assert_eq!((again.status, &again.body), (200, &cancelled.body));

    let body = transfer(A_USD, B_USD, AMOUNT, "USD");
    let original = app.post_transfer(TOKEN_A, &key, &body).await;
    original.assert_problem(409, "intent-cancelled");
    for other in [body.clone(), transfer(A_USD, B_USD, AMOUNT + 1, "USD")] {
        let retry = app.post_transfer(TOKEN_A, &key, &other).await;
        assert_eq!(
            (retry.status, &retry.body),
            (409, &original.body),
            "whatever the body"
        );
    }
    assert_eq!(transfers_under(&app.pool, &key).await, 0);
    assert_eq!(app.balance(B_USD).await, 0, "nothing moved");
    assert_eq!(
        app.get(TOKEN_A, &format!("/idempotency-keys/{key}"))
            .await
            .json()["state"],
        "cancelled"
    );
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_completed_intent_is_not_cancelled_and_its_money_stays(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");
    let created = app.post_transfer(TOKEN_A, &key, &body).await;
    let refused = cancel(&app, TOKEN_A, &key).await;
    refused.assert_problem(409, "intent-completed");
    let transfer_id = created.json()["transfer_id"].as_str().unwrap().to_owned();
    let detail = refused.json()["detail"].as_str().unwrap().to_owned();
    assert!(
        detail.contains(&format!("/transfers/{transfer_id}")),
        "{detail}"
    );
    let replay = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!((replay.status, &replay.body), (201, &created.body));
    assert_eq!(app.balance(B_USD).await, AMOUNT);

    // Also after its record was purged: the transfer is found by its key.
    sqlx::query("DELETE FROM idempotency_keys WHERE idempotency_key = $1")
        .bind(&key)
        .execute(&app.pool)
        .await
        .unwrap();
    cancel(&app, TOKEN_A, &key)
        .await
        .assert_problem(409, "intent-completed");
    assert_eq!(transfers_under(&app.pool, &key).await, 1);
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_key_in_flight_is_not_cancelled_and_a_failed_one_is(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");
    claim_for_a(&app.pool, &key, &body).await;
    let in_flight = cancel(&app, TOKEN_A, &key).await;
    in_flight.assert_problem(409, "request-in-flight");
    assert!(in_flight.header("retry-after").is_some());

    sqlx::query("UPDATE idempotency_keys SET status = 'FAILED', locked_until = now() WHERE idempotency_key = $1")
        .bind(&key)
        .execute(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        cancel(&app, TOKEN_A, &key).await.json()["state"],
        "cancelled"
    );
    app.post_transfer(TOKEN_A, &key, &body)
        .await
        .assert_problem(409, "intent-cancelled");
    assert_eq!(transfers_under(&app.pool, &key).await, 0);
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_cancel_racing_its_original_wins_or_loses_but_never_both(pool: PgPool) {
    const KEYS: usize = 20;
    const ORIGINALS: usize = 10;
    let app = TestApp::spawn(pool).await;
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");
    let keys: Vec<String> = (0..KEYS).map(|_| new_key()).collect();
    let races = futures::future::join_all(keys.iter().map(|key| {
        let (app, body) = (&app, &body);
        async move {
            let originals = futures::future::join_all(
                (0..ORIGINALS).map(|_| app.post_transfer(TOKEN_A, key, body)),
            );
            let (cancelled, originals) = tokio::join!(cancel(app, TOKEN_A, key), originals);
            (key, cancelled, originals)
        }
    }))
    .await;
    let (mut cancel_won, mut original_won) = (0, 0);
    for (key, cancelled, originals) in &races {
        let moved = transfers_under(&app.pool, key).await;
        let created = originals.iter().filter(|r| r.status == 201).count();
        match cancelled.status {
            200 => {
                cancel_won += 1;
                assert_eq!(moved, 0, "cancelled, yet money moved under {key}");
                assert_eq!(created, 0);
                for reply in originals {
                    assert!(matches!(reply.status, 409), "{:?}", reply.body);
                }
            }
            409 => {
                original_won += 1;
                let slug = cancelled.json()["type"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                assert!(
                    slug.ends_with("intent-completed") || slug.ends_with("request-in-flight"),
                    "{slug}"
                );
                // The original ran (or runs): once.
                assert!(moved <= 1);
            }
            other => panic!("cancel answered {other}: {:?}", cancelled.body),
        }
    }
    // Every key ends: the losers of a race are retried until a final answer.
    for (key, _, _) in &races {
        let view: Value = loop {
            let view = app
                .get(TOKEN_A, &format!("/idempotency-keys/{key}"))
                .await
                .json();
            if view["state"] != "in_flight" {
                break view;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        };
        let moved = transfers_under(&app.pool, key).await;
        match view["state"].as_str() {
            Some("cancelled") => assert_eq!(moved, 0),
            Some("completed") => assert_eq!(moved, 1),
            other => panic!("{key} ended {other:?}"),
        }
    }
    println!(
        "cancel racing {ORIGINALS} originals on {KEYS} keys: cancel won {cancel_won}, original won {original_won}"
    );
    assert_eq!(cancel_won + original_won, KEYS);
    let total: i64 = scalar(
        &app.pool,
        "SELECT count(*) FROM transfers WHERE principal_id IS NOT NULL",
    )
    .await;
    assert_eq!(app.balance(B_USD).await, total * AMOUNT);
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn cancelling_a_key_of_the_same_name_never_touches_another_principal_s(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    assert_eq!(cancel(&app, TOKEN_B, &key).await.status, 200);
    let created = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, AMOUNT, "USD"))
        .await;
    assert_eq!(created.status, 201, "A's key is A's own");
    cancel(&app, "tok_nobody", &key)
        .await
        .assert_problem(401, "unauthorized");
    cancel(&app, TOKEN_A, &"k".repeat(256))
        .await
        .assert_problem(400, "invalid-idempotency-key");
}
