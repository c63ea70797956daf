//! All SQL on holds: pending transfers that reserve their amount on the
//! source account until they are posted, voided or expire.
//!
//! Locking order, the same everywhere so no two transactions wait on each
//! other in a cycle: the hold's row first, then its accounts in id order
//! (through [`repo::lock_accounts`]). Creating a hold locks only its source
//! account; the hold's row is new, so nothing waits on it.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use super::events::EventType;
use super::repo::{
    self, Account, KeyLookup, LockMode, PostingKind, PostingOutcome, PostingRequest, Transfer,
};
use super::{AmountMinor, Currency, Description, LedgerError, PlanMismatch};
use crate::principal::PrincipalId;

/// Where a hold stands. It is pending until exactly one of the other three
/// happens to it; a trigger refuses any change after that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum HoldStatus {
    Pending,
    Posted,
    Voided,
    Expired,
}

impl HoldStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Posted => "posted",
            Self::Voided => "voided",
            Self::Expired => "expired",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Hold {
    pub id: Uuid,
    pub principal_id: PrincipalId,
    pub idempotency_key: String,
    pub request_fingerprint: Vec<u8>,
    pub from_account: String,
    pub to_account: String,
    pub currency: String,
    pub amount_minor: i64,
    pub description: Option<String>,
    pub status: HoldStatus,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub resolved_at: Option<DateTime<Utc>>,
    pub resolved_key: Option<String>,
    pub resolved_fingerprint: Option<Vec<u8>>,
    pub posted_amount_minor: Option<i64>,
    /// Still pending but past its expiry, by the database's clock: it can
    /// no longer be posted or voided, only expired.
    pub due: bool,
}

impl Hold {
    /// Whether the request with this key and fingerprint is the one that
    /// posted or voided it.
    pub fn resolved_by(&self, key: &str, fingerprint: &[u8; 32]) -> Option<bool> {
        let resolved_key = self.resolved_key.as_deref()?;
        (resolved_key == key)
            .then(|| self.resolved_fingerprint.as_deref() == Some(fingerprint.as_slice()))
    }
}

/// The hold row aliased `h` as the API shows it, with `$receipt` (SQL for
/// its receipt, or NULL): the `hold_resource` function of migration 0008.
/// A literal so the statements built on it stay static SQL.
macro_rules! hold_resource {
    ($receipt:literal) => {
        concat!(
            "hold_resource(h.id, h.status, h.from_account, h.to_account, h.amount_minor,
                           h.posted_amount_minor, h.currency, h.description, h.created_at,
                           h.expires_at, h.resolved_at, ",
            $receipt,
            ")"
        )
    };
}

/// A literal so the queries built on it stay static SQL.
macro_rules! select_hold {
    () => {
        "SELECT id, principal_id, idempotency_key, request_fingerprint, from_account, to_account,
                currency, amount_minor, description, status, created_at, expires_at, resolved_at,
                resolved_key, resolved_fingerprint, posted_amount_minor,
                (status = 'pending' AND expires_at <= now()) AS due
         FROM holds"
    };
}

/// A hold as the caller asks for it.
#[derive(Debug, Clone)]
pub struct HoldRequest<'a> {
    pub principal_id: PrincipalId,
    pub idempotency_key: &'a str,
    pub fingerprint: &'a [u8; 32],
    pub from: &'a str,
    pub to: &'a str,
    pub amount: AmountMinor,
    pub currency: &'a Currency,
    pub description: Option<&'a Description>,
    /// Seconds from its creation (the database's clock) to its expiry.
    pub expires_in_seconds: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HoldOutcome {
    Created(Box<Hold>),
    /// The source's available balance cannot cover the amount.
    InsufficientFunds,
}

