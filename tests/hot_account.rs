#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Many transfers from one account at once: the service batches them, and
//! each must still post once, be refused alone when it would overdraw, and
//! replay its own answer.
mod common;

use common::*;
use nexo_transfers::db::KeyPool;
use nexo_transfers::ledger::repo::KeyLookup;
use nexo_transfers::ledger::{
    AmountMinor, Currency, LedgerError, LockMode, PostingKind, PostingOutcome, PostingRequest, repo,
};
use nexo_transfers::principal::PrincipalId;

/// Enough concurrent transfers that later ones queue behind a running batch.
const TRANSFERS: usize = 30;
/// Twenty of these drain the opening balance exactly.
const AMOUNT: i64 = OPENING_BALANCE / 20;

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn concurrent_transfers_from_one_account_post_once_each_and_overdrafts_fail_alone(
    pool: sqlx::PgPool,
) {
    let app = TestApp::spawn(pool).await;
    let body = transfer(A_USD, B_USD, AMOUNT, "USD");
    let keys: Vec<String> = (0..TRANSFERS).map(|_| new_key()).collect();

    let replies = futures::future::join_all(
        keys.iter()
            .map(|key| app.post_transfer(TOKEN_A, key, &body)),
    )
    .await;

    let created = replies.iter().filter(|r| r.status == 201).count();
    for refused in replies.iter().filter(|r| r.status != 201) {
        refused.assert_problem(422, "insufficient-funds");
    }
    assert_eq!(created, 20, "exactly the transfers the balance covers");
    assert_eq!(app.balance(A_USD).await, 0);
    assert_eq!(app.balance(B_USD).await, 20 * AMOUNT);
    assert_eq!(customer_transfer_count(&app.pool).await, 20);
    for (key, first) in keys.iter().zip(&replies) {
        let again = app.post_transfer(TOKEN_A, key, &body).await;
        assert_eq!((again.status, &again.body), (first.status, &first.body));
        assert!(again.replayed());
    }
    assert_eq!(customer_transfer_count(&app.pool).await, 20);
    assert_ledger_consistent(&app.pool).await;
}

/// A batch completes all its claims in one statement; a claim taken over
/// meanwhile must not count, so the batch knows to roll back.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn completing_a_batch_counts_only_the_claims_still_held(pool: sqlx::PgPool) {
    use nexo_transfers::idempotency::{
        ClaimOutcome, Completing, Fingerprint, IdempotencyKey, StoredResponse, store,
    };
    let app = TestApp::spawn(pool).await;
    let scope = principal_a(&app.pool).await;
    let keys = KeyPool::beside(&app.pool);
    let fingerprint = Fingerprint::compute("POST", "/transfers", b"{}");
    let mut claims = Vec::new();
    for key in [new_key(), new_key()] {
        let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
        let outcome = store::claim(
            &keys,
            default_policy(),
            scope,
            &key,
            "POST",
            "/transfers",
            &fingerprint,
        )
        .await
        .unwrap();
        let ClaimOutcome::Claimed(claim) = outcome else {
            panic!("a fresh key must be claimed");
        };
        claims.push(claim);
    }
    // Someone else takes the second claim over: it gets a new token.
    sqlx::query("UPDATE idempotency_keys SET lock_token = $1 WHERE idempotency_key = $2")
        .bind(uuid::Uuid::new_v4())
        .bind(claims[1].key.as_str())
        .execute(&app.pool)
        .await
        .unwrap();
    let response = StoredResponse {
        status: http::StatusCode::CREATED,
        headers: vec![(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        )],
        body: bytes::Bytes::from_static(b"{}"),
    };
    let completing = |claim| Completing {
        claim,
        fingerprint: &fingerprint,
        response: &response,
        problem_type: None,
        request_id: None,
        transfer_id: None,
    };

    let mut tx = app.pool.begin().await.unwrap();
    let completed = store::complete_all(&mut tx, &[completing(&claims[0]), completing(&claims[1])])
        .await
        .unwrap();
    assert_eq!(
        completed,
        [claims[0].lock_token],
        "only the claim still held completes"
    );
    tx.rollback().await.unwrap();

    for claim in &claims {
        let rows = key_rows(&app.pool, claim.key.as_str()).await;
        assert_eq!(rows, vec![("IN_PROGRESS".to_owned(), None)]);
    }
}

