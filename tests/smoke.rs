#![allow(clippy::unwrap_used, clippy::expect_used)]
mod common;

use common::*;

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_transfer_moves_money_once_and_replays(pool: sqlx::PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let body = transfer(A_USD, B_USD, 10_000, "USD");
    let first = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(first.status, 201);
    let second = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(second.status, 201);
    assert!(second.replayed());
    assert_eq!(first.body, second.body);
    assert_eq!(app.balance(B_USD).await, 10_000);
    assert_ledger_consistent(&app.pool).await;
}
