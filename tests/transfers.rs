#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The seed's five test cases and the rest of the outcome table, each
//! asserting on the ledger and the idempotency records, not only on statuses.

mod common;

use std::time::Duration;

use common::*;
use futures::future::join_all;
use nexo_transfers::config::PostingConfig;
use nexo_transfers::db::KeyPool;
use nexo_transfers::idempotency::{self, ClaimOutcome, IdempotencyKey};
use nexo_transfers::principal::PrincipalId;
use nexo_transfers::transfers::Transfers;
use nexo_transfers::transfers::intent::{TransferBody, TransferIntent};
use nexo_transfers::transfers::posting::{ClaimedTransfer, Settings};
use serde_json::json;
use sqlx::PgPool;
use tokio::io::AsyncWriteExt;

const AMOUNT: i64 = 10_000;

async fn principal_id(pool: &PgPool, name: &str) -> PrincipalId {
    sqlx::query_scalar("SELECT id FROM principals WHERE name = $1")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

// Case 1 of the seed: the same key and body twice.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn exact_duplicate_moves_money_once(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");

    let first = app.post_transfer(TOKEN_A, &key, &body).await;
    let second = app.post_transfer(TOKEN_A, &key, &body).await;

    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    let id = first.json()["transfer_id"].as_str().unwrap().to_owned();
    assert_eq!(
        first.header("location"),
        Some(format!("/transfers/{id}").as_str())
    );
    assert_eq!(second.status, 201);
    assert!(second.replayed());
    assert_eq!(
        first.body, second.body,
        "the replay is byte-for-byte the first answer"
    );
    assert_eq!(first.header("location"), second.header("location"));
    assert_eq!(first.header("content-type"), second.header("content-type"));

    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(
        scalar(
            &app.pool,
            "SELECT count(*) FROM ledger_entries e JOIN transfers t ON t.id = e.transfer_id
             WHERE t.principal_id IS NOT NULL"
        )
        .await,
        2,
        "one debit and one credit, not four"
    );
    assert_eq!(
        key_rows(&app.pool, &key).await,
        vec![("COMPLETED".to_owned(), Some(201))]
    );
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - AMOUNT);
    assert_eq!(app.balance(B_USD).await, AMOUNT);
    assert_ledger_consistent(&app.pool).await;
}

// Case 2 of the seed: the server completed but the client never saw the
// answer (it hung up), then retried.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn retry_after_a_lost_response_gets_the_original_receipt(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let body = transfer(A_USD, B_USD, AMOUNT, "USD").to_string();

    // Send the request and never read the response: once the server has
    // completed the transfer, the client gives up on the connection.
    let mut socket = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    let request = format!(
        "POST /transfers HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {TOKEN_A}\r\n\
         Idempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        app.addr,
        body.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut completed = false;
    for _ in 0..200 {
        if key_rows(&app.pool, &key).await == vec![("COMPLETED".to_owned(), Some(201))] {
            completed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(completed, "the server completed the first request");
    drop(socket);
    let posted: String =
        sqlx::query_scalar("SELECT receipt_id FROM transfers WHERE idempotency_key = $1")
            .bind(&key)
            .fetch_one(&app.pool)
            .await
            .unwrap();

    let retry = app.post_transfer_raw(TOKEN_A, &key, body).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.json()["receipt"]["receipt_id"], posted.as_str());
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(
        entry_count(&app.pool, A_USD).await,
        2,
        "opening deposit + one debit"
    );
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - AMOUNT);
    assert_ledger_consistent(&app.pool).await;
}

// Case 3 of the seed: N requests with one key at the same time, over real
// sockets, several rounds.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn concurrent_requests_with_one_key_execute_once(pool: PgPool) {
    const ROUNDS: usize = 5;
    const PARALLEL: usize = 16;
    let app = TestApp::spawn(pool).await;
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");

    for round in 0..ROUNDS {
        let key = new_key();
        let replies =
            join_all((0..PARALLEL).map(|_| app.post_transfer(TOKEN_A, &key, &body))).await;
        let successes: Vec<_> = replies.iter().filter(|r| r.status == 201).collect();
        assert!(
            !successes.is_empty(),
            "round {round}: someone got the answer"
        );
        for reply in &replies {
            match reply.status {
                201 => assert_eq!(
                    reply.body, successes[0].body,
                    "round {round}: identical answers"
                ),
                409 => {
                    reply.assert_problem(409, "request-in-flight");
                    assert!(reply.header("retry-after").is_some());
                }
                other => panic!("round {round}: unexpected status {other}"),
            }
        }
        let executions: i64 =
            sqlx::query_scalar("SELECT count(*) FROM transfers WHERE idempotency_key = $1")
                .bind(&key)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        assert_eq!(executions, 1, "round {round}: exactly one execution");
    }
    assert_eq!(customer_transfer_count(&app.pool).await, ROUNDS as i64);
    assert_eq!(app.balance(B_USD).await, ROUNDS as i64 * AMOUNT);
    assert_ledger_consistent(&app.pool).await;
}

