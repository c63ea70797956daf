//! SQL for reversals and atomic batches: transfers posted through the one
//! posting path ([`repo::post_locked`]) with what makes them more than a
//! transfer (a link to the original, a batch that all legs commit with).

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use super::holds::{self, Hold};
use super::plan::{self, Plan};
use super::repo::{
    self, KeyLookup, LockMode, PostingKind, PostingOutcome, PostingRequest, Transfer,
};
use super::{AmountMinor, Currency, Description, LedgerError, PlanMismatch};
use crate::principal::PrincipalId;

/// What a principal's key already did, found before anything is planned:
/// a very late retry (its idempotency record purged) must find it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyUse {
    Transfer(Transfer),
    Hold(Hold),
    Batch(Batch, Vec<Transfer>),
}

/// The transfer, hold or batch a principal's key made, if any.
pub async fn key_use(
    conn: &mut PgConnection,
    principal_id: PrincipalId,
    key: &str,
) -> Result<Option<KeyUse>, sqlx::Error> {
    if let Some(t) = repo::find_by_key(&mut *conn, Some(principal_id), key).await? {
        return Ok(Some(KeyUse::Transfer(t)));
    }
    if let Some(h) = holds::find_by_key(&mut *conn, principal_id, key).await? {
        return Ok(Some(KeyUse::Hold(h)));
    }
    let batch: Option<Batch> = sqlx::query_as(
        "SELECT id, principal_id, idempotency_key, request_fingerprint, created_at
         FROM transfer_batches WHERE principal_id = $1 AND idempotency_key = $2",
    )
    .bind(principal_id)
    .bind(key)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(match batch {
        Some(batch) => {
            let legs = repo::transfers_of_batch(&mut *conn, batch.id).await?;
            Some(KeyUse::Batch(batch, legs))
        }
        None => None,
    })
}

/// A reversal as the caller asks for it.
#[derive(Debug, Clone)]
pub struct ReversalRequest<'a> {
    pub principal_id: PrincipalId,
    pub idempotency_key: &'a str,
    pub fingerprint: &'a [u8; 32],
    pub original: Uuid,
    /// `None`: whatever is left to give back.
    pub amount: Option<AmountMinor>,
    pub description: Option<&'a Description>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReversalOutcome {
    Posted(Box<Transfer>),
    /// The reversals would add up to more than the original moved.
    ExceedsTransfer,
    /// The original's destination no longer holds the amount.
    InsufficientFunds,
}

#[derive(sqlx::FromRow)]
struct Original {
    from_account: String,
    to_account: String,
    currency: String,
    amount_minor: i64,
    reversed_minor: i64,
}

/// Reverses (part of) a transfer inside the caller's transaction: locks the
/// original's row (its reversed sum is decided under that lock), then both
/// accounts, and posts the reversal from its destination back to its
/// source. The caller has checked the key is unused ([`key_use`]).
pub async fn reverse(
    conn: &mut PgConnection,
    request: &ReversalRequest<'_>,
) -> Result<ReversalOutcome, LedgerError> {
    // NO KEY UPDATE: the reversal's foreign key to it only needs KEY SHARE.
    let original: Original = sqlx::query_as(
        "SELECT from_account, to_account, currency, amount_minor, reversed_minor
         FROM transfers WHERE id = $1 FOR NO KEY UPDATE",
    )
    .bind(request.original)
    .fetch_optional(&mut *conn)
    .await?
    .ok_or_else(|| PlanMismatch::StoredValue(format!("transfer {} vanished", request.original)))?;
    let left = original.amount_minor - original.reversed_minor;
    let amount = match request.amount {
        Some(amount) if amount.get() <= left => amount,
        Some(_) => return Ok(ReversalOutcome::ExceedsTransfer),
        None => match AmountMinor::parse(left) {
            Ok(amount) => amount,
            // Nothing left to give back.
            Err(_) => return Ok(ReversalOutcome::ExceedsTransfer),
        },
    };
    let currency = Currency::parse(&original.currency).map_err(|_| {
        PlanMismatch::StoredValue(format!(
            "transfer {} has an invalid currency",
            request.original
        ))
    })?;
    let mut accounts = repo::lock_accounts(
        &mut *conn,
        &[original.to_account.as_str(), original.from_account.as_str()],
        LockMode::Wait,
    )
    .await?;
    let posting = PostingRequest {
        principal_id: Some(request.principal_id),
        idempotency_key: request.idempotency_key,
        fingerprint: request.fingerprint,
        from: &original.to_account,
        to: &original.from_account,
        amount,
        currency: &currency,
        description: request.description,
        kind: PostingKind::Reversal {
            original: request.original,
        },
    };
    let outcome = repo::post_locked(
        &mut *conn,
        std::slice::from_ref(&posting),
        &mut accounts,
        KeyLookup::First,
    )
    .await?
    .pop();
    let reversal = match outcome {
        Some(PostingOutcome::Posted(t)) => t,
        Some(PostingOutcome::InsufficientFunds) => return Ok(ReversalOutcome::InsufficientFunds),
        Some(PostingOutcome::AlreadyPosted(_)) => return Err(LedgerError::KeyAlreadyUsed),
        None => {
            return Err(PlanMismatch::TransfersWritten {
                written: 0,
                planned: 1,
            }
            .into());
        }
    };
    sqlx::query("UPDATE transfers SET reversed_minor = reversed_minor + $2 WHERE id = $1")
        .bind(request.original)
        .bind(amount.get())
        .execute(&mut *conn)
        .await?;
    Ok(ReversalOutcome::Posted(Box::new(reversal)))
}