/// A batch's postings, written by one statement, behave as if posted one by
/// one: a transfer that the balance left by the earlier ones cannot cover is
/// refused alone, the later ones still post, and each entry records the
/// balance its account was left with.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_batch_posts_in_order_and_refuses_only_what_the_running_balance_cannot_cover(
    pool: sqlx::PgPool,
) {
    let app = TestApp::spawn(pool).await;
    let principal = principal_a(&app.pool).await;
    let keys: Vec<String> = (0..3).map(|_| new_key()).collect();
    let amounts = [
        OPENING_BALANCE * 6 / 10,
        OPENING_BALANCE * 6 / 10,
        OPENING_BALANCE * 3 / 10,
    ];
    let batch = Postings::new(principal, &keys, &amounts);

    let mut tx = app.pool.begin().await.unwrap();
    let mut accounts = repo::lock_accounts(&mut tx, &[A_USD, B_USD], LockMode::Wait)
        .await
        .unwrap();
    let outcomes = repo::post_locked(
        &mut tx,
        &batch.requests(),
        &mut accounts,
        KeyLookup::Optimistic,
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let [
        PostingOutcome::Posted(first),
        PostingOutcome::InsufficientFunds,
        PostingOutcome::Posted(third),
    ] = outcomes.as_slice()
    else {
        panic!("expected posted, refused, posted; got {outcomes:?}");
    };
    let left = OPENING_BALANCE - amounts[0] - amounts[2];
    assert_eq!(app.balance(A_USD).await, left);
    assert_eq!(app.balance(B_USD).await, amounts[0] + amounts[2]);
    let balance_after = |entry: i64| {
        sqlx::query_scalar::<_, i64>("SELECT balance_after_minor FROM ledger_entries WHERE id = $1")
            .bind(entry)
            .fetch_one(&app.pool)
    };
    assert_eq!(
        balance_after(first.debit_entry_id).await.unwrap(),
        OPENING_BALANCE - amounts[0]
    );
    assert_eq!(balance_after(third.debit_entry_id).await.unwrap(), left);
    assert_eq!(
        balance_after(third.credit_entry_id).await.unwrap(),
        amounts[0] + amounts[2]
    );
    assert!(first.debit_entry_id < first.credit_entry_id);
    assert!(
        first.credit_entry_id < third.debit_entry_id,
        "entries in batch order"
    );
    assert_eq!(customer_transfer_count(&app.pool).await, 2);
    assert_ledger_consistent(&app.pool).await;
}

/// A key that already has its transfer: alone it is found, not posted again;
/// inside a batch planned optimistically the batch fails, and a caller that
/// committed anyway would be refused by the database (the batch's other
/// transfer row has no entries); looked up first, the batch posts the new
/// transfer and finds the old one.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_key_that_already_has_a_transfer_is_found_alone_and_in_a_batch_looked_up_first(
    pool: sqlx::PgPool,
) {
    let app = TestApp::spawn(pool).await;
    let principal = principal_a(&app.pool).await;
    let keys: Vec<String> = (0..2).map(|_| new_key()).collect();
    let batch = Postings::new(principal, &keys, &[1_000, 2_000]);
    let requests = batch.requests();

    let mut tx = app.pool.begin().await.unwrap();
    let posted = repo::post_transfer(&mut tx, &requests[1]).await.unwrap();
    tx.commit().await.unwrap();
    let PostingOutcome::Posted(posted) = posted else {
        panic!("expected a posting, got {posted:?}");
    };

    let mut tx = app.pool.begin().await.unwrap();
    let again = repo::post_transfer(&mut tx, &requests[1]).await.unwrap();
    assert_eq!(again, PostingOutcome::AlreadyPosted(posted.clone()));
    let mut accounts = repo::lock_accounts(&mut tx, &[A_USD, B_USD], LockMode::Wait)
        .await
        .unwrap();
    let batch_result =
        repo::post_locked(&mut tx, &requests, &mut accounts, KeyLookup::Optimistic).await;
    assert!(
        matches!(batch_result, Err(LedgerError::KeyAlreadyUsed)),
        "got {batch_result:?}"
    );
    let committed = tx.commit().await;
    let refused = committed.expect_err("a transfer without entries must not commit");
    assert!(
        refused.to_string().contains("must commit with one debit"),
        "{refused}"
    );

    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - 2_000);
    assert_eq!(customer_transfer_count(&app.pool).await, 1);

    let mut tx = app.pool.begin().await.unwrap();
    let mut accounts = repo::lock_accounts(&mut tx, &[A_USD, B_USD], LockMode::Wait)
        .await
        .unwrap();
    let outcomes = repo::post_locked(&mut tx, &requests, &mut accounts, KeyLookup::First)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(
        matches!(&outcomes[..], [PostingOutcome::Posted(new), PostingOutcome::AlreadyPosted(old)]
            if new.amount_minor == 1_000 && old.id == posted.id),
        "{outcomes:?}"
    );
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - 3_000);
    assert_eq!(customer_transfer_count(&app.pool).await, 2);
    assert_ledger_consistent(&app.pool).await;
}