// Case 4 of the seed: the same key with another amount.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn reusing_a_key_for_another_amount_is_rejected_and_executes_nothing(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let first = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, AMOUNT, "USD"))
        .await;
    assert_eq!(first.status, 201);

    let reused = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, 99_999, "USD"))
        .await;
    reused.assert_problem(422, "idempotency-key-reused");
    assert!(!reused.replayed());
    assert!(
        reused.json().get("transfer_id").is_none(),
        "the first answer is not re-sent"
    );

    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(app.balance(B_USD).await, AMOUNT);
    // The record still holds the first request's answer.
    let again = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, AMOUNT, "USD"))
        .await;
    assert_eq!(again.body, first.body);
    assert_ledger_consistent(&app.pool).await;
}

// Case 5 of the seed, and every validation row of the outcome table: the
// request is refused, nothing moves, and the key stays free for a corrected
// request.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn rejected_requests_leave_the_key_free_for_a_corrected_retry(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let cases: Vec<(String, u16, &str)> = vec![
        (
            transfer(A_USD, B_USD, 0, "USD").to_string(),
            422,
            "invalid-amount",
        ),
        (
            transfer(A_USD, B_USD, -500, "USD").to_string(),
            422,
            "invalid-amount",
        ),
        (
            transfer(A_USD, B_USD, 100_000_000_000_001, "USD").to_string(),
            422,
            "invalid-amount",
        ),
        (
            transfer(A_USD, B_USD, AMOUNT, "XXX").to_string(),
            422,
            "unsupported-currency",
        ),
        (
            transfer(A_USD, B_USD, AMOUNT, "EUR").to_string(),
            422,
            "currency-mismatch",
        ),
        (
            transfer(A_USD, B_EUR, AMOUNT, "USD").to_string(),
            422,
            "currency-mismatch",
        ),
        (
            transfer(A_USD, A_USD, AMOUNT, "USD").to_string(),
            422,
            "same-account",
        ),
        (
            transfer(A_USD, "acc_99999", AMOUNT, "USD").to_string(),
            422,
            "unknown-destination",
        ),
        (
            transfer(A_USD, "sys_funding_usd", AMOUNT, "USD").to_string(),
            422,
            "invalid-account-id",
        ),
        // Another principal's source account: indistinguishable from none (BOLA).
        (
            transfer(B_USD, A_USD, AMOUNT, "USD").to_string(),
            404,
            "not-found",
        ),
        (
            transfer("acc_77777", B_USD, AMOUNT, "USD").to_string(),
            404,
            "not-found",
        ),
        (
            r#"{"from":"acc_00001","to":"acc_00002","amount_minor":100.5,"currency":"USD"}"#
                .to_owned(),
            400,
            "malformed-request",
        ),
        (
            r#"{"from":"acc_00001","to":"acc_00002","amount_minor":"100","currency":"USD"}"#
                .to_owned(),
            400,
            "malformed-request",
        ),
        (
            r#"{"from":"acc_00001","to":"acc_00002","amount_minor":100,"currency":"USD","fee":1}"#
                .to_owned(),
            400,
            "malformed-request",
        ),
        (
            r#"{"from":"acc_00001","#.to_owned(),
            400,
            "malformed-request",
        ),
        (
            json!({"from": A_USD, "to": B_USD, "amount_minor": AMOUNT, "currency": "USD",
                   "description": "x".repeat(141)})
            .to_string(),
            422,
            "invalid-description",
        ),
    ];
    for (body, status, slug) in &cases {
        let reply = app.post_transfer_raw(TOKEN_A, &key, body.clone()).await;
        reply.assert_problem(*status, slug);
        assert!(
            key_rows(&app.pool, &key).await.is_empty(),
            "{body}: the key was not stored"
        );
    }
    assert_eq!(customer_transfer_count(&app.pool).await, 0);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE);
    assert_eq!(app.balance(B_USD).await, 0);

    let corrected = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, AMOUNT, "USD"))
        .await;
    assert_eq!(
        corrected.status, 201,
        "the same key works for the corrected request"
    );
    assert_eq!(app.balance(B_USD).await, AMOUNT);
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn insufficient_funds_is_stored_and_replayed_as_the_same_rejection(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let body = transfer(B_USD, A_USD, AMOUNT, "USD");

    let first = app.post_transfer(TOKEN_B, &key, &body).await;
    first.assert_problem(422, "insufficient-funds");
    assert_eq!(
        key_rows(&app.pool, &key).await,
        vec![("COMPLETED".to_owned(), Some(422))]
    );

    // Even once the money is there, the decided intent keeps its answer.
    nexo_transfers::admin::deposit(&app.pool, B_USD, 5 * AMOUNT, "top-up")
        .await
        .unwrap();
    let retry = app.post_transfer(TOKEN_B, &key, &body).await;
    assert_eq!(retry.status, 422);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(customer_transfer_count(&app.pool).await, 0);
    assert_eq!(app.balance(B_USD).await, 5 * AMOUNT);
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn an_abandoned_claim_is_taken_over_after_its_lease_and_the_late_original_cannot_complete(
    pool: PgPool,
) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");
    let intent =
        TransferIntent::parse(&serde_json::from_value::<TransferBody>(body.clone()).unwrap())
            .unwrap();
    let scope = principal_id(&app.pool, "demo-a").await;
    let idem_key = IdempotencyKey::parse(key.as_bytes()).unwrap();

    // An "original" claims the key and then stalls, as if its process died.
    let ClaimOutcome::Claimed(original) = idempotency::store::claim(
        &KeyPool::beside(&app.pool),
        default_policy(),
        scope,
        &idem_key,
        "POST",
        "/transfers",
        &intent.fingerprint(),
    )
    .await
    .unwrap() else {
        panic!("the first claim must win");
    };

    let during_lease = app.post_transfer(TOKEN_A, &key, &body).await;
    during_lease.assert_problem(409, "request-in-flight");
    assert_eq!(during_lease.header("retry-after"), Some("1"));
    assert_eq!(customer_transfer_count(&app.pool).await, 0);

    sqlx::query("UPDATE idempotency_keys SET locked_until = now() - interval '1 second' WHERE idempotency_key = $1")
        .bind(&key)
        .execute(&app.pool)
        .await
        .unwrap();
    let after_lease = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(after_lease.status, 201, "the retry took the claim over");

    // The original wakes up and posts through the same posting layer: its
    // fence is gone, so nothing of it commits, and since the key completed
    // for this same intent it is answered with that completed answer.
    let service = Transfers::new(
        app.pool.clone(),
        default_policy(),
        Settings::for_pool(4, &PostingConfig::default()),
        false,
    )
    .await
    .unwrap();
    let admission = service.postings.admit(&intent).unwrap();
    let late = service
        .execute_claimed(
            ClaimedTransfer {
                claim: original,
                fingerprint: intent.fingerprint(),
                intent: intent.clone(),
                request_id: None,
            },
            admission,
        )
        .await
        .unwrap();
    assert!(late.replayed);
    assert_eq!(late.response.status.as_u16(), 201);
    assert_eq!(late.response.body, after_lease.body);

    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(app.balance(B_USD).await, AMOUNT);
    let replay = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(replay.body, after_lease.body);
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_technical_failure_marks_the_key_failed_and_a_retry_executes_once(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    // A real database failure inside the posting transaction.
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_transfer() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN RAISE EXCEPTION 'injected failure'; END $$;
         CREATE TRIGGER refuse_transfer BEFORE INSERT ON transfers
             FOR EACH ROW EXECUTE FUNCTION refuse_transfer();",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let key = new_key();
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");

    let failed = app.post_transfer(TOKEN_A, &key, &body).await;
    failed.assert_problem(500, "internal-error");
    assert!(
        !String::from_utf8_lossy(&failed.body).contains("injected"),
        "no internal error text reaches the client"
    );
    assert_eq!(
        key_rows(&app.pool, &key).await,
        vec![("FAILED".to_owned(), None)]
    );
    assert_eq!(customer_transfer_count(&app.pool).await, 0);
    assert_eq!(
        app.balance(A_USD).await,
        OPENING_BALANCE,
        "the rollback moved nothing"
    );

    sqlx::raw_sql("DROP TRIGGER refuse_transfer ON transfers")
        .execute(&app.pool)
        .await
        .unwrap();
    let retry = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(retry.status, 201);
    assert!(
        !retry.replayed(),
        "a failed attempt is executed again, not replayed"
    );
    let again = app.post_transfer(TOKEN_A, &key, &body).await;
    assert!(again.replayed());
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(app.balance(B_USD).await, AMOUNT);
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn opposite_transfers_in_parallel_do_not_deadlock(pool: PgPool) {
    const PAIRS: usize = 25;
    let app = TestApp::spawn(pool).await;
    nexo_transfers::admin::deposit(&app.pool, B_USD, 1_000_000, "fund-b")
        .await
        .unwrap();
    let a_to_b = transfer(A_USD, B_USD, 100, "USD");
    let b_to_a = transfer(B_USD, A_USD, 100, "USD");
    let keys: Vec<(String, String)> = (0..PAIRS).map(|_| (new_key(), new_key())).collect();

    let replies = join_all(keys.iter().flat_map(|(ka, kb)| {
        [
            app.post_transfer(TOKEN_A, ka, &a_to_b),
            app.post_transfer(TOKEN_B, kb, &b_to_a),
        ]
    }))
    .await;

    assert_all_created(&replies);
    assert_eq!(customer_transfer_count(&app.pool).await, 2 * PAIRS as i64);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE);
    assert_eq!(app.balance(B_USD).await, 1_000_000);
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn quoted_and_bare_spellings_of_a_key_are_one_key(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");
    let quoted = app
        .post_transfer(TOKEN_A, &format!("\"{key}\""), &body)
        .await;
    let bare = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(quoted.status, 201);
    assert!(bare.replayed());
    assert_eq!(quoted.body, bare.body);
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn keys_are_scoped_to_their_principal(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    nexo_transfers::admin::deposit(&app.pool, B_USD, 1_000_000, "fund-b")
        .await
        .unwrap();
    let key = new_key();
    let from_a = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, AMOUNT, "USD"))
        .await;
    let from_b = app
        .post_transfer(TOKEN_B, &key, &transfer(B_USD, A_USD, 300, "USD"))
        .await;
    assert_eq!(from_a.status, 201);
    assert_eq!(from_b.status, 201, "B's request is its own execution");
    assert!(!from_b.replayed());
    assert_ne!(from_a.json()["transfer_id"], from_b.json()["transfer_id"]);
    assert_eq!(key_rows(&app.pool, &key).await.len(), 2);
    assert_eq!(app.balance(B_USD).await, 1_000_000 + AMOUNT - 300);
    assert_ledger_consistent(&app.pool).await;
}

/// `usd` is `USD`: accepted, answered in the canonical spelling, and the
/// same intent, so a retry that changed only the case is a replay, not a
/// reused key.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_currency_in_any_case_is_the_same_intent(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let lower = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, AMOUNT, "usd"))
        .await;
    assert_eq!(lower.status, 201, "{:?}", lower.body);
    assert_eq!(lower.json()["currency"], "USD");
    let upper = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, AMOUNT, "USD"))
        .await;
    assert_eq!((upper.status, &upper.body), (201, &lower.body));
    assert!(upper.replayed());
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(app.balance(B_USD).await, AMOUNT);
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_retry_after_the_record_expired_or_was_purged_does_not_move_money_again(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");
    let first = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(first.status, 201);

    // Expired but not yet purged.
    sqlx::query(
        "UPDATE idempotency_keys SET created_at = now() - interval '2 days',
                expires_at = now() - interval '1 day' WHERE idempotency_key = $1",
    )
    .bind(&key)
    .execute(&app.pool)
    .await
    .unwrap();
    let after_expiry = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(after_expiry.status, 201);
    assert!(after_expiry.replayed());
    assert_eq!(
        after_expiry.body, first.body,
        "the transfer renders to the same bytes"
    );

    // Compacted by the purge: the bytes are rebuilt from the transfer.
    let purged = idempotency::store::purge_expired(&app.pool, 10)
        .await
        .unwrap();
    assert_eq!((purged.compacted, purged.deleted), (1, 0));
    assert_eq!(
        scalar(
            &app.pool,
            "SELECT count(*) FROM idempotency_keys WHERE response_body IS NULL AND compacted_at IS NOT NULL"
        )
        .await,
        1
    );
    let after_compaction = app
        .another_instance()
        .await
        .post_transfer(TOKEN_A, &key, &body)
        .await;
    assert_eq!(after_compaction.status, 201);
    assert!(after_compaction.replayed());
    assert_eq!(after_compaction.body, first.body);
    assert_eq!(
        after_compaction.header("location"),
        first.header("location")
    );

    // Past its retention and deleted.
    sqlx::query("UPDATE idempotency_keys SET retain_until = now() - interval '1 second', expires_at = now() - interval '1 day'")
        .execute(&app.pool)
        .await
        .unwrap();
    let purged = idempotency::store::purge_expired(&app.pool, 10)
        .await
        .unwrap();
    assert_eq!((purged.compacted, purged.deleted), (0, 1));
    assert!(key_rows(&app.pool, &key).await.is_empty());
    let after_purge = app
        .another_instance()
        .await
        .post_transfer(TOKEN_A, &key, &body)
        .await;
    assert_eq!(after_purge.status, 201);
    assert_eq!(after_purge.body, first.body);

    // A late retry that changed the request is still a reused key.
    sqlx::query("DELETE FROM idempotency_keys")
        .execute(&app.pool)
        .await
        .unwrap();
    let changed = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, 1, "USD"))
        .await;
    changed.assert_problem(422, "idempotency-key-reused");

    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(app.balance(B_USD).await, AMOUNT);
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_purge_deletes_only_expired_records_in_batches(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let keys: Vec<String> = (0..5).map(|_| new_key()).collect();
    for key in &keys {
        let r = app
            .post_transfer(TOKEN_A, key, &transfer(A_USD, B_USD, 1, "USD"))
            .await;
        assert_eq!(r.status, 201);
    }
    sqlx::query(
        "UPDATE idempotency_keys SET created_at = now() - interval '2 days',
                expires_at = now() - interval '1 day' WHERE idempotency_key = ANY($1)",
    )
    .bind(&keys[..3])
    .execute(&app.pool)
    .await
    .unwrap();
    let compacted = idempotency::store::purge_expired(&app.pool, 2)
        .await
        .unwrap();
    assert_eq!((compacted.compacted, compacted.deleted), (3, 0));
    assert_eq!(
        scalar(
            &app.pool,
            "SELECT count(*) FROM idempotency_keys WHERE response_body IS NOT NULL"
        )
        .await,
        2,
        "records within their TTL keep their bytes"
    );
    sqlx::query(
        "UPDATE idempotency_keys SET retain_until = now() - interval '1 second'
         WHERE idempotency_key = ANY($1)",
    )
    .bind(&keys[..2])
    .execute(&app.pool)
    .await
    .unwrap();
    let deleted = idempotency::store::purge_expired(&app.pool, 1)
        .await
        .unwrap();
    assert_eq!((deleted.compacted, deleted.deleted), (0, 2));
    assert_eq!(
        scalar(&app.pool, "SELECT count(*) FROM idempotency_keys").await,
        3
    );
    assert_eq!(
        customer_transfer_count(&app.pool).await,
        5,
        "transfers are never purged"
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn missing_key_and_bad_tokens_are_refused_before_anything_happens(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let body = transfer(A_USD, B_USD, AMOUNT, "USD").to_string();

    let no_key = Reply::read(
        app.client
            .post(app.url("/transfers"))
            .bearer_auth(TOKEN_A)
            .header("Content-Type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap(),
    )
    .await;
    no_key.assert_problem(400, "missing-idempotency-key");

    for token in [
        None,
        Some("tok_test_a"),
        Some("tok_test_"),
        Some("tok_test_AA"),
        Some(""),
    ] {
        let mut request = app
            .client
            .post(app.url("/transfers"))
            .header("Idempotency-Key", new_key())
            .header("Content-Type", "application/json")
            .body(body.clone());
        if let Some(token) = token {
            request = request.header("Authorization", format!("Bearer {token}"));
        }
        let reply = Reply::read(request.send().await.unwrap()).await;
        reply.assert_problem(401, "unauthorized");
        assert!(
            reply
                .header("www-authenticate")
                .is_some_and(|v| v.starts_with("Bearer"))
        );
    }
    let bad_key = app.post_transfer_raw(TOKEN_A, &"k".repeat(256), body).await;
    bad_key.assert_problem(400, "invalid-idempotency-key");

    assert_eq!(
        scalar(&app.pool, "SELECT count(*) FROM idempotency_keys").await,
        0
    );
    assert_eq!(customer_transfer_count(&app.pool).await, 0);
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn reads_are_limited_to_the_owner(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let posted = app
        .post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, AMOUNT, "USD"))
        .await;
    let id = posted.json()["transfer_id"].as_str().unwrap().to_owned();
    let stranger = nexo_transfers::admin::create_principal(&app.pool, "stranger")
        .await
        .unwrap();

    let by_a = app.get(TOKEN_A, &format!("/transfers/{id}")).await;
    let by_b = app.get(TOKEN_B, &format!("/transfers/{id}")).await;
    assert_eq!(by_a.status, 200);
    assert_eq!(by_b.status, 200, "the destination's owner sees it too");
    assert_eq!(
        by_a.body, posted.body,
        "a transfer renders the same everywhere"
    );
    app.get(&stranger.token, &format!("/transfers/{id}"))
        .await
        .assert_problem(404, "not-found");
    app.get(TOKEN_A, "/transfers/not-a-uuid")
        .await
        .assert_problem(404, "not-found");

    let account = app.get(TOKEN_B, "/accounts/acc_00002").await;
    assert_eq!(
        account.json(),
        json!({"account_id": "acc_00002", "currency": "USD", "balance_minor": AMOUNT,
               "held_minor": 0, "available_minor": AMOUNT})
    );
    for (token, path) in [
        (TOKEN_A, "/accounts/acc_00002"),
        (TOKEN_B, "/accounts/acc_00001"),
        (TOKEN_A, "/accounts/acc_00002/entries"),
        (TOKEN_A, "/accounts/sys_funding_usd"),
        (stranger.token.as_str(), "/accounts/acc_00001/entries"),
    ] {
        app.get(token, path).await.assert_problem(404, "not-found");
    }
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn entries_are_paged_newest_first_with_a_bounded_page_size(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    for amount in 1..=5 {
        let r = app
            .post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, amount, "USD"))
            .await;
        assert_eq!(r.status, 201);
    }
    let mut amounts = Vec::new();
    let mut path = "/accounts/acc_00002/entries?limit=2".to_owned();
    for _ in 0..10 {
        let page = app.get(TOKEN_B, &path).await.json();
        let entries = page["entries"].as_array().unwrap();
        assert!(entries.len() <= 2);
        for e in entries {
            assert_eq!(e["direction"], "credit");
            amounts.push(e["amount_minor"].as_i64().unwrap());
        }
        match page["next_cursor"].as_str() {
            Some(cursor) => path = format!("/accounts/acc_00002/entries?limit=2&cursor={cursor}"),
            None => break,
        }
    }
    assert_eq!(amounts, vec![5, 4, 3, 2, 1]);
    let newest = &app
        .get(TOKEN_B, "/accounts/acc_00002/entries?limit=1")
        .await
        .json()["entries"][0];
    assert_eq!(newest["balance_after_minor"], 15);

    for bad in ["limit=0", "limit=201", "limit=abc", "cursor=zzz", "page=2"] {
        app.get(TOKEN_B, &format!("/accounts/acc_00002/entries?{bad}"))
            .await
            .assert_problem(400, "invalid-query");
    }
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn health_and_unknown_routes(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    assert_eq!(app.get(TOKEN_A, "/healthz").await.status, 200);
    assert_eq!(app.get(TOKEN_A, "/readyz").await.status, 200);
    app.get(TOKEN_A, "/nope")
        .await
        .assert_problem(404, "not-found");
    let wrong_method = Reply::read(
        app.client
            .delete(app.url("/transfers"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    wrong_method.assert_problem(405, "method-not-allowed");
}