/// Creates a hold inside the caller's transaction: locks the source, checks
/// its available balance under the lock, writes the hold, reserves its
/// amount and writes its event (`hold.created`), in one statement. The
/// caller has checked the key is unused ([`super::reversals::key_use`]).
pub async fn create(
    conn: &mut PgConnection,
    request: &HoldRequest<'_>,
) -> Result<HoldOutcome, LedgerError> {
    let source = repo::lock_accounts(&mut *conn, &[request.from], LockMode::Wait)
        .await?
        .pop()
        .ok_or_else(|| LedgerError::AccountNotFound(request.from.to_owned()))?;
    if source.currency != request.currency.as_str() {
        return Err(LedgerError::CurrencyMismatch {
            transfer: request.currency.to_string(),
            account: source.id,
            account_currency: source.currency,
        });
    }
    let amount = request.amount.get();
    if !source.allow_negative && source.available_minor() < amount {
        return Ok(HoldOutcome::InsufficientFunds);
    }
    let hold: Hold = sqlx::query_as(concat!(
        "WITH inserted AS (
             INSERT INTO holds (id, principal_id, idempotency_key, request_fingerprint, from_account,
                                to_account, currency, amount_minor, description, expires_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, now() + make_interval(secs => $10))
             RETURNING *
         ), reserved AS (
             UPDATE accounts SET held_minor = held_minor + $8, event_seq = event_seq + 1
             WHERE id = $5
             RETURNING event_seq
         ), announced AS (
             INSERT INTO events (type, resource_id, resource, occurred_at, from_account, to_account,
                                 from_principal, to_principal, from_seq, to_seq)
             SELECT $12, h.id, ",
        hold_resource!("NULL"),
        ", h.created_at, h.from_account, h.to_account, $11,
                    (SELECT principal_id FROM accounts WHERE id = h.to_account), r.event_seq, NULL
             FROM inserted h, reserved r
         ) ",
        "SELECT id, principal_id, idempotency_key, request_fingerprint, from_account, to_account,
                currency, amount_minor, description, status, created_at, expires_at, resolved_at,
                resolved_key, resolved_fingerprint, posted_amount_minor, false AS due
         FROM inserted"
    ))
    .bind(Uuid::now_v7())
    .bind(request.principal_id)
    .bind(request.idempotency_key)
    .bind(request.fingerprint.as_slice())
    .bind(request.from)
    .bind(request.to)
    .bind(request.currency.as_str())
    .bind(amount)
    .bind(request.description.map(Description::as_str))
    .bind(request.expires_in_seconds as f64)
    .bind(source.principal_id)
    .bind(EventType::HoldCreated.as_str())
    .fetch_one(&mut *conn)
    .await?;
    Ok(HoldOutcome::Created(Box::new(hold)))
}

pub async fn find_by_key(
    conn: &mut PgConnection,
    principal_id: PrincipalId,
    idempotency_key: &str,
) -> Result<Option<Hold>, sqlx::Error> {
    sqlx::query_as(concat!(
        select_hold!(),
        " WHERE principal_id = $1 AND idempotency_key = $2"
    ))
    .bind(principal_id)
    .bind(idempotency_key)
    .fetch_optional(conn)
    .await
}

/// A hold, read without a lock.
pub async fn get<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    id: Uuid,
) -> Result<Option<Hold>, sqlx::Error> {
    sqlx::query_as(concat!(select_hold!(), " WHERE id = $1"))
        .bind(id)
        .fetch_optional(executor)
        .await
}

/// A page of the holds on `filter`'s accounts (as source or destination),
/// newest first, whatever their status: what `GET /transfers` lists beside
/// the transfers. The key filter matches the key that made the hold and
/// the one that posted or voided it.
pub async fn list<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    filter: &repo::TransferFilter<'_>,
    limit: i64,
) -> Result<Vec<Hold>, sqlx::Error> {
    filter
        .bind(
            sqlx::query_as(concat!(
                select_hold!(),
                " WHERE (from_account = ANY($1) OR to_account = ANY($1))
                    AND ($2::timestamptz IS NULL OR created_at > $2)
                    AND ($3::timestamptz IS NULL OR created_at < $3)
                    AND ($5::text IS NULL
                         OR (principal_id = $4 AND (idempotency_key = $5 OR resolved_key = $5)))
                    AND ($6::uuid IS NULL OR id < $6)
                  ORDER BY id DESC
                  LIMIT $7"
            )),
            limit,
        )
        .fetch_all(executor)
        .await
}

