#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The process dies with SIGKILL at random moments while transfers stream
//! in; after each death a new process starts on the same database. Every
//! intent that got no answer is retried with its key and body until it is
//! answered, and the ledger must show each intent moved once.
mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use common::process::*;
use common::*;
use rand::Rng;
use sqlx::PgPool;
use tokio::time::Instant;

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

struct Sent {
    key: String,
    body: serde_json::Value,
    amount: i64,
    first: Option<Reply>,
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn sigkill_at_random_moments_loses_nothing_and_moves_nothing_twice(pool: PgPool) {
    let url = database_url(&pool);
    let env = [("NEXO_IDEMPOTENCY_LEASE", LEASE)];
    let first = ServerProcess::start(&url, &env).await;
    let current: Arc<RwLock<Option<String>>> = Arc::new(RwLock::new(Some(first.base.clone())));
    let stop = Arc::new(AtomicBool::new(false));
    let counter = Arc::new(AtomicUsize::new(0));

    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (current, stop, counter) = (current.clone(), stop.clone(), counter.clone());
        clients.push(tokio::spawn(async move {
            let client = fault_client(Duration::from_secs(10));
            let mut sent = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let Some(base) = current.read().unwrap().clone() else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                if counter.fetch_add(1, Ordering::SeqCst) >= INTENTS_MAX {
                    break;
                }
                let amount = rand::rng().random_range(1..=100);
                let key = new_key();
                let body = transfer(A_USD, B_USD, amount, "USD");
                let first = try_post_transfer(&client, &base, TOKEN_A, &key, &body)
                    .await
                    .ok();
                sent.push(Sent {
                    key,
                    body,
                    amount,
                    first,
                });
                tokio::time::sleep(PACE).await;
            }
            sent
        }));
    }

    let mut server = first;
    for _ in 0..KILLS {
        let wait = rand::rng().random_range(100..700);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        *current.write().unwrap() = None;
        server.kill().await;
        server = ServerProcess::start(&url, &env).await;
        *current.write().unwrap() = Some(server.base.clone());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    let mut sent: Vec<Sent> = Vec::new();
    for client in clients {
        sent.extend(client.await.unwrap());
    }

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
    let unanswered: Vec<&Sent> = sent.iter().filter(|s| s.first.is_none()).collect();
    let states_after_kills = key_status_counts(&pool).await;

    // Retry every unanswered intent, and replay every answered one, on the
    // last process.
    let client = fault_client(Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(60);
    let retries =
        futures::future::join_all(
            sent.iter().map(|s| {
                let (client, base) = (client.clone(), server.base.clone());
                async move {
                    send_until_answered(&client, &base, TOKEN_A, &s.key, &s.body, deadline).await
                }
            }),
        )
        .await;

    let mut answers = Vec::new();
    let mut replayed_after_loss = 0;
    for (s, retry) in sent.iter().zip(retries) {
        assert!(retry.replayed() || s.first.is_none(), "{} ran twice", s.key);
        if let Some(first) = &s.first {
            assert_eq!(
                first.body, retry.body,
                "a replay differs from the first answer"
            );
        } else if retry.replayed() {
            replayed_after_loss += 1;
        }
        let mut replies = vec![retry];
        replies.extend(s.first.clone());
        answers.push((s.key.clone(), replies));
    }
    assert_each_intent_moved_once(&pool, &answers).await;
    let moved: i64 = sent.iter().map(|s| s.amount).sum();
    assert_eq!(balance(&pool, B_USD).await, moved);
    assert_eq!(balance(&pool, A_USD).await, OPENING_BALANCE - moved);
    assert_ledger_consistent(&pool).await;

    println!(
        "crash: {KILLS} SIGKILLs, {} intents, {} unanswered ({replayed_after_loss} of them had \
         committed and replayed on retry), records right after the kills: {states_after_kills:?}",
        sent.len(),
        unanswered.len(),
    );
    assert!(
        !unanswered.is_empty(),
        "no kill landed on a request in flight"
    );
}
