#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Many transfers from one account at once: the service batches them, and
//! each must still post once, be refused alone when it would overdraw, and
//! replay its own answer.
mod common;

use common::*;

/// Enough concurrent transfers that later ones queue behind a running batch.
const TRANSFERS: usize = 30;
/// Twenty of these drain the opening balance exactly.
const AMOUNT: i64 = OPENING_BALANCE / 20;

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn concurrent_transfers_from_one_account_post_once_each_and_overdrafts_fail_alone(
    pool: sqlx::PgPool,
) {
    let app = TestApp::spawn(pool).await;
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");
    let keys: Vec<String> = (0..TRANSFERS).map(|_| new_key()).collect();

    let replies = futures::future::join_all(
        keys.iter()
            .map(|key| app.post_transfer(TOKEN_A, key, &body)),
    )
    .await;

    let created = replies.iter().filter(|r| r.status == 201).count();
    for refused in replies.iter().filter(|r| r.status != 201) {
        refused.assert_problem(422, "insufficient-funds");
    }
    assert_eq!(created, 20, "exactly the transfers the balance covers");
    assert_eq!(app.balance(A_USD).await, 0);
    assert_eq!(app.balance(B_USD).await, 20 * AMOUNT);
    assert_eq!(customer_transfer_count(&app.pool).await, 20);
    for (key, first) in keys.iter().zip(&replies) {
        let again = app.post_transfer(TOKEN_A, key, &body).await;
        assert_eq!((again.status, &again.body), (first.status, &first.body));
        assert!(again.replayed());
    }
    assert_eq!(customer_transfer_count(&app.pool).await, 20);
    assert_ledger_consistent(&app.pool).await;
}

/// A batch completes all its claims in one statement; a claim taken over
/// meanwhile must not count, so the batch knows to roll back.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn completing_a_batch_counts_only_the_claims_still_held(pool: sqlx::PgPool) {
    use nexo_transfers::idempotency::{
        ClaimOutcome, Fingerprint, IdempotencyKey, Scope, StoredResponse, store,
    };
    let app = TestApp::spawn(pool).await;
    let scope = Scope(
        sqlx::query_scalar("SELECT id FROM principals WHERE name = 'demo-a'")
            .fetch_one(&app.pool)
            .await
            .unwrap(),
    );
    let fingerprint = Fingerprint::compute("POST", "/transfers", b"{}");
    let mut claims = Vec::new();
    for key in [new_key(), new_key()] {
        let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
        let outcome = store::claim(
            &app.pool,
            default_policy(),
            scope,
            &key,
            "POST",
            "/transfers",
            &fingerprint,
        )
        .await
        .unwrap();
        let ClaimOutcome::Claimed(claim) = outcome else {
            panic!("a fresh key must be claimed");
        };
        claims.push(claim);
    }
    // Someone else takes the second claim over: it gets a new token.
    sqlx::query("UPDATE idempotency_keys SET lock_token = $1 WHERE idempotency_key = $2")
        .bind(uuid::Uuid::new_v4())
        .bind(claims[1].key.as_str())
        .execute(&app.pool)
        .await
        .unwrap();
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".to_owned(), "application/json".to_owned())],
        body: bytes::Bytes::from_static(b"{}"),
    };

    let mut tx = app.pool.begin().await.unwrap();
    let completed = store::complete_all(
        &mut tx,
        &[(&claims[0], &response, None), (&claims[1], &response, None)],
    )
    .await
    .unwrap();
    assert_eq!(completed, 1, "only the claim still held completes");
    tx.rollback().await.unwrap();

    for claim in &claims {
        let rows = key_rows(&app.pool, claim.key.as_str()).await;
        assert_eq!(rows, vec![("IN_PROGRESS".to_owned(), None)]);
    }
}