/// The hold, locked for the rest of the caller's transaction: whatever the
/// caller decides from its status stays true until it commits.
pub async fn lock(conn: &mut PgConnection, id: Uuid) -> Result<Option<Hold>, sqlx::Error> {
    sqlx::query_as(concat!(select_hold!(), " WHERE id = $1 FOR UPDATE"))
        .bind(id)
        .fetch_optional(conn)
        .await
}

/// How a locked, pending hold ends.
#[derive(Debug, Clone, Copy)]
pub enum Resolution<'a> {
    /// Posts `amount` (at most the held amount; the rest is released) under
    /// the request's key.
    Post {
        amount: AmountMinor,
        key: &'a str,
        fingerprint: &'a [u8; 32],
    },
    /// Releases the whole amount; nothing moves.
    Void {
        key: &'a str,
        fingerprint: &'a [u8; 32],
    },
    /// Past its expiry: released like a void, by no request.
    Expire,
}

/// Ends a hold locked by [`lock`] that is still pending: releases its
/// reservation, posts the transfer under the hold's id for a post, and
/// writes the hold's event (`hold.posted`, `hold.voided`, `hold.expired`).
/// Returns the hold as it now stands, and the transfer a post wrote.
pub async fn resolve(
    conn: &mut PgConnection,
    hold: &Hold,
    resolution: Resolution<'_>,
) -> Result<(Hold, Option<Transfer>), LedgerError> {
    let mut accounts = repo::lock_accounts(
        &mut *conn,
        &[hold.from_account.as_str(), hold.to_account.as_str()],
        LockMode::Wait,
    )
    .await?;
    let (status, key, fingerprint, posted_amount, transfer) = match resolution {
        Resolution::Post {
            amount,
            key,
            fingerprint,
        } => {
            // First, in a statement of its own: the debit that follows must
            // find the reservation gone (CHECK balance >= held, per row).
            release(&mut *conn, &hold.from_account, hold.amount_minor).await?;
            for account in accounts.iter_mut().filter(|a| a.id == hold.from_account) {
                account.held_minor -= hold.amount_minor;
            }
            let transfer =
                post_hold(&mut *conn, hold, amount, key, fingerprint, &mut accounts).await?;
            (
                HoldStatus::Posted,
                Some(key),
                Some(fingerprint.as_slice()),
                Some(amount.get()),
                Some(transfer),
            )
        }
        Resolution::Void { key, fingerprint } => (
            HoldStatus::Voided,
            Some(key),
            Some(fingerprint.as_slice()),
            None,
            None,
        ),
        Resolution::Expire => (HoldStatus::Expired, None, None, None, None),
    };
    let account = |id: &str| accounts.iter().find(|a| a.id == id);
    let owner = |id: &str| account(id).and_then(|a| a.principal_id);
    // A post's sequence numbers were taken by its posting (which keeps
    // `accounts` current); a void or an expiry takes the source's next one
    // with the release below.
    let posted_seqs = transfer.as_ref().map(|_| {
        (
            account(&hold.from_account).map(|a| a.event_seq),
            account(&hold.to_account).map(|a| a.event_seq),
        )
    });
    let (from_seq, to_seq) = posted_seqs.unwrap_or((None, None));
    let release_now = transfer.is_none().then_some(hold.amount_minor);
    let resolved: Hold = sqlx::query_as(concat!(
        "WITH resolved AS (
             UPDATE holds SET status = $2, resolved_at = now(), resolved_key = $3,
                              resolved_fingerprint = $4, posted_amount_minor = $5
             WHERE id = $1 AND status = 'pending'
             RETURNING *
         ), released AS (
             UPDATE accounts a SET held_minor = a.held_minor - $6, event_seq = a.event_seq + 1
             FROM resolved h
             WHERE $6::int8 IS NOT NULL AND a.id = h.from_account
             RETURNING a.event_seq
         ), announced AS (
             INSERT INTO events (type, resource_id, resource, occurred_at, from_account, to_account,
                                 from_principal, to_principal, from_seq, to_seq)
             SELECT $9, h.id, ",
        hold_resource!(
            "CASE WHEN $12::text IS NULL THEN NULL ELSE receipt_resource($12, $13, $14, $15) END"
        ),
        ", h.resolved_at, h.from_account, h.to_account, $10, $11,
                    COALESCE((SELECT event_seq FROM released), $7), $8
             FROM resolved h
         ) ",
        "SELECT id, principal_id, idempotency_key, request_fingerprint, from_account, to_account,
                currency, amount_minor, description, status, created_at, expires_at, resolved_at,
                resolved_key, resolved_fingerprint, posted_amount_minor, false AS due
         FROM resolved"
    ))
    .bind(hold.id)
    .bind(status)
    .bind(key)
    .bind(fingerprint)
    .bind(posted_amount)
    .bind(release_now)
    .bind(from_seq)
    .bind(to_seq)
    .bind(event_type(status).as_str())
    .bind(owner(&hold.from_account))
    .bind(owner(&hold.to_account))
    .bind(transfer.as_ref().map(|t| t.receipt_id.as_str()))
    .bind(transfer.as_ref().map(|t| t.debit_entry_id))
    .bind(transfer.as_ref().map(|t| t.credit_entry_id))
    .bind(transfer.as_ref().map(|t| t.created_at))
    .fetch_optional(&mut *conn)
    .await?
    .ok_or(LedgerError::HoldNotPending(hold.id))?;
    Ok((resolved, transfer))
}

