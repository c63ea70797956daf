//! All SQL on accounts, transfers and ledger entries.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::{AmountMinor, Currency, Description, LedgerError};

#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Account {
    pub id: String,
    pub principal_id: Option<Uuid>,
    pub currency: String,
    pub balance_minor: i64,
    pub allow_negative: bool,
}

/// A posted transfer with the two entries that moved its money.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Transfer {
    pub id: Uuid,
    pub principal_id: Option<Uuid>,
    pub request_fingerprint: Vec<u8>,
    pub from_account: String,
    pub to_account: String,
    pub currency: String,
    pub amount_minor: i64,
    pub description: Option<String>,
    pub status: String,
    pub receipt_id: String,
    pub created_at: DateTime<Utc>,
    pub debit_entry_id: i64,
    pub credit_entry_id: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Entry {
    pub id: i64,
    pub transfer_id: Uuid,
    pub account_id: String,
    pub currency: String,
    pub amount_minor: i64,
    pub balance_after_minor: i64,
    pub created_at: DateTime<Utc>,
}

/// One movement of money, as the caller asks for it.
#[derive(Debug, Clone)]
pub struct PostingRequest<'a> {
    /// Who asked; `None` for an operator's deposit.
    pub principal_id: Option<Uuid>,
    /// The intent's key: unique per principal for ever, so a very late
    /// retry finds the transfer instead of posting a second one.
    pub idempotency_key: &'a str,
    pub fingerprint: &'a [u8; 32],
    pub from: &'a str,
    pub to: &'a str,
    pub amount: AmountMinor,
    pub currency: &'a Currency,
    pub description: Option<&'a Description>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PostingOutcome {
    Posted(Transfer),
    /// A transfer with this principal and key already exists (its
    /// idempotency record was purged, or it is an operator's repeated
    /// deposit): nothing was posted.
    AlreadyPosted(Transfer),
    /// The source balance cannot cover the amount: nothing was posted.
    InsufficientFunds,
}

/// A transfer with its debit and credit entry ids; a literal so that the
/// queries built on it stay static SQL.
macro_rules! select_transfer {
    () => {
        "SELECT t.id, t.principal_id, t.request_fingerprint, t.from_account, t.to_account,
                t.currency, t.amount_minor, t.description, t.status, t.receipt_id, t.created_at,
                d.id AS debit_entry_id, c.id AS credit_entry_id
         FROM transfers t
         JOIN ledger_entries d ON d.transfer_id = t.id AND d.account_id = t.from_account
         JOIN ledger_entries c ON c.transfer_id = t.id AND c.account_id = t.to_account"
    };
}

/// Posts one transfer inside the caller's transaction: locks both accounts
/// in id order (so opposite transfers cannot deadlock, and so the foreign-key
/// checks of the inserts find the rows already locked instead of queueing
/// shared locks behind the balance update), checks the funds under the lock,
/// then writes the transfer, its two entries and both balances.
#[tracing::instrument(skip_all, fields(from = request.from, to = request.to, amount = request.amount.get()))]
pub async fn post_transfer(
    conn: &mut PgConnection,
    request: &PostingRequest<'_>,
) -> Result<PostingOutcome, LedgerError> {
    let mut accounts = lock_accounts(&mut *conn, &[request.from, request.to]).await?;
    post_locked(conn, request, &mut accounts).await
}

