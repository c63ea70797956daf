#![allow(clippy::unwrap_used, clippy::expect_used)]
//! SIGTERM in the middle of a load: the server stops taking connections and
//! finishes every request it had accepted, so no request that reached a
//! handler is left without its answer or its key IN_PROGRESS.
mod common;

use std::time::Duration;

use common::process::*;
use common::*;
use sqlx::PgPool;
use tokio::time::Instant;

/// Enough concurrent clients that several requests are always in flight.
const CLIENTS: usize = 24;
const INTENTS_MAX: usize = 3_000;

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn sigterm_during_a_load_loses_no_accepted_request(pool: PgPool) {
    let mut server = ServerProcess::start(&database_url(&pool), &[]).await;
    let stream = TransferStream::start(&server.base, CLIENTS, Duration::ZERO, INTENTS_MAX);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let in_flight = scalar(
        &pool,
        "SELECT count(*) FROM idempotency_keys WHERE status = 'IN_PROGRESS'",
    )
    .await;
    server.terminate();
    let terminated_at = Instant::now();
    // Clients go on sending for a moment: those requests race the shutdown.
    tokio::time::sleep(Duration::from_millis(50)).await;
    stream.pause();
    let status = server.wait(Duration::from_secs(15)).await;
    let exited_in = terminated_at.elapsed();
    let sent = stream.stop().await;
    assert!(status.success(), "the server exits cleanly: {status:?}");

    for reply in sent.iter().filter_map(|s| s.first.as_ref()) {
        assert_eq!(reply.status, 201, "{:?}", reply.body);
    }
    // A request without an answer must never have reached the handler: no
    // claim, no transfer. Every request that reached it was answered.
    let unanswered: Vec<String> = sent
        .iter()
        .filter(|s| s.first.is_none())
        .map(|s| s.key.clone())
        .collect();
    let touched: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM idempotency_keys WHERE idempotency_key = ANY($1))
              + (SELECT count(*) FROM transfers WHERE idempotency_key = ANY($1))",
    )
    .bind(&unanswered)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(touched, 0, "a request was accepted but never answered");
    let answered: Vec<(String, Vec<Reply>)> = sent
        .iter()
        .filter_map(|s| s.first.clone().map(|r| (s.key.clone(), vec![r])))
        .collect();
    assert_each_intent_moved_once(&pool, &answered).await;
    let moved: i64 = sent
        .iter()
        .filter(|s| s.first.is_some())
        .map(|s| s.amount)
        .sum();
    assert_eq!(balance(&pool, B_USD).await, moved);
    assert_ledger_consistent(&pool).await;

    let finished_after_sigterm = sent
        .iter()
        .filter(|s| s.sent_at < terminated_at)
        .filter(|s| s.answered_at.is_some_and(|at| at > terminated_at))
        .count();
    println!(
        "graceful shutdown: SIGTERM with {CLIENTS} clients sending ({in_flight} claims in flight \
         just before), exit 0 after {exited_in:?}; {} answered (201), {finished_after_sigterm} of \
         them finished after SIGTERM; {} refused or cut, none of which had reached a handler",
        answered.len(),
        unanswered.len()
    );
}