/// The event of a hold reaching `status`.
fn event_type(status: HoldStatus) -> EventType {
    match status {
        HoldStatus::Pending => EventType::HoldCreated,
        HoldStatus::Posted => EventType::HoldPosted,
        HoldStatus::Voided => EventType::HoldVoided,
        HoldStatus::Expired => EventType::HoldExpired,
    }
}

/// Releases a hold's reservation ahead of the posting that takes its
/// place; the posting takes the accounts' event numbers.
async fn release(conn: &mut PgConnection, account: &str, amount: i64) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE accounts SET held_minor = held_minor - $2 WHERE id = $1")
        .bind(account)
        .bind(amount)
        .execute(conn)
        .await
        .map(drop)
}

/// The transfer that posts a hold: under the hold's id, the request's key,
/// through the one posting path every transfer takes.
async fn post_hold(
    conn: &mut PgConnection,
    hold: &Hold,
    amount: AmountMinor,
    key: &str,
    fingerprint: &[u8; 32],
    accounts: &mut [Account],
) -> Result<Transfer, LedgerError> {
    let invalid = |what: &str| {
        LedgerError::PlanMismatch(PlanMismatch::StoredValue(format!(
            "hold {} has an invalid {what}",
            hold.id
        )))
    };
    let currency = Currency::parse(&hold.currency).map_err(|_| invalid("currency"))?;
    let description = hold
        .description
        .as_deref()
        .map(Description::parse)
        .transpose()
        .map_err(|_| invalid("description"))?;
    let request = PostingRequest {
        principal_id: Some(hold.principal_id),
        idempotency_key: key,
        fingerprint,
        from: &hold.from_account,
        to: &hold.to_account,
        amount,
        currency: &currency,
        description: description.as_ref(),
        kind: PostingKind::HoldPost { hold_id: hold.id },
    };
    let mut outcomes = repo::post_locked(
        conn,
        std::slice::from_ref(&request),
        accounts,
        KeyLookup::First,
    )
    .await?;
    match outcomes.pop() {
        Some(PostingOutcome::Posted(transfer)) => Ok(transfer),
        Some(PostingOutcome::AlreadyPosted(_)) => Err(LedgerError::KeyAlreadyUsed),
        // The reservation was there: a refusal means the ledger disagrees
        // with its own constraints.
        Some(PostingOutcome::InsufficientFunds) | None => Err(invalid("reservation")),
    }
}

