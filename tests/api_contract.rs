#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `openapi.yaml` against the server.

mod common;

use common::*;
use sqlx::PgPool;

/// A percent-encoded segment that is not UTF-8 names no resource: the same
/// `404` problem as any unknown id, not a plain-text `400`.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn non_utf8_path_segments_are_a_404_problem(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    for path in [
        "/accounts/%FF",
        "/accounts/%FF/entries",
        "/transfers/%C0%AF",
    ] {
        app.get(TOKEN_A, path)
            .await
            .assert_problem(404, "not-found");
    }
}

/// Cursors are accepted only as the server spells them.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn cursors_the_server_never_issued_are_refused(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    for cursor in ["e%2B5", "e05", "e0"] {
        app.get(
            TOKEN_A,
            &format!("/accounts/{A_USD}/entries?cursor={cursor}"),
        )
        .await
        .assert_problem(400, "invalid-query");
    }
    let page = app
        .get(TOKEN_A, &format!("/accounts/{A_USD}/entries?cursor=e5"))
        .await;
    assert_eq!(page.status, 200);
}
