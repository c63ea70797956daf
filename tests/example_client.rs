#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The example client (`examples/transfer_client.rs`, compiled in here as
//! is) against the real server: a response lost on the way back is retried
//! with the same key and the client ends with the replay of the one
//! transfer; an in-flight key is retried no sooner than `Retry-After`.

mod common;

#[allow(dead_code)] // its `main` and command line are for `cargo run --example`
#[path = "../examples/transfer_client.rs"]
mod transfer_client;

use std::time::Duration;

use common::proxy::{Behaviour, TcpProxy, http_body};
use common::*;
use nexo_transfers::db::KeyPool;
use nexo_transfers::idempotency::{ClaimOutcome, IdempotencyKey, Policy, store};
use nexo_transfers::principal::PrincipalId;
use nexo_transfers::transfers::intent::{ROUTE, TransferBody, TransferIntent};
use sqlx::PgPool;
use transfer_client::{AttemptResult, Intent, Outcome, RetryPolicy, TransferRequest};

fn request(amount_minor: i64) -> TransferRequest {
    TransferRequest {
        from: A_USD.to_owned(),
        to: B_USD.to_owned(),
        amount_minor,
        currency: "USD".to_owned(),
        description: None,
    }
}

/// Runs the client's real retry loop with its default policy; returns its
/// outcome and the lines it printed.
async fn run_client(base_url: &str, intent: &Intent) -> (Outcome, String) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let mut log = Vec::new();
    let outcome = transfer_client::send(
        &http,
        base_url,
        TOKEN_A,
        intent,
        &RetryPolicy::default(),
        &mut log,
    )
    .await;
    let log = String::from_utf8(log).unwrap();
    (outcome.unwrap_or_else(|e| panic!("{e}: {log}")), log)
}

/// The seed's story: the client's first attempt reaches the server, which
/// moves the money, but the answer is lost. The client retries with the
/// same key and gets the original transfer and receipt, replayed; the
/// ledger holds one transfer.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_lost_response_is_retried_into_the_replay_of_the_one_transfer(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    // Forwards the first request, reads the server's whole answer (so the
    // transfer is done) and closes the client's connection without it.
    let proxy = TcpProxy::start(app.addr).await;
    proxy.misbehave(Behaviour::DropResponse, 1);
    let intent = Intent::new(&request(10_000));

    let (outcome, log) = run_client(&proxy.base(), &intent).await;

    let lost = proxy.dropped_responses();
    assert_eq!(lost.len(), 1, "the proxy lost exactly the first answer");
    let lost = &lost[0];
    assert!(
        lost.starts_with(b"HTTP/1.1 201"),
        "{}",
        String::from_utf8_lossy(lost)
    );
    assert_eq!(outcome.attempts.len(), 2, "{log}");
    assert!(
        matches!(outcome.attempts[0].result, AttemptResult::NoAnswer { .. }),
        "{log}"
    );
    assert_eq!(
        outcome.attempts[1].result,
        AttemptResult::Answer {
            status: 201,
            replayed: true
        },
        "{log}"
    );
    assert_eq!(outcome.status, 201);
    assert!(outcome.replayed, "the final answer is the replay");
    assert_eq!(
        outcome.body.as_ref(),
        http_body(lost),
        "the replay is byte for byte the answer that was lost"
    );
    let (original, replay): (serde_json::Value, serde_json::Value) = (
        serde_json::from_slice(http_body(lost)).unwrap(),
        serde_json::from_slice(&outcome.body).unwrap(),
    );
    assert_eq!(replay["transfer_id"], original["transfer_id"]);
    assert_eq!(replay["receipt"], original["receipt"]);
    assert_eq!(
        log.lines().filter(|l| l.contains(intent.key())).count(),
        2,
        "both attempts used the intent's one key: {log}"
    );

    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(entry_count(&app.pool, B_USD).await, 1);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - 10_000);
    assert_eq!(app.balance(B_USD).await, 10_000);
    assert_ledger_consistent(&app.pool).await;
}

