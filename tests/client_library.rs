#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The client library (`crates/nexo-client`) against the real server: lost
//! answers are retried under the intent's one key and the ledger shows the
//! money moved once; refusals are final and typed; a key held by another
//! request is retried no sooner than `Retry-After`; and every route a
//! caller uses answers in its typed form.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::proxy::{Behaviour, TcpProxy, http_body};
use common::*;
use nexo_client::{
    Attempt, AttemptResult, Client, Error, IdempotencyKey, KeyAnswer, KeyStatus, NextStep,
    PageQuery, ProblemType, Readiness, RetryPolicy, TransferIntent, TransferQuery, TransferRequest,
    TransferStatus,
};
use nexo_transfers::db::KeyPool;
use nexo_transfers::idempotency::{self, ClaimOutcome, Policy, store};
use nexo_transfers::transfers::intent::{ROUTE, TransferBody, TransferIntent as ServerIntent};
use sqlx::PgPool;

/// A client of `base` as principal A that records every attempt.
fn client(base: &str, token: &str) -> (Client, Arc<Mutex<Vec<Attempt>>>) {
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let seen = attempts.clone();
    let client = Client::builder(base)
        .token(token)
        .attempt_timeout(Duration::from_secs(10))
        .on_attempt(move |a| seen.lock().unwrap().push(a.clone()))
        .build()
        .unwrap();
    (client, attempts)
}

fn request(amount_minor: i64) -> TransferRequest {
    TransferRequest::new(A_USD, B_USD, amount_minor, "USD")
}

/// The first answers are lost on the way back (the proxy delivers the
/// request, reads the server's whole answer and closes the client's
/// connection without it). The library retries with the intent's one key
/// and ends with the replay of the one transfer; the ledger holds it once.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn lost_answers_are_retried_under_one_key_and_the_money_moves_once(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let proxy = TcpProxy::start(app.addr).await;
    proxy.misbehave(Behaviour::DropResponse, 2);
    let (client, attempts) = client(&proxy.base(), TOKEN_A);
    let intent = TransferIntent::new(request(10_000));

    let outcome = client.send_transfer(&intent).await.unwrap();

    let lost = proxy.dropped_responses();
    assert_eq!(lost.len(), 2, "the proxy lost the first two answers");
    assert!(lost[0].starts_with(b"HTTP/1.1 201"), "{lost:?}");
    assert_eq!(outcome.attempts.len(), 3);
    assert_eq!(attempts.lock().unwrap().len(), 3);
    for attempt in &outcome.attempts[..2] {
        assert!(
            matches!(attempt.result, AttemptResult::NoAnswer { .. }),
            "{attempt}"
        );
        assert!(matches!(attempt.next, NextStep::RetryIn(_)), "{attempt}");
    }
    for attempt in &outcome.attempts {
        assert_eq!(attempt.idempotency_key.as_ref(), Some(intent.key()));
    }
    assert_eq!(outcome.status, 201);
    assert!(outcome.replayed, "the final answer is the replay");
    assert_eq!(
        outcome.body.as_ref(),
        http_body(&lost[0]),
        "the replay is byte for byte the first answer, which was lost"
    );
    assert_eq!(
        outcome.location.as_deref(),
        Some(format!("/transfers/{}", outcome.transfer.transfer_id).as_str())
    );

    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(transfers_under(&app.pool, intent.key().as_str()).await, 1);
    assert_eq!(entry_count(&app.pool, B_USD).await, 1);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - 10_000);
    assert_eq!(app.balance(B_USD).await, 10_000);
    assert_ledger_consistent(&app.pool).await;

    let state = client.get_idempotency_key(intent.key()).await.unwrap();
    assert_eq!(state.state, KeyStatus::Completed);
    assert_eq!(state.answer, Some(KeyAnswer::Stored));
    assert_eq!(state.response_status, Some(201));
    assert_eq!(state.transfer_id, Some(outcome.transfer.transfer_id));
}

