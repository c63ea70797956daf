#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The primary of a real highly available PostgreSQL (pg_auto_failover,
//! `scripts/ha-cluster.sh`) fails under load, and no acknowledged transfer
//! is lost or doubled. Two service instances follow the primary through the
//! multi-host `DATABASE_URL`; clients send intents, each retried with its
//! key and body until a final answer, with duplicate storms mixed in.
//!
//! Needs the cluster: `.ci/steps/70-failover.sh` brings it up, sets
//! `NEXO_HA_URL` and runs these one at a time (`--features ha-cluster
//! --test failover -- --test-threads=1`); the test is built only with that
//! feature, so plain `cargo test` does not build it.
mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::process::*;
use common::*;
use serde_json::Value;
use sqlx::PgPool;
use tokio::sync::Mutex;
use tokio::time::Instant;

const CLIENTS: usize = 8;
const INTENTS: usize = 1_000;
/// The fault strikes once this many intents have their final answer.
const FAULT_AFTER: usize = 300;
/// Every tenth intent is sent three times at once, to both instances.
const STORM_EVERY: usize = 10;
/// Short, so a claim orphaned by the failover frees its key quickly.
const LEASE: &str = "3s";

fn ha_url() -> String {
    std::env::var("NEXO_HA_URL").expect("NEXO_HA_URL: run through .ci/steps/70-failover.sh")
}