/// Posts one transfer whose accounts the caller's transaction has already
/// locked (a batch locks all of its accounts at once); `accounts` holds them
/// with their current balances, and is kept current: a posting updates the
/// two balances it moved, so the next posting of the batch checks its funds
/// against them without reading the rows again.
pub async fn post_locked(
    conn: &mut PgConnection,
    request: &PostingRequest<'_>,
    accounts: &mut [Account],
) -> Result<PostingOutcome, LedgerError> {
    let find = |id: &str| {
        accounts
            .iter()
            .find(|a| a.id == id)
            .ok_or_else(|| LedgerError::AccountNotFound(id.to_owned()))
    };
    let (from, to) = (find(request.from)?, find(request.to)?);
    for account in [from, to] {
        if account.currency != request.currency.as_str() {
            return Err(LedgerError::CurrencyMismatch {
                transfer: request.currency.to_string(),
                account: account.id.clone(),
                account_currency: account.currency.clone(),
            });
        }
    }

    let amount = request.amount.get();
    if !from.allow_negative && from.balance_minor < amount {
        // A late retry of an intent that already moved the money must find
        // its transfer, not a rejection caused by that same debit.
        return Ok(
            match find_by_key(&mut *conn, request.principal_id, request.idempotency_key).await? {
                Some(existing) => PostingOutcome::AlreadyPosted(existing),
                None => PostingOutcome::InsufficientFunds,
            },
        );
    }

    let transfer_id = Uuid::now_v7();
    let receipt_id = format!("rcpt_{}", Uuid::new_v4().simple());
    // One statement for the transfer row, both balances and both entries:
    // one round trip instead of four, which is what bounds throughput on a
    // small, CPU-bound database machine. The accounts are already locked
    // above, so the foreign-key checks that fire at the end of the statement
    // find rows this transaction holds. When the key already has a transfer
    // the insert yields nothing, so neither do the balance update and the
    // entries (they depend on it), and no row comes back.
    let posted: Option<(DateTime<Utc>, String, i64, i64)> = sqlx::query_as(
        "WITH transfer AS (
             INSERT INTO transfers (id, principal_id, idempotency_key, request_fingerprint,
                                    from_account, to_account, currency, amount_minor, description, receipt_id)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
             ON CONFLICT (principal_id, idempotency_key) DO NOTHING
             RETURNING id, created_at, status
         ), moved AS (
             UPDATE accounts
             SET balance_minor = balance_minor + CASE WHEN id = $5 THEN -$8::bigint ELSE $8::bigint END
             WHERE id IN ($5, $6) AND EXISTS (SELECT 1 FROM transfer)
             RETURNING id, balance_minor
         ), entries AS (
             -- Each entry records the balance its account was left with; the
             -- debit is written first, as it always was.
             INSERT INTO ledger_entries (transfer_id, account_id, currency, amount_minor, balance_after_minor)
             SELECT t.id, m.id, $7, CASE WHEN m.id = $5 THEN -$8::bigint ELSE $8::bigint END, m.balance_minor
             FROM transfer t CROSS JOIN moved m
             ORDER BY m.id <> $5
             RETURNING id, account_id
         )
         SELECT t.created_at, t.status,
                (SELECT id FROM entries WHERE account_id = $5) AS debit_entry_id,
                (SELECT id FROM entries WHERE account_id = $6) AS credit_entry_id
         FROM transfer t",
    )
    .bind(transfer_id)
    .bind(request.principal_id)
    .bind(request.idempotency_key)
    .bind(request.fingerprint.as_slice())
    .bind(request.from)
    .bind(request.to)
    .bind(request.currency.as_str())
    .bind(amount)
    .bind(request.description.map(Description::as_str))
    .bind(&receipt_id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((created_at, status, debit_entry_id, credit_entry_id)) = posted else {
        return match find_by_key(&mut *conn, request.principal_id, request.idempotency_key).await? {
            Some(existing) => Ok(PostingOutcome::AlreadyPosted(existing)),
            None => Err(LedgerError::Database(sqlx::Error::RowNotFound)),
        };
    };
    for account in accounts.iter_mut() {
        if account.id == request.from {
            account.balance_minor -= amount;
        } else if account.id == request.to {
            account.balance_minor += amount;
        }
    }
    // The row as written, built from what was sent and what came back
    // instead of read again.
    Ok(PostingOutcome::Posted(Transfer {
        id: transfer_id,
        principal_id: request.principal_id,
        request_fingerprint: request.fingerprint.to_vec(),
        from_account: request.from.to_owned(),
        to_account: request.to.to_owned(),
        currency: request.currency.as_str().to_owned(),
        amount_minor: amount,
        description: request.description.map(|d| d.as_str().to_owned()),
        status,
        receipt_id,
        created_at,
        debit_entry_id,
        credit_entry_id,
    }))
}

/// Locks accounts for the rest of the caller's transaction, in id order:
/// every transaction that locks accounts does it through here, so no two
/// can wait on each other in a cycle. Locking an account this transaction
/// already holds is free.
pub async fn lock_accounts(
    conn: &mut PgConnection,
    ids: &[&str],
) -> Result<Vec<Account>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, principal_id, currency, balance_minor, allow_negative
         FROM accounts WHERE id = ANY($1) ORDER BY id FOR UPDATE",
    )
    .bind(ids)
    .fetch_all(conn)
    .await
}

async fn find_by_key(
    conn: &mut PgConnection,
    principal_id: Option<Uuid>,
    idempotency_key: &str,
) -> Result<Option<Transfer>, sqlx::Error> {
    sqlx::query_as(concat!(
        select_transfer!(),
        " WHERE t.principal_id IS NOT DISTINCT FROM $1 AND t.idempotency_key = $2"
    ))
    .bind(principal_id)
    .bind(idempotency_key)
    .fetch_optional(conn)
    .await
}

pub async fn get_transfer<'e>(
    executor: impl PgExecutor<'e>,
    id: Uuid,
) -> Result<Option<Transfer>, sqlx::Error> {
    sqlx::query_as(concat!(select_transfer!(), " WHERE t.id = $1"))
        .bind(id)
        .fetch_optional(executor)
        .await
}

pub async fn get_account<'e>(
    executor: impl PgExecutor<'e>,
    id: &str,
) -> Result<Option<Account>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, principal_id, currency, balance_minor, allow_negative FROM accounts WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(executor)
    .await
}

/// Both accounts of a prospective transfer, read without locks: owner and
/// currency never change, so checks on them made before the claim still hold
/// inside the posting transaction.
pub async fn get_accounts<'e>(
    executor: impl PgExecutor<'e>,
    ids: &[&str],
) -> Result<Vec<Account>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, principal_id, currency, balance_minor, allow_negative FROM accounts WHERE id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(executor)
    .await
}

/// A page of an account's entries, newest first, strictly older than
/// `before_entry_id` when given.
pub async fn list_entries<'e>(
    executor: impl PgExecutor<'e>,
    account_id: &str,
    before_entry_id: Option<i64>,
    limit: i64,
) -> Result<Vec<Entry>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, transfer_id, account_id, currency, amount_minor, balance_after_minor, created_at
         FROM ledger_entries
         WHERE account_id = $1 AND ($2::bigint IS NULL OR id < $2)
         ORDER BY id DESC
         LIMIT $3",
    )
    .bind(account_id)
    .bind(before_entry_id)
    .bind(limit)
    .fetch_all(executor)
    .await
}

/// The currencies the ledger supports, from the `currencies` table.
pub async fn supported_currencies<'e>(
    executor: impl PgExecutor<'e>,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT code FROM currencies ORDER BY code")
        .fetch_all(executor)
        .await
}