/// A 422 is final: one attempt, typed, nothing moved, and (for the
/// refusal the server stores) the same refusal replayed to the intent's
/// next send.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_422_is_not_retried(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (client, attempts) = client(&app.base, TOKEN_A);
    let overdraft = TransferIntent::new(request(OPENING_BALANCE * 10));

    let error = client.send_transfer(&overdraft).await.unwrap_err();

    assert_eq!(attempts.lock().unwrap().len(), 1, "a 422 is not retried");
    let Error::Problem(problem) = &error else {
        panic!("{error:?}");
    };
    assert_eq!(problem.status, 422);
    assert_eq!(
        problem.problem.problem_type(),
        ProblemType::InsufficientFunds
    );
    assert_eq!(problem.problem.type_uri, "/problems/insufficient-funds");
    assert!(!problem.problem.title.is_empty() && !problem.problem.detail.is_empty());
    assert!(
        problem
            .problem
            .request_id
            .as_deref()
            .is_some_and(|id| !id.is_empty())
    );
    assert!(!problem.replayed);
    assert!(!error.is_retryable());

    // The refusal is stored under the key: sending the intent again gets
    // it replayed, byte for byte.
    let again = client.send_transfer(&overdraft).await.unwrap_err();
    let replayed = again.problem().unwrap();
    assert!(replayed.replayed, "the replay header is reported");
    assert_eq!(replayed.body, problem.body);
    assert_eq!(attempts.lock().unwrap().len(), 2);

    // Another body under a completed key: refused, and not retried.
    let completed = TransferIntent::new(request(300));
    client.send_transfer(&completed).await.unwrap();
    let reused = TransferIntent::resume(completed.key().clone(), request(301));
    let error = client.send_transfer(&reused).await.unwrap_err();
    assert_eq!(
        error.problem_type(),
        Some(ProblemType::IdempotencyKeyReused)
    );
    assert_eq!(attempts.lock().unwrap().len(), 4);

    // A validation failure names its field, and is not retried either.
    let error = client
        .send_transfer(&TransferIntent::new(request(0)))
        .await
        .unwrap_err();
    let problem = error.problem().unwrap();
    assert_eq!(problem.problem.problem_type(), ProblemType::InvalidAmount);
    assert_eq!(problem.problem.param.as_deref(), Some("amount_minor"));
    assert_eq!(attempts.lock().unwrap().len(), 5);

    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(app.balance(B_USD).await, 300);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - 300);
    assert_eq!(
        key_rows(&app.pool, overdraft.key().as_str()).await,
        [("COMPLETED".to_owned(), Some(422))]
    );
    assert_ledger_consistent(&app.pool).await;
}

/// A key held by an earlier attempt (a claim whose process died) answers
/// 409 `request-in-flight` with `Retry-After: 1`; the library waits at
/// least that long between attempts, and once the lease is over its retry
/// takes the key over and executes the intent, once.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_409_in_flight_is_retried_after_retry_after(pool: PgPool) {
    let policy = Policy {
        ttl: Duration::from_secs(3600),
        lease: Duration::from_secs(1),
        retention: Duration::from_secs(7200),
    };
    let app = TestApp::spawn_with(pool, policy, default_http()).await;
    let (client, _) = client(&app.base, TOKEN_A);
    let intent = TransferIntent::new(request(2_500));

    let body: TransferBody = serde_json::from_slice(intent.body()).unwrap();
    let fingerprint = ServerIntent::parse(&body).unwrap().fingerprint();
    let key = idempotency::IdempotencyKey::parse(intent.key().as_str().as_bytes()).unwrap();
    let claimed = store::claim(
        &KeyPool::beside(&app.pool),
        policy,
        principal_a(&app.pool).await,
        &key,
        "POST",
        ROUTE,
        &fingerprint,
    )
    .await
    .unwrap();
    assert!(matches!(claimed, ClaimOutcome::Claimed(_)));

    let outcome = client.send_transfer(&intent).await.unwrap();

    let log: Vec<String> = outcome.attempts.iter().map(ToString::to_string).collect();
    assert_eq!(
        outcome.attempts[0].result,
        AttemptResult::Answer {
            status: 409,
            replayed: false,
            problem: Some(ProblemType::RequestInFlight)
        },
        "{log:#?}"
    );
    for pair in outcome.attempts.windows(2) {
        assert!(
            pair[1].started - pair[0].started >= Duration::from_secs(1),
            "a retry after a 409 waited less than Retry-After: {log:#?}"
        );
    }
    assert_eq!(outcome.status, 201, "{log:#?}");
    assert!(!outcome.replayed, "the retry executed the intent: {log:#?}");
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(transfers_under(&app.pool, intent.key().as_str()).await, 1);
    assert_eq!(app.balance(B_USD).await, 2_500);
    assert_ledger_consistent(&app.pool).await;
}