/// The most transfers one atomic batch may hold (the table's CHECK says the
/// same): enough for a marketplace payout's legs, small enough that a batch
/// locks its accounts for milliseconds and its request fits the body limit.
pub const BATCH_LEGS_MAX: usize = 100;

#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Batch {
    pub id: Uuid,
    pub principal_id: PrincipalId,
    pub idempotency_key: String,
    pub request_fingerprint: Vec<u8>,
    pub created_at: DateTime<Utc>,
}

/// One leg as the caller asks for it.
#[derive(Debug, Clone)]
pub struct Leg<'a> {
    pub from: &'a str,
    pub to: &'a str,
    pub amount: AmountMinor,
    pub currency: &'a Currency,
    pub description: Option<&'a Description>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchOutcome {
    Posted(Batch, Vec<Transfer>),
    /// This leg (0-based) cannot be covered, counting what the legs before
    /// it move: nothing was posted.
    InsufficientFunds {
        leg: usize,
    },
}

/// Posts every leg or none inside the caller's transaction: locks all the
/// legs' accounts in id order, decides every leg in order against the
/// balances the earlier ones leave (a dry run of the plan), and only if all
/// pass writes the batch and its legs. The caller has checked the key is
/// unused ([`key_use`]).
pub async fn post_batch(
    conn: &mut PgConnection,
    principal_id: PrincipalId,
    key: &str,
    fingerprint: &[u8; 32],
    legs: &[Leg<'_>],
) -> Result<BatchOutcome, LedgerError> {
    let batch_id = Uuid::now_v7();
    let legs_count = i16::try_from(legs.len())
        .map_err(|_| PlanMismatch::StoredValue("too many legs".to_owned()))?;
    let leg_keys: Vec<String> = (0..legs_count)
        .map(|n| format!("batch:{batch_id}:{n}"))
        .collect();
    let requests: Vec<PostingRequest<'_>> = legs
        .iter()
        .zip(&leg_keys)
        .zip(0..legs_count)
        .map(|((leg, leg_key), n)| PostingRequest {
            principal_id: Some(principal_id),
            idempotency_key: leg_key,
            fingerprint,
            from: leg.from,
            to: leg.to,
            amount: leg.amount,
            currency: leg.currency,
            description: leg.description,
            kind: PostingKind::BatchLeg { batch_id, leg: n },
        })
        .collect();
    let mut ids: Vec<&str> = legs.iter().flat_map(|l| [l.from, l.to]).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut accounts = repo::lock_accounts(&mut *conn, &ids, LockMode::Wait).await?;
    let dry_run = plan::plan(&requests, &mut accounts.clone())?;
    if let Some(leg) = dry_run
        .iter()
        .position(|p| matches!(p, Plan::InsufficientFunds))
    {
        return Ok(BatchOutcome::InsufficientFunds { leg });
    }
    // Before its legs: each names it (a foreign key).
    let batch: Batch = sqlx::query_as(
        "INSERT INTO transfer_batches (id, principal_id, idempotency_key, request_fingerprint, legs)
         VALUES ($1, $2, $3, $4, $5)
         RETURNING id, principal_id, idempotency_key, request_fingerprint, created_at",
    )
    .bind(batch_id)
    .bind(principal_id)
    .bind(key)
    .bind(fingerprint.as_slice())
    .bind(legs_count)
    .fetch_one(&mut *conn)
    .await?;
    let outcomes =
        repo::post_locked(&mut *conn, &requests, &mut accounts, KeyLookup::Optimistic).await?;
    let mut posted = Vec::with_capacity(outcomes.len());
    for outcome in outcomes {
        match outcome {
            PostingOutcome::Posted(t) => posted.push(t),
            _ => {
                return Err(PlanMismatch::StoredValue(format!(
                    "batch {batch_id}: a leg the dry run passed was not posted"
                ))
                .into());
            }
        }
    }
    Ok(BatchOutcome::Posted(batch, posted))
}

/// A batch by id, with its legs in order.
pub async fn get_batch(
    conn: &mut PgConnection,
    id: Uuid,
) -> Result<Option<(Batch, Vec<Transfer>)>, sqlx::Error> {
    let batch: Option<Batch> = sqlx::query_as(
        "SELECT id, principal_id, idempotency_key, request_fingerprint, created_at
         FROM transfer_batches WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    match batch {
        Some(batch) => {
            let legs = repo::transfers_of_batch(&mut *conn, batch.id).await?;
            Ok(Some((batch, legs)))
        }
        None => Ok(None),
    }
}