/// Hand-written SQL cannot commit a transfer whose entries are not one debit
/// and one credit of its amount either.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_database_refuses_to_commit_a_transfer_without_its_debit_and_credit(
    pool: sqlx::PgPool,
) {
    let app = TestApp::spawn(pool).await;
    let principal = principal_a(&app.pool).await;
    let mut tx = app.pool.begin().await.unwrap();
    let transfer_id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO transfers (id, principal_id, idempotency_key, request_fingerprint, from_account,
                                to_account, currency, amount_minor, receipt_id)
         VALUES ($1, $2, 'hand-written', sha256('x'), $3, $4, 'USD', 500, 'rcpt_hand_written')",
    )
    .bind(transfer_id)
    .bind(principal)
    .bind(A_USD)
    .bind(B_USD)
    .execute(&mut *tx)
    .await
    .unwrap();
    // Two debits: two entries, but no credit.
    sqlx::query(
        "INSERT INTO ledger_entries (transfer_id, account_id, currency, amount_minor, balance_after_minor)
         VALUES ($1, $2, 'USD', -500, 0), ($1, $3, 'USD', -500, 0)",
    )
    .bind(transfer_id)
    .bind(A_USD)
    .bind(B_USD)
    .execute(&mut *tx)
    .await
    .unwrap();

    let refused = tx.commit().await.expect_err("no credit, no commit");
    assert!(
        refused.to_string().contains("must commit with one debit"),
        "{refused}"
    );
    assert_eq!(customer_transfer_count(&app.pool).await, 0);
    assert_ledger_consistent(&app.pool).await;
}

/// The owned parts of a batch of USD transfers from A to B.
struct Postings<'a> {
    principal: PrincipalId,
    keys: &'a [String],
    amounts: Vec<AmountMinor>,
    fingerprints: Vec<[u8; 32]>,
    usd: Currency,
}

impl<'a> Postings<'a> {
    fn new(principal: PrincipalId, keys: &'a [String], amounts: &[i64]) -> Self {
        Self {
            principal,
            keys,
            amounts: amounts
                .iter()
                .map(|a| AmountMinor::parse(*a).unwrap())
                .collect(),
            fingerprints: (0..keys.len())
                .map(|i| [u8::try_from(i).unwrap(); 32])
                .collect(),
            usd: Currency::parse("USD").unwrap(),
        }
    }

    fn requests(&self) -> Vec<PostingRequest<'_>> {
        self.keys
            .iter()
            .zip(&self.amounts)
            .zip(&self.fingerprints)
            .map(|((key, amount), fingerprint)| PostingRequest {
                principal_id: Some(self.principal),
                idempotency_key: key,
                fingerprint,
                from: A_USD,
                to: B_USD,
                amount: *amount,
                currency: &self.usd,
                description: None,
                kind: PostingKind::Transfer,
            })
            .collect()
    }
}