/// A cancelled intent never executes: the library does not retry its 409
/// (it never changes), nor the 409 that refuses to cancel a completed one.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn cancelled_and_completed_intents_are_final(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (client, attempts) = client(&app.base, TOKEN_A);

    let cancelled = TransferIntent::new(request(700));
    let state = client.cancel_intent(cancelled.key()).await.unwrap();
    assert_eq!(state.state, KeyStatus::Cancelled);
    assert!(state.cancelled_at.is_some() && state.retained_until.is_some());
    assert_eq!(client.cancel_intent(cancelled.key()).await.unwrap(), state);
    let before = attempts.lock().unwrap().len();
    let error = client.send_transfer(&cancelled).await.unwrap_err();
    assert_eq!(error.problem_type(), Some(ProblemType::IntentCancelled));
    assert_eq!(attempts.lock().unwrap().len(), before + 1, "not retried");

    let completed = TransferIntent::new(request(800));
    let sent = client.send_transfer(&completed).await.unwrap();
    let before = attempts.lock().unwrap().len();
    let error = client.cancel_intent(completed.key()).await.unwrap_err();
    assert_eq!(error.problem_type(), Some(ProblemType::IntentCompleted));
    assert_eq!(attempts.lock().unwrap().len(), before + 1, "not retried");

    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(
        transfers_under(&app.pool, cancelled.key().as_str()).await,
        0
    );
    assert_eq!(app.balance(B_USD).await, sent.transfer.amount_minor);
    assert_ledger_consistent(&app.pool).await;
}

