#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The seed's "lying timeout": the server did the work but the client never
//! saw the answer. A proxy between them delivers each request and then
//! loses the response, or hangs up before the server can answer; the
//! client retries with the same key and body.
mod common;

use std::time::Duration;

use common::process::*;
use common::proxy::{Behaviour, TcpProxy, http_body};
use common::*;
use sqlx::PgPool;
use tokio::time::Instant;

/// Intents per test; each one loses its first answer.
const INTENTS: usize = 20;

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_lost_response_is_replayed_on_retry_and_debits_once(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let proxy = TcpProxy::start(app.addr).await;
    let client = fault_client(Duration::from_secs(10));
    let mut moved = 0;
    for i in 0..INTENTS {
        let (key, amount) = (new_key(), 100 + i as i64);
        let body = transfer(A_USD, B_USD, amount, "USD");
        let debits_before = entry_count(&app.pool, A_USD).await;

        proxy.misbehave(Behaviour::DropResponse, 1);
        let lost = try_post_transfer(&client, &proxy.base(), TOKEN_A, &key, &body).await;
        assert!(lost.is_err(), "the proxy should have swallowed the answer");
        let original = proxy.dropped_responses()[i].clone();
        assert!(
            original.starts_with(b"HTTP/1.1 201"),
            "the server answered 201"
        );

        let retry = try_post_transfer(&client, &proxy.base(), TOKEN_A, &key, &body)
            .await
            .expect("the retry is answered");
        assert_eq!(retry.status, 201);
        assert!(retry.replayed(), "the retry must not execute again");
        assert_eq!(
            retry.body.as_ref(),
            http_body(&original),
            "the replay is byte for byte the lost answer"
        );
        assert_eq!(entry_count(&app.pool, A_USD).await, debits_before + 1);
        moved += amount;
    }
    assert_eq!(customer_transfer_count(&app.pool).await, INTENTS as i64);
    assert_eq!(app.balance(B_USD).await, moved);
    assert_ledger_consistent(&app.pool).await;
    println!(
        "lost response: {INTENTS} answers dropped after the server wrote them, {INTENTS} replays byte-identical, one debit each"
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_client_that_hangs_up_mid_request_leaves_no_key_blocked(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let proxy = TcpProxy::start(app.addr).await;
    let client = fault_client(Duration::from_secs(10));
    let intents: Vec<(String, serde_json::Value)> = (0..INTENTS)
        .map(|i| (new_key(), transfer(A_USD, B_USD, 100 + i as i64, "USD")))
        .collect();
    // Hang up 0, 1, 2, ... ms after the request is delivered, so that the
    // cut lands before the claim, during it, and during the posting.
    for (i, (key, body)) in intents.iter().enumerate() {
        let delay = Duration::from_millis(i as u64);
        proxy.misbehave(Behaviour::HangUpAfterRequest(delay), 1);
        let cut = try_post_transfer(&client, &proxy.base(), TOKEN_A, key, body).await;
        assert!(cut.is_err(), "the proxy should have hung up");
    }
    // The work a hang-up interrupted finishes by itself, well within the
    // 30 s lease: no key is left IN_PROGRESS for a retry to wait out.
    let settle_deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let in_progress = scalar(
            &app.pool,
            "SELECT count(*) FROM idempotency_keys WHERE status = 'IN_PROGRESS'",
        )
        .await;
        if in_progress == 0 {
            break;
        }
        assert!(
            Instant::now() < settle_deadline,
            "{in_progress} claims left IN_PROGRESS by hang-ups"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let mut answers = Vec::new();
    let mut replayed = 0;
    for (key, body) in &intents {
        let reply = try_post_transfer(&client, &proxy.base(), TOKEN_A, key, body)
            .await
            .expect("answered");
        assert_eq!(reply.status, 201, "no retry has to wait for a lease");
        replayed += usize::from(reply.replayed());
        answers.push((key.clone(), vec![reply]));
    }
    assert_each_intent_moved_once(&app.pool, &answers).await;
    assert_ledger_consistent(&app.pool).await;
    println!(
        "hang-up: {INTENTS} requests cut 0 to {} ms after delivery; {replayed} had already moved \
         their money and replayed, the rest executed on retry; no key left IN_PROGRESS",
        INTENTS - 1
    );
}
