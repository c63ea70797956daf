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