/// Every route a caller uses, read back in its typed form and checked
/// against the database.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn every_route_answers_in_its_typed_form(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (client, _) = client(&app.base, TOKEN_A);

    assert_eq!(client.healthz().await.unwrap().status, "ok");
    assert!(matches!(client.readyz().await.unwrap(), Readiness::Ready));

    // A key that needs encoding in a path and in a query.
    let odd_key = IdempotencyKey::parse("a/b?c#d%e&f=g").unwrap();
    let mut sent = Vec::new();
    for (i, amount) in [100, 200, 300].into_iter().enumerate() {
        let intent = if i == 1 {
            TransferIntent::resume(odd_key.clone(), request(amount))
        } else {
            TransferIntent::new(request(amount).description(format!("payment {i}")))
        };
        sent.push(client.send_transfer(&intent).await.unwrap());
    }
    assert_eq!(customer_transfer_count(&app.pool).await, 3);

    // Keyset pages, newest first, of the transfers above (the demo's
    // opening deposits are the caller's transfers too, and older).
    let since = sent[0].transfer.created_at - chrono::Duration::microseconds(1);
    let ours = TransferQuery::default().created_after(since);
    let first = client.list_transfers(&ours.clone().limit(2)).await.unwrap();
    let amounts: Vec<i64> = first.transfers.iter().map(|t| t.amount_minor).collect();
    assert_eq!(amounts, [300, 200]);
    let cursor = first.next_cursor.clone().expect("a second page");
    let second = client
        .list_transfers(&ours.clone().limit(2).cursor(cursor))
        .await
        .unwrap();
    assert_eq!(second.transfers, [sent[0].transfer.clone()]);
    assert_eq!(second.next_cursor, None);

    // Filters.
    let by_key = client
        .list_transfers(&TransferQuery::default().idempotency_key(odd_key.as_str()))
        .await
        .unwrap();
    assert_eq!(by_key.transfers, [sent[1].transfer.clone()]);
    let newest = &sent[2].transfer;
    let before_newest = client
        .list_transfers(&ours.clone().created_before(newest.created_at))
        .await
        .unwrap();
    assert_eq!(before_newest.transfers.len(), 2);
    let after_newest = client
        .list_transfers(&TransferQuery::default().created_after(newest.created_at))
        .await
        .unwrap();
    assert!(after_newest.transfers.is_empty());
    let of_a = client
        .list_transfers(&TransferQuery::default().account(A_USD))
        .await
        .unwrap();
    for ours in &sent {
        assert!(of_a.transfers.contains(&ours.transfer));
    }
    assert!(
        of_a.transfers
            .iter()
            .all(|t| t.from == A_USD || t.to == A_USD)
    );
    let not_mine = client
        .list_transfers(&TransferQuery::default().account(B_USD))
        .await
        .unwrap_err();
    assert_eq!(not_mine.problem_type(), Some(ProblemType::NotFound));
    let bad_limit = client
        .list_transfers(&TransferQuery::default().limit(201))
        .await
        .unwrap_err();
    let problem = bad_limit.problem().unwrap();
    assert_eq!(problem.problem.problem_type(), ProblemType::InvalidQuery);
    assert_eq!(problem.problem.param.as_deref(), Some("limit"));

    // One transfer, seen by either side.
    assert_eq!(
        client.get_transfer(newest.transfer_id).await.unwrap(),
        *newest
    );
    let as_b = client.with_token(TOKEN_B);
    assert_eq!(
        as_b.get_transfer(newest.transfer_id).await.unwrap(),
        *newest
    );
    let missing = client.get_transfer(uuid::Uuid::new_v4()).await.unwrap_err();
    let problem = missing.problem().unwrap();
    assert_eq!(problem.status, 404);
    assert_eq!(problem.problem.problem_type(), ProblemType::NotFound);
    assert!(problem.problem.request_id.is_some());

    // Keys, in a path.
    let state = client.get_idempotency_key(&odd_key).await.unwrap();
    assert_eq!(state.idempotency_key, odd_key.as_str());
    assert_eq!(state.state, KeyStatus::Completed);
    assert_eq!(state.transfer_id, Some(sent[1].transfer.transfer_id));
    let never_used = client
        .get_idempotency_key(&IdempotencyKey::generate())
        .await
        .unwrap_err();
    assert_eq!(never_used.problem_type(), Some(ProblemType::NotFound));

    // Accounts and their entries, against the database.
    let account = client.get_account(A_USD).await.unwrap();
    assert_eq!(account.account_id, A_USD);
    assert_eq!(account.currency, "USD");
    assert_eq!(account.balance_minor, app.balance(A_USD).await);
    assert_eq!(account.balance_minor, OPENING_BALANCE - 600);
    assert_eq!(
        as_b.get_account(B_USD).await.unwrap().balance_minor,
        app.balance(B_USD).await
    );
    let mut entries = Vec::new();
    let mut page = PageQuery::default().limit(2);
    loop {
        let got = client.list_entries(A_USD, &page).await.unwrap();
        entries.extend(got.entries);
        match got.next_cursor {
            Some(cursor) => page = page.cursor(cursor),
            None => break,
        }
    }
    assert_eq!(entries.len() as i64, entry_count(&app.pool, A_USD).await);
    assert_eq!(entries[0].balance_after_minor, account.balance_minor);
    assert_eq!(entries[0].amount_minor, -300);
    assert!(entries.windows(2).all(|w| w[0].entry_id > w[1].entry_id));

    // Another principal's account, and no principal at all.
    let other = client.get_account(B_USD).await.unwrap_err();
    assert_eq!(other.problem_type(), Some(ProblemType::NotFound));
    let stranger = client.with_token("tok_nobody");
    let error = stranger.get_account(A_USD).await.unwrap_err();
    assert_eq!(error.status(), Some(401));
    assert_eq!(error.problem_type(), Some(ProblemType::Unauthorized));
    assert_ledger_consistent(&app.pool).await;
}