fn cluster(command: &str) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/ha-cluster.sh");
    let output = Command::new("bash")
        .arg(script)
        .args(command.split_whitespace())
        .output()
        .expect("the cluster script runs");
    assert!(
        output.status.success(),
        "ha-cluster.sh {command}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A pool on whichever node is primary now.
async fn primary_pool() -> PgPool {
    let endpoints = nexo_transfers::db::Endpoints::parse(&ha_url()).unwrap();
    let url = endpoints.find_primary().await.unwrap().to_owned();
    PgPool::connect(&url).await.unwrap()
}

/// What one intent got: every 201 (its transfer id), and its final answer.
#[derive(Debug, Clone)]
struct Outcome {
    key: String,
    amount: i64,
    created: Vec<String>,
    final_status: u16,
    answered_at: Instant,
    server_errors: usize,
}

fn transfer_id(reply: &Reply) -> String {
    reply.json()["transfer_id"]
        .as_str()
        .expect("a 201 carries its transfer id")
        .to_owned()
}

/// Sends one intent until a final answer (201 or 422), alternating
/// instances; a storm intent is sent three times at once first.
async fn drive(client: &reqwest::Client, bases: &[String], i: usize) -> Outcome {
    let key = format!("fo-{}-{i}", uuid::Uuid::new_v4().simple());
    let amount = 100 + i64::try_from(i).unwrap();
    let body: Value = transfer(A_USD, B_USD, amount, "USD");
    let mut created = Vec::new();
    let mut server_errors = 0;
    if i.is_multiple_of(STORM_EVERY) {
        let storm = futures::future::join_all(
            (0..3)
                .map(|n| try_post_transfer(client, &bases[n % bases.len()], TOKEN_A, &key, &body)),
        )
        .await;
        for reply in storm.into_iter().flatten() {
            match reply.status {
                201 => created.push(transfer_id(&reply)),
                s if s >= 500 => server_errors += 1,
                _ => {}
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut attempt = i;
    loop {
        assert!(
            Instant::now() < deadline,
            "intent {key} got no final answer"
        );
        attempt += 1;
        let base = &bases[attempt % bases.len()];
        match try_post_transfer(client, base, TOKEN_A, &key, &body).await {
            Ok(reply) if reply.status == 201 => {
                created.push(transfer_id(&reply));
                return Outcome {
                    key,
                    amount,
                    created,
                    final_status: 201,
                    answered_at: Instant::now(),
                    server_errors,
                };
            }
            Ok(reply) if reply.status == 422 => {
                return Outcome {
                    key,
                    amount,
                    created,
                    final_status: 422,
                    answered_at: Instant::now(),
                    server_errors,
                };
            }
            Ok(reply) => {
                if reply.status >= 500 {
                    server_errors += 1;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Runs the load with `fault` striking after [`FAULT_AFTER`] answers;
/// returns every intent's outcome and when the fault struck.
async fn load_with_fault<F>(fault: F) -> (Vec<Outcome>, Instant, Duration)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let url = ha_url();
    let env = [
        ("NEXO_IDEMPOTENCY_LEASE", LEASE),
        ("NEXO_DB_ACQUIRE_TIMEOUT", "2s"),
    ];
    let servers = [
        ServerProcess::start(&url, &env).await,
        ServerProcess::start(&url, &env).await,
    ];
    let bases: Vec<String> = servers.iter().map(|s| s.base.clone()).collect();
    let client = fault_client(Duration::from_secs(10));
    let next = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(AtomicUsize::new(0));
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let workers: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (client, bases, next, answered, outcomes) = (
                client.clone(),
                bases.clone(),
                Arc::clone(&next),
                Arc::clone(&answered),
                Arc::clone(&outcomes),
            );
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= INTENTS {
                        return;
                    }
                    let outcome = drive(&client, &bases, i).await;
                    answered.fetch_add(1, Ordering::SeqCst);
                    outcomes.lock().await.push(outcome);
                }
            })
        })
        .collect();
    while answered.load(Ordering::SeqCst) < FAULT_AFTER {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let struck_at = Instant::now();
    fault.await;
    for worker in workers {
        worker.await.unwrap();
    }
    let elapsed = started.elapsed();
    for server in servers {
        server.kill().await;
    }
    let outcomes = outcomes.lock().await.clone();
    (outcomes, struck_at, elapsed)
}

/// Every intent answered 201 exists exactly once on the primary, with the
/// transfer id and amount it was answered with; the ledger reconciles.
async fn assert_nothing_lost_or_doubled(
    name: &str,
    outcomes: &[Outcome],
    struck_at: Instant,
    elapsed: Duration,
) {
    let pool = primary_pool().await;
    let principal: uuid::Uuid =
        sqlx::query_scalar("SELECT id FROM principals WHERE name = 'demo-a'")
            .fetch_one(&pool)
            .await
            .unwrap();
    let (mut lost, mut doubled, mut created) = (0, 0, 0);
    for outcome in outcomes {
        let rows: Vec<(uuid::Uuid, i64)> = sqlx::query_as(
            "SELECT id, amount_minor FROM transfers WHERE principal_id = $1 AND idempotency_key = $2",
        )
        .bind(principal)
        .bind(&outcome.key)
        .fetch_all(&pool)
        .await
        .unwrap();
        if outcome.final_status == 201 {
            created += 1;
        }
        doubled += rows.len().saturating_sub(1);
        let distinct: std::collections::HashSet<&String> = outcome.created.iter().collect();
        doubled += distinct.len().saturating_sub(1);
        for id in distinct {
            match rows.as_slice() {
                [(row_id, amount)] if &row_id.to_string() == id && *amount == outcome.amount => {}
                _ => lost += 1,
            }
        }
    }
    // The longest stretch without a 201 from the fault on: how long the
    // service stood still while the cluster failed over.
    let mut answers: Vec<Instant> = outcomes
        .iter()
        .filter(|o| o.final_status == 201 && o.answered_at > struck_at)
        .map(|o| o.answered_at)
        .collect();
    answers.sort();
    let stood_still = answers
        .iter()
        .scan(struck_at, |previous, &at| {
            let gap = at - *previous;
            *previous = at;
            Some(gap)
        })
        .max()
        .unwrap_or_default();
    let server_errors: usize = outcomes.iter().map(|o| o.server_errors).sum();
    println!(
        "failover ({name}): {} intents in {elapsed:?} ({created} answered 201), acknowledged lost: \
         {lost}, doubled: {doubled}, longest time without a 201 after the fault: {stood_still:?}, \
         5xx answers: {server_errors}",
        outcomes.len()
    );
    assert_eq!(outcomes.len(), INTENTS, "every intent got a final answer");
    assert_eq!(lost, 0, "acknowledged transfers lost");
    assert_eq!(doubled, 0, "transfers doubled");
    let (code, stdout, stderr) =
        run_cli(&ha_url(), &["reconcile", "--idempotency-ttl", "24h"]).await;
    assert_eq!(code, 0, "reconcile:\n{stdout}\n{stderr}");
}

async fn healthy_again() {
    cluster("rejoin");
    cluster("wait-healthy");
}

#[tokio::test]
async fn the_primary_killed_under_load_loses_and_doubles_nothing() {
    cluster("wait-healthy");
    let (outcomes, struck_at, elapsed) = load_with_fault(async {
        cluster("kill-primary");
    })
    .await;
    assert_nothing_lost_or_doubled("primary killed", &outcomes, struck_at, elapsed).await;
    healthy_again().await;
}

/// The standby stops confirming (its WAL receiver is stopped) while the
/// commits waiting for it are cancelled, which PostgreSQL then reports as
/// committed; then the primary dies and the standby, which never got them,
/// is promoted. None of those commits may have been acknowledged.
#[tokio::test]
async fn cancelled_replication_waits_then_a_failover_lose_nothing_acknowledged() {
    cluster("wait-healthy");
    let (outcomes, struck_at, elapsed) = load_with_fault(async {
        let primary = primary_pool().await;
        let receivers = pgrep("walreceiver");
        assert!(!receivers.is_empty(), "the standby streams");
        signal(&receivers, "-STOP");
        let mut cancelled = 0_i64;
        let until = Instant::now() + Duration::from_secs(2);
        while Instant::now() < until {
            cancelled += sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FILTER (WHERE pg_cancel_backend(pid)) FROM pg_stat_activity
                 WHERE wait_event = 'SyncRep'",
            )
            .fetch_one(&primary)
            .await
            .unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        primary.close().await;
        println!("cancelled {cancelled} commits waiting for the standby");
        assert!(
            cancelled > 0,
            "commits were waiting for the stalled standby"
        );
        cluster("kill-primary");
        signal(&receivers, "-CONT");
    })
    .await;
    assert_nothing_lost_or_doubled(
        "cancelled waits, then primary killed",
        &outcomes,
        struck_at,
        elapsed,
    )
    .await;
    healthy_again().await;
}

/// The standby goes away for a while and comes back; no failover.
#[tokio::test]
async fn the_standby_away_for_a_while_loses_nothing() {
    cluster("wait-healthy");
    let (outcomes, struck_at, elapsed) = load_with_fault(async {
        cluster("stop-standby");
        tokio::time::sleep(Duration::from_secs(5)).await;
        cluster("start-standby");
    })
    .await;
    assert_nothing_lost_or_doubled("standby away 5 s", &outcomes, struck_at, elapsed).await;
    cluster("wait-healthy");
}

fn pgrep(pattern: &str) -> Vec<String> {
    let output = Command::new("pgrep")
        .args(["-f", pattern])
        .output()
        .unwrap();
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

fn signal(pids: &[String], signal: &str) {
    let status = Command::new("kill")
        .arg(signal)
        .args(pids)
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal} {pids:?}");
}
