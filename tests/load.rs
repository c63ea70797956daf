#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Load held: duplicate storms on one key and on many, and transfers in
//! opposite directions and on one hot account, all at once. Counts, not
//! timings, are asserted.
mod common;

use std::collections::HashMap;

use common::*;
use futures::StreamExt;
use futures::future::join_all;
use sqlx::PgPool;

/// Checks the answers one key got in a storm: each is either the 201 (one
/// execution, every other 201 a byte-identical replay) or a 409 problem.
/// Returns the 201s.
fn assert_one_execution(key: &str, replies: &[Reply]) -> Vec<Reply> {
    let created: Vec<Reply> = replies
        .iter()
        .filter(|r| r.status == 201)
        .cloned()
        .collect();
    for reply in replies {
        match reply.status {
            201 => assert_eq!(reply.body, created[0].body, "{key}: replays differ"),
            409 => {
                reply.assert_problem(409, "request-in-flight");
                assert!(reply.header("retry-after").is_some());
            }
            other => panic!("{key}: {other} {:?}", reply.body),
        }
    }
    assert!(
        created.iter().filter(|r| !r.replayed()).count() <= 1,
        "{key} executed more than once"
    );
    created
}

/// Concurrent requests on one key in the first storm.
const ONE_KEY_STORM: usize = 500;

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn five_hundred_concurrent_requests_on_one_key_execute_once(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (key, body) = (new_key(), transfer(A_USD, B_USD, 777, "USD"));
    let replies =
        join_all((0..ONE_KEY_STORM).map(|_| app.post_transfer(TOKEN_A, &key, &body))).await;
    let mut created = assert_one_execution(&key, &replies);
    // Whoever lost the race now gets the replay.
    let last = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(last.status, 201);
    assert!(last.replayed());
    if let Some(first) = created.first() {
        assert_eq!(last.body, first.body);
    }
    created.push(last);
    let conflicts = replies.iter().filter(|r| r.status == 409).count();
    assert_each_intent_moved_once(&app.pool, &[(key, created.clone())]).await;
    assert_eq!(app.balance(B_USD).await, 777);
    assert_ledger_consistent(&app.pool).await;
    println!(
        "storm on one key: {ONE_KEY_STORM} concurrent requests, {} answered 201 (1 execution), \
         {conflicts} answered 409",
        created.len() - 1
    );
}

const STORM_INTENTS: usize = 1_000;
const STORM_COPIES: usize = 5;
/// Intents in flight at once (each with all its copies).
const STORM_INTENTS_IN_FLIGHT: usize = 40;

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_thousand_intents_sent_five_times_at_once_execute_once_each(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let intents: Vec<(String, serde_json::Value, i64)> = (0..STORM_INTENTS)
        .map(|i| {
            let amount = 1 + (i as i64 % 97);
            (new_key(), transfer(A_USD, B_USD, amount, "USD"), amount)
        })
        .collect();
    let storms: Vec<(String, Vec<Reply>)> = futures::stream::iter(intents.iter())
        .map(|(key, body, _)| {
            let app = &app;
            async move {
                let copies =
                    join_all((0..STORM_COPIES).map(|_| app.post_transfer(TOKEN_A, key, body)))
                        .await;
                (key.clone(), copies)
            }
        })
        .buffer_unordered(STORM_INTENTS_IN_FLIGHT)
        .collect()
        .await;
    let mut answers = Vec::new();
    let (mut created, mut conflicts) = (0, 0);
    let bodies: HashMap<&str, &serde_json::Value> =
        intents.iter().map(|(k, b, _)| (k.as_str(), b)).collect();
    for (key, replies) in &storms {
        let mut ok = assert_one_execution(key, replies);
        created += ok.len();
        conflicts += replies.len() - ok.len();
        if ok.is_empty() {
            // Every copy met the execution in flight: the key replays now.
            ok.push(app.post_transfer(TOKEN_A, key, bodies[key.as_str()]).await);
        }
        answers.push((key.clone(), ok));
    }
    assert_each_intent_moved_once(&app.pool, &answers).await;
    let moved: i64 = intents.iter().map(|(_, _, amount)| amount).sum();
    assert_eq!(app.balance(B_USD).await, moved);
    assert_ledger_consistent(&app.pool).await;
    println!(
        "storm on many keys: {STORM_INTENTS} intents x {STORM_COPIES} concurrent copies = {} \
         requests: {created} answered 201 ({STORM_INTENTS} executions, the rest identical \
         replays), {conflicts} answered 409",
        STORM_INTENTS * STORM_COPIES
    );
}

const CROSSING_TRANSFERS: usize = 600;
const CROSSING_CONCURRENCY: usize = 32;

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn opposite_directions_and_a_hot_account_never_surface_a_deadlock(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    // B needs money to send back.
    let funding = app
        .post_transfer(
            TOKEN_A,
            &new_key(),
            &transfer(A_USD, B_USD, 1_000_000, "USD"),
        )
        .await;
    assert_eq!(funding.status, 201);
    // Thirds: A to B and B to A in USD (opposite lock orders if the service
    // locked in request order), and A to B in EUR (one hot source account).
    let plan: Vec<(&str, &str, &str, &str, i64)> = (0..CROSSING_TRANSFERS)
        .map(|i| {
            let amount = 1 + i as i64 % 50;
            match i % 3 {
                0 => (TOKEN_A, A_USD, B_USD, "USD", amount),
                1 => (TOKEN_B, B_USD, A_USD, "USD", amount),
                _ => (TOKEN_A, A_EUR, B_EUR, "EUR", amount),
            }
        })
        .collect();
    let replies: Vec<Reply> = futures::stream::iter(plan.iter())
        .map(|&(token, from, to, currency, amount)| {
            let app = &app;
            async move {
                app.post_transfer(token, &new_key(), &transfer(from, to, amount, currency))
                    .await
            }
        })
        .buffer_unordered(CROSSING_CONCURRENCY)
        .collect()
        .await;
    assert_all_created(&replies);
    let sum = |from: &str| -> i64 { plan.iter().filter(|p| p.1 == from).map(|p| p.4).sum() };
    assert_eq!(
        app.balance(B_USD).await,
        1_000_000 + sum(A_USD) - sum(B_USD)
    );
    assert_eq!(app.balance(B_EUR).await, sum(A_EUR));
    assert_eq!(
        customer_transfer_count(&app.pool).await,
        CROSSING_TRANSFERS as i64 + 1
    );
    assert_ledger_consistent(&app.pool).await;
    println!(
        "crossing and hot: {CROSSING_TRANSFERS} transfers at {CROSSING_CONCURRENCY} concurrent \
         (A->B, B->A, A->B EUR), all 201, no deadlock or serialization error reached a client"
    );
}