/// A key still held by an earlier attempt (here a claim whose owner died)
/// answers 409 with `Retry-After: 1`; the client waits at least that long,
/// and once the lease is over its retry takes the key over and executes.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn an_in_flight_key_is_retried_no_sooner_than_retry_after(pool: PgPool) {
    let lease = Duration::from_secs(1);
    let policy = Policy {
        ttl: Duration::from_secs(3600),
        lease,
        retention: Duration::from_secs(7200),
    };
    let app = TestApp::spawn_with(pool, policy, default_http()).await;
    let body = request(2_500);
    let intent = Intent::new(&body);

    let principal: PrincipalId =
        sqlx::query_scalar("SELECT id FROM principals WHERE name = 'demo-a'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    let parsed: TransferBody =
        serde_json::from_value(serde_json::to_value(&body).unwrap()).unwrap();
    let fingerprint = TransferIntent::parse(&parsed).unwrap().fingerprint();
    let key = IdempotencyKey::parse(intent.key().as_bytes()).unwrap();
    let claimed = store::claim(
        &KeyPool::beside(&app.pool),
        policy,
        principal,
        &key,
        "POST",
        ROUTE,
        &fingerprint,
    )
    .await
    .unwrap();
    assert!(matches!(claimed, ClaimOutcome::Claimed(_)));

    let (outcome, log) = run_client(&app.base, &intent).await;

    assert_eq!(
        outcome.attempts[0].result,
        AttemptResult::Answer {
            status: 409,
            replayed: false
        },
        "{log}"
    );
    for pair in outcome.attempts.windows(2) {
        assert!(
            pair[1].started - pair[0].started >= Duration::from_secs(1),
            "a retry after a 409 waited less than Retry-After: {log}"
        );
    }
    assert_eq!(outcome.status, 201, "{log}");
    assert!(!outcome.replayed, "the retry executed the intent: {log}");
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(app.balance(B_USD).await, 2_500);
    assert_ledger_consistent(&app.pool).await;
}

#[test]
fn every_intent_gets_its_own_key() {
    let body = request(100);
    let (first, second) = (Intent::new(&body), Intent::new(&body));
    assert_ne!(first.key(), second.key());
    assert!(IdempotencyKey::parse(first.key().as_bytes()).is_ok());
}

#[test]
fn backoff_is_jittered_capped_and_never_shorter_than_retry_after() {
    let policy = RetryPolicy::default();
    for retry in 1..=12 {
        let ceiling = policy
            .backoff_base
            .saturating_mul(1 << (retry - 1))
            .min(policy.backoff_cap);
        let delays: Vec<Duration> = (0..200).map(|_| policy.delay(retry, None)).collect();
        assert!(delays.iter().all(|d| *d <= ceiling), "retry {retry}");
        if ceiling >= Duration::from_millis(100) {
            assert!(
                delays.iter().any(|d| *d != delays[0]),
                "retry {retry}: no jitter"
            );
        }
        let after = Duration::from_secs(3);
        assert!(
            (0..50).all(|_| policy.delay(retry, Some(after)) >= after),
            "retry {retry}: sooner than Retry-After"
        );
    }
    assert_eq!(
        policy.delay(1, Some(Duration::from_secs(24 * 3600))),
        policy.retry_after_max
    );
}

#[test]
fn only_answers_that_may_change_are_retried() {
    use reqwest::StatusCode;
    for status in [409, 429, 500, 502, 503, 504] {
        assert!(transfer_client::is_retryable_status(
            StatusCode::from_u16(status).unwrap()
        ));
    }
    for status in [200, 201, 400, 401, 404, 413, 415, 422] {
        assert!(!transfer_client::is_retryable_status(
            StatusCode::from_u16(status).unwrap()
        ));
    }
}

#[test]
fn retry_after_is_read_as_seconds_or_a_date() {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("retry-after", "7".parse().unwrap());
    assert_eq!(
        transfer_client::retry_after(&headers),
        Some(Duration::from_secs(7))
    );
    let soon = std::time::SystemTime::now() + Duration::from_secs(120);
    headers.insert(
        "retry-after",
        httpdate::fmt_http_date(soon).parse().unwrap(),
    );
    let wait = transfer_client::retry_after(&headers).unwrap();
    assert!(wait > Duration::from_secs(100) && wait <= Duration::from_secs(120));
    headers.insert("retry-after", "soon".parse().unwrap());
    assert_eq!(transfer_client::retry_after(&headers), None);
}
