#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The process dies with SIGKILL at random moments while transfers stream
//! in; after each death a new process starts on the same database. Every
//! intent that got no answer is retried with its key and body until it is
//! answered, and the ledger must show each intent moved once.
mod common;

use std::time::Duration;

use common::process::*;
use common::*;
use rand::Rng;
use sqlx::PgPool;

/// SIGKILLs per run.
const KILLS: usize = 4;
/// Concurrent clients in the stream.
const CLIENTS: usize = 12;
/// Each client pauses this long between intents, so that the stream spans
/// all the kills without needing thousands of requests.
const PACE: Duration = Duration::from_millis(15);
/// Upper bound on intents in one run.
const INTENTS_MAX: usize = 2_000;
/// How long a killed process leaves a key blocked; the retry phase waits it out.
const LEASE: &str = "2s";

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn sigkill_at_random_moments_loses_nothing_and_moves_nothing_twice(pool: PgPool) {
    let url = database_url(&pool);
    let env = [("NEXO_IDEMPOTENCY_LEASE", LEASE)];
    let mut server = ServerProcess::start(&url, &env).await;
    let stream = TransferStream::start(&server.base, CLIENTS, PACE, INTENTS_MAX);
    for _ in 0..KILLS {
        let wait = rand::rng().random_range(100..700);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        stream.pause();
        server.kill().await;
        server = ServerProcess::start(&url, &env).await;
        stream.retarget(&server.base);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sent = stream.stop().await;

    for s in &sent {
        if let Some(reply) = &s.first {
            // A live server answers a fresh key with 201 or nothing at all.
            assert_eq!(
                reply.status,
                201,
                "{}",
                String::from_utf8_lossy(&reply.body)
            );
        }
    }
    let unanswered = sent.iter().filter(|s| s.first.is_none()).count();
    let states_after_kills = key_status_counts(&pool).await;

    // Retry every unanswered intent, and replay every answered one, on the
    // last process.
    let answers = retry_all(&sent, &server.base).await;
    let replayed_after_loss = sent
        .iter()
        .zip(&answers)
        .filter(|(s, (_, replies))| s.first.is_none() && replies[0].replayed())
        .count();
    assert_each_intent_moved_once(&pool, &answers).await;
    let moved = total_amount(&sent);
    assert_eq!(balance(&pool, B_USD).await, moved);
    assert_eq!(balance(&pool, A_USD).await, OPENING_BALANCE - moved);
    assert_ledger_consistent(&pool).await;

    println!(
        "crash: {KILLS} SIGKILLs, {} intents, {unanswered} unanswered ({replayed_after_loss} of \
         them had committed and replayed on retry), records right after the kills: \
         {states_after_kills:?}",
        sent.len(),
    );
    assert!(unanswered > 0, "no kill landed on a request in flight");
}