/// A single attempt gives the caller the answer itself, whatever it is: a
/// 409 is neither retried nor wrapped.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_single_attempt_is_one_request(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (client, attempts) = client(&app.base, TOKEN_A);
    let intent = TransferIntent::new(request(900));
    claim_for_a(
        &app.pool,
        intent.key().as_str(),
        &serde_json::from_slice(intent.body()).unwrap(),
    )
    .await;

    let error = client.send_transfer_once(&intent).await.unwrap_err();

    let problem = error.problem().unwrap();
    assert_eq!(problem.problem.problem_type(), ProblemType::RequestInFlight);
    assert!(
        problem
            .retry_after
            .is_some_and(|wait| wait >= Duration::from_secs(1))
    );
    assert!(matches!(error, Error::Problem(_)));
    assert_eq!(attempts.lock().unwrap().len(), 1);
    let with_policy = client.with_retry_policy(RetryPolicy::single_attempt());
    assert!(with_policy.send_transfer(&intent).await.is_err());
    assert_eq!(attempts.lock().unwrap().len(), 2);
    assert_eq!(customer_transfer_count(&app.pool).await, 0);
}

/// A hold through the library: made, posted in part with the first answer
/// lost (the retry replays the one capture), reversed in part by the
/// destination's owner; each step under its own key, and the ledger and
/// the accounts' available balances agree with every answer.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_hold_is_captured_in_part_and_reversed_through_the_library(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let proxy = TcpProxy::start(app.addr).await;
    let (payer, _) = client(&app.base, TOKEN_A);
    let (payee, _) = client(&app.base, TOKEN_B);

    let hold = TransferIntent::new(request(10_000).pending(Some(3_600)));
    let held = payer.send_transfer(&hold).await.unwrap();
    assert_eq!(held.status, 201);
    assert_eq!(held.transfer.status, TransferStatus::Pending);
    assert_eq!(held.transfer.receipt, None);
    let reserved = held.transfer.hold.clone().expect("a hold");
    assert_eq!(
        (reserved.amount_minor, reserved.resolved_at),
        (10_000, None)
    );
    let source = payer.get_account(A_USD).await.unwrap();
    assert_eq!(
        (
            source.balance_minor,
            source.held_minor,
            source.available_minor
        ),
        (OPENING_BALANCE, 10_000, OPENING_BALANCE - 10_000)
    );
    assert_eq!(customer_transfer_count(&app.pool).await, 0);

    // Its own client: the proxy misbehaves per connection, and the payer's
    // connection is already open.
    proxy.misbehave(Behaviour::DropResponse, 1);
    let (capturer, _) = client(&proxy.base(), TOKEN_A);
    let id = held.transfer.transfer_id;
    let capture = TransferIntent::post_hold(id, Some(8_000));
    let posted = capturer.send_transfer(&capture).await.unwrap();
    assert_eq!(
        proxy.dropped_responses().len(),
        1,
        "the first answer was lost"
    );
    assert_eq!(posted.attempts.len(), 2);
    assert!(posted.replayed);
    assert_eq!(posted.status, 200);
    assert_eq!(posted.transfer.transfer_id, id);
    assert_eq!(posted.transfer.status, TransferStatus::Posted);
    assert_eq!(posted.transfer.amount_minor, 8_000);
    assert!(posted.transfer.receipt.is_some());
    assert_eq!(transfers_under(&app.pool, capture.key().as_str()).await, 1);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - 8_000);
    assert_eq!(app.balance(B_USD).await, 8_000);
    let source = payer.get_account(A_USD).await.unwrap();
    assert_eq!(source.held_minor, 0, "the rest of the hold is released");

    let too_late = payer
        .send_transfer(&TransferIntent::void_hold(id))
        .await
        .unwrap_err();
    assert_eq!(
        too_late.problem_type(),
        Some(ProblemType::TransferNotPending)
    );

    let reversal = TransferIntent::reverse(id, Some(3_000));
    let reversed = payee.send_transfer(&reversal).await.unwrap();
    assert_eq!(reversed.status, 201);
    assert_eq!(reversed.transfer.reverses, Some(id));
    assert_eq!(
        (
            reversed.transfer.from.as_str(),
            reversed.transfer.to.as_str()
        ),
        (B_USD, A_USD)
    );
    let again = payee.send_transfer(&reversal).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.body, reversed.body);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - 5_000);
    assert_eq!(app.balance(B_USD).await, 5_000);
    let original = payer.get_transfer(id).await.unwrap();
    assert_eq!(original.reversed_minor, Some(3_000));
    assert_eq!(customer_transfer_count(&app.pool).await, 2);
    assert_reconciles(&app.pool).await;
}