/// The most holds one expiry transaction ends: a few milliseconds of locks.
pub const EXPIRY_BATCH_MAX: i64 = 500;

/// Expires pending holds past their expiry, oldest first, at most
/// `batch` of them, in the caller's transaction. Holds locked by a request
/// that is posting or voiding them are skipped (that request expires them
/// itself when it finds them due). The expiry, the release of every
/// reservation and every `hold.expired` event are one statement, once the
/// sources are locked in id order. Returns how many it expired.
pub async fn expire_due(conn: &mut PgConnection, batch: i64) -> Result<u64, LedgerError> {
    let due: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT id, from_account FROM holds
         WHERE status = 'pending' AND expires_at <= now()
         ORDER BY expires_at
         LIMIT $1
         FOR UPDATE SKIP LOCKED",
    )
    .bind(batch.max(1))
    .fetch_all(&mut *conn)
    .await?;
    if due.is_empty() {
        return Ok(0);
    }
    let mut sources: Vec<&str> = due.iter().map(|(_, from)| from.as_str()).collect();
    sources.sort_unstable();
    sources.dedup();
    repo::lock_accounts(&mut *conn, &sources, LockMode::Wait).await?;
    let ids: Vec<Uuid> = due.iter().map(|(id, _)| *id).collect();
    // Each source's events take its next numbers in the order the
    // positions are taken, so its numbers and positions agree.
    let (expired, announced): (i64, i64) = sqlx::query_as(concat!(
        "WITH expired AS (
             UPDATE holds SET status = 'expired', resolved_at = now()
             WHERE id = ANY($1) AND status = 'pending'
             RETURNING *
         ), per_source AS (
             SELECT from_account, sum(amount_minor)::bigint AS total, count(*) AS n
             FROM expired GROUP BY from_account
         ), released AS (
             UPDATE accounts a SET held_minor = a.held_minor - s.total, event_seq = a.event_seq + s.n
             FROM per_source s
             WHERE a.id = s.from_account
             RETURNING a.id, a.event_seq - s.n AS opening_seq, a.principal_id
         ), announced AS (
             INSERT INTO events (type, resource_id, resource, occurred_at, from_account, to_account,
                                 from_principal, to_principal, from_seq, to_seq)
             SELECT $2, h.id, ",
        hold_resource!("NULL"),
        ", h.resolved_at, h.from_account, h.to_account, r.principal_id,
                    (SELECT principal_id FROM accounts WHERE id = h.to_account),
                    r.opening_seq + row_number() OVER (PARTITION BY h.from_account
                                                       ORDER BY h.expires_at, h.id),
                    NULL
             FROM expired h
             JOIN released r ON r.id = h.from_account
             ORDER BY h.expires_at, h.id
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM expired), (SELECT count(*) FROM announced)"
    ))
    .bind(&ids)
    .bind(EventType::HoldExpired.as_str())
    .fetch_one(&mut *conn)
    .await?;
    if usize::try_from(expired).ok() != Some(ids.len()) || announced != expired {
        return Err(LedgerError::PlanMismatch(PlanMismatch::StoredValue(
            format!(
                "{expired} of {} locked pending holds expired, with {announced} events",
                ids.len()
            ),
        )));
    }
    Ok(u64::try_from(expired).unwrap_or(0))
}
