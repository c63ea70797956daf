//! All SQL on `idempotency_keys`: the insert-first claim, the takeover of
//! abandoned or failed claims, the fenced completion, and the purge.

use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use http::{HeaderName, HeaderValue, StatusCode};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use super::{Fingerprint, IdempotencyKey};
use crate::db::KeyPool;
use crate::principal::PrincipalId;

/// How long records live and how long a claim may stay unfinished.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// How long a record (and so a replayable response) is kept. Past it the
    /// purge may delete the record; `transfers`' permanent unique key still
    /// stops a second posting.
    pub ttl: Duration,
    /// How long a claim is exclusively owned. A process that dies holding one
    /// blocks its key for at most this long; then a retry takes it over.
    pub lease: Duration,
}

/// Proof of owning a key: completing it requires the same `lock_token`.
#[derive(Debug, Clone)]
pub struct Claim {
    pub scope: PrincipalId,
    pub key: IdempotencyKey,
    pub lock_token: Uuid,
    /// The claim replaced an abandoned, failed or expired one.
    pub took_over: bool,
}

/// Where a key's record stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "SCREAMING_SNAKE_CASE")]
pub enum KeyStatus {
    /// Claimed; its owner is executing (or died, and the lease will free it).
    InProgress,
    /// Its answer is stored and replayed.
    Completed,
    /// Released after a technical failure: the same request executes again.
    Failed,
    /// A tombstone: the intent was cancelled by its key, and no request with
    /// the key executes until the record expires.
    Cancelled,
}

/// A response as it is stored and replayed: status, the headers that must
/// replay, and the exact body bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: StatusCode,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
}

/// Headers as the record keeps them: names and values as text, in order.
type StoredHeaders = sqlx::types::Json<Vec<(String, String)>>;

impl StoredResponse {
    fn header_texts(&self) -> StoredHeaders {
        sqlx::types::Json(
            self.headers
                .iter()
                .filter_map(|(name, value)| {
                    Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
                })
                .collect(),
        )
    }

    /// Rebuilt from a record's columns. The table's CHECKs keep a status in
    /// range and headers that were valid when stored; anything else is
    /// dropped rather than replayed wrong.
    fn from_record(status: i16, headers: StoredHeaders, body: Vec<u8>) -> Option<Self> {
        let status = StatusCode::from_u16(u16::try_from(status).ok()?).ok()?;
        let headers = headers
            .0
            .into_iter()
            .filter_map(|(name, value)| {
                Some((
                    HeaderName::from_bytes(name.as_bytes()).ok()?,
                    HeaderValue::from_str(&value).ok()?,
                ))
            })
            .collect();
        Some(Self {
            status,
            headers,
            body: Bytes::from(body),
        })
    }

    fn status_code(&self) -> i16 {
        i16::try_from(self.status.as_u16()).unwrap_or(500)
    }
}

#[derive(Debug)]
pub enum ClaimOutcome {
    /// This request owns the key and must execute.
    Claimed(Claim),
    /// The key completed earlier with this same request: replay it.
    Replay(StoredResponse),
    /// The key was used for a different request.
    Mismatch,
    /// Another request holds the key and its lease is live.
    InFlight { locked_until: DateTime<Utc> },
    /// The intent was cancelled by its key: nothing may execute under it.
    Cancelled,
}

/// A claim row can vanish (purged) or change hands between our statements;
/// each pass re-reads it. Three passes are plenty: the row only changes
/// through a completed request, a purge or a takeover, and each of those
/// settles the next pass.
const CLAIM_PASSES_MAX: usize = 3;

#[derive(sqlx::FromRow)]
struct ExistingRow {
    fingerprint: Vec<u8>,
    status: KeyStatus,
    locked_until: DateTime<Utc>,
    lease_live: bool,
    expired: bool,
    response_status: Option<i16>,
    response_headers: Option<StoredHeaders>,
    response_body: Option<Vec<u8>>,
    transfer_id: Option<Uuid>,
    updated_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
}

impl ExistingRow {
    fn response(self) -> Option<StoredResponse> {
        StoredResponse::from_record(
            self.response_status?,
            self.response_headers?,
            self.response_body?,
        )
    }
}

/// The claim statement's answer: our token when the insert won, otherwise
/// the colliding row as the statement's snapshot saw it (all NULL when the
/// row committed after the snapshot was taken).
#[derive(sqlx::FromRow)]
struct ClaimAttempt {
    claimed: Option<Uuid>,
    fingerprint: Option<Vec<u8>>,
    status: Option<KeyStatus>,
    locked_until: Option<DateTime<Utc>>,
    lease_live: Option<bool>,
    expired: Option<bool>,
    response_status: Option<i16>,
    response_headers: Option<StoredHeaders>,
    response_body: Option<Vec<u8>>,
    transfer_id: Option<Uuid>,
    updated_at: Option<DateTime<Utc>>,
    expires_at: Option<DateTime<Utc>>,
}

impl ClaimAttempt {
    fn existing(self) -> Option<ExistingRow> {
        Some(ExistingRow {
            fingerprint: self.fingerprint?,
            status: self.status?,
            locked_until: self.locked_until?,
            lease_live: self.lease_live?,
            expired: self.expired?,
            response_status: self.response_status,
            response_headers: self.response_headers,
            response_body: self.response_body,
            transfer_id: self.transfer_id,
            updated_at: self.updated_at?,
            expires_at: self.expires_at?,
        })
    }
}

#[tracing::instrument(skip_all, fields(key = %key))]
pub async fn claim(
    keys: &KeyPool,
    policy: Policy,
    scope: PrincipalId,
    key: &IdempotencyKey,
    method: &str,
    path: &str,
    fingerprint: &Fingerprint,
) -> Result<ClaimOutcome, sqlx::Error> {
    let pool = keys.pool();
    let mut last_seen_until = Utc::now();
    for _ in 0..CLAIM_PASSES_MAX {
        let token = Uuid::new_v4();
        // The insert-first claim and a read of the row it collided with, in
        // one statement: a replay or a conflict is answered in one round
        // trip instead of two. The read uses the statement's snapshot, so it
        // misses a row committed while the insert waited on it; only then is
        // the row read again on its own.
        let attempt: ClaimAttempt = sqlx::query_as(
            "WITH claimed AS (
                 INSERT INTO idempotency_keys
                     (principal_id, idempotency_key, request_method, request_path, fingerprint,
                      status, lock_token, locked_until, expires_at)
                 VALUES ($1, $2, $3, $4, $5, 'IN_PROGRESS', $6,
                         now() + make_interval(secs => $7), now() + make_interval(secs => $8))
                 ON CONFLICT (principal_id, idempotency_key) DO NOTHING
                 RETURNING lock_token
             )
             SELECT (SELECT lock_token FROM claimed) AS claimed, k.*
             FROM (SELECT 1) AS one
             LEFT JOIN LATERAL (
                 SELECT fingerprint, status, locked_until,
                        locked_until > now() AS lease_live,
                        expires_at <= now() AS expired,
                        response_status, response_headers, response_body,
                        transfer_id, updated_at, expires_at
                 FROM idempotency_keys
                 WHERE principal_id = $1 AND idempotency_key = $2
             ) AS k ON true",
        )
        .bind(scope)
        .bind(key.as_str())
        .bind(method)
        .bind(path)
        .bind(fingerprint.as_bytes().as_slice())
        .bind(token)
        .bind(policy.lease.as_secs_f64())
        .bind(policy.ttl.as_secs_f64())
        .fetch_one(pool)
        .await?;
        if attempt.claimed.is_some() {
            return Ok(ClaimOutcome::Claimed(Claim {
                scope,
                key: key.clone(),
                lock_token: token,
                took_over: false,
            }));
        }

        let existing = match attempt.existing() {
            Some(row) => Some(row),
            None => read_row(pool, scope, key).await?,
        };
        let Some(row) = existing else {
            continue; // purged between the two statements: claim again
        };
        last_seen_until = row.locked_until;

        let same_request = row.fingerprint.as_slice() == fingerprint.as_bytes().as_slice();
        if !row.expired {
            if row.status == KeyStatus::Cancelled {
                return Ok(ClaimOutcome::Cancelled);
            }
            if !same_request {
                return Ok(ClaimOutcome::Mismatch);
            }
            match row.status {
                KeyStatus::Completed => {
                    let locked_until = row.locked_until;
                    // The table's CHECK makes a missing response unreachable;
                    // answer as in flight rather than execute a completed
                    // intent again.
                    return Ok(match row.response() {
                        Some(stored) => ClaimOutcome::Replay(stored),
                        None => ClaimOutcome::InFlight { locked_until },
                    });
                }
                KeyStatus::InProgress if row.lease_live => {
                    return Ok(ClaimOutcome::InFlight {
                        locked_until: row.locked_until,
                    });
                }
                KeyStatus::InProgress | KeyStatus::Failed | KeyStatus::Cancelled => {}
            }
        }

        if let Some(lock_token) =
            take_over(pool, policy, scope, key, method, path, fingerprint).await?
        {
            return Ok(ClaimOutcome::Claimed(Claim {
                scope,
                key: key.clone(),
                lock_token,
                took_over: true,
            }));
        }
        // Someone else took it over or completed it first: look again.
    }
    Ok(ClaimOutcome::InFlight {
        locked_until: last_seen_until,
    })
}

/// One conditional UPDATE, so two retries racing for an abandoned claim
/// cannot both win: the loser's WHERE no longer matches.
async fn take_over(
    pool: &PgPool,
    policy: Policy,
    scope: PrincipalId,
    key: &IdempotencyKey,
    method: &str,
    path: &str,
    fingerprint: &Fingerprint,
) -> Result<Option<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE idempotency_keys SET
             lock_token = $3,
             locked_until = now() + make_interval(secs => $4),
             status = 'IN_PROGRESS',
             updated_at = now(),
             request_method = $6,
             request_path = $7,
             fingerprint = $8,
             response_status = NULL,
             response_headers = NULL,
             response_body = NULL,
             transfer_id = NULL,
             created_at = CASE WHEN expires_at <= now() THEN now() ELSE created_at END,
             expires_at = CASE WHEN expires_at <= now() THEN now() + make_interval(secs => $5)
                               ELSE expires_at END
         WHERE principal_id = $1 AND idempotency_key = $2
           AND (expires_at <= now()
                OR (fingerprint = $8
                    AND (status = 'FAILED' OR (status = 'IN_PROGRESS' AND locked_until <= now()))))
         RETURNING lock_token",
    )
    .bind(scope)
    .bind(key.as_str())
    .bind(Uuid::new_v4())
    .bind(policy.lease.as_secs_f64())
    .bind(policy.ttl.as_secs_f64())
    .bind(method)
    .bind(path)
    .bind(fingerprint.as_bytes().as_slice())
    .fetch_optional(pool)
    .await
}

async fn read_row(
    pool: &PgPool,
    scope: PrincipalId,
    key: &IdempotencyKey,
) -> Result<Option<ExistingRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT fingerprint, status, locked_until,
                locked_until > now() AS lease_live,
                expires_at <= now() AS expired,
                response_status, response_headers, response_body,
                transfer_id, updated_at, expires_at
         FROM idempotency_keys
         WHERE principal_id = $1 AND idempotency_key = $2",
    )
    .bind(scope)
    .bind(key.as_str())
    .fetch_optional(pool)
    .await
}

/// The stored answer of a key that completed for this very request, if it
/// did: what a request that lost its claim to another one answers with.
pub async fn completed_answer(
    keys: &KeyPool,
    scope: PrincipalId,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
) -> Result<Option<StoredResponse>, sqlx::Error> {
    Ok(read_row(keys.pool(), scope, key)
        .await?
        .filter(|row| {
            row.status == KeyStatus::Completed
                && !row.expired
                && row.fingerprint.as_slice() == fingerprint.as_bytes()
        })
        .and_then(ExistingRow::response))
}

/// A key's record as a lookup reports it: never the stored answer's bytes,
/// only what a client may act on.
#[derive(Debug, Clone)]
pub struct KeyRecord {
    pub status: KeyStatus,
    pub lease_live: bool,
    pub locked_until: DateTime<Utc>,
    pub expired: bool,
    pub response_status: Option<i16>,
    pub transfer_id: Option<Uuid>,
    pub updated_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

/// The record of a key in a principal's scope, read without a side effect.
pub async fn record(
    pool: &PgPool,
    scope: PrincipalId,
    key: &IdempotencyKey,
) -> Result<Option<KeyRecord>, sqlx::Error> {
    Ok(read_row(pool, scope, key).await?.map(|row| KeyRecord {
        status: row.status,
        lease_live: row.lease_live,
        locked_until: row.locked_until,
        expired: row.expired,
        response_status: row.response_status,
        transfer_id: row.transfer_id,
        updated_at: row.updated_at,
        expires_at: row.expires_at,
    }))
}

/// What cancelling a key found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The key is a tombstone now (or already was).
    Cancelled {
        cancelled_at: DateTime<Utc>,
        expires_at: DateTime<Utc>,
    },
    /// A request holds the key: it may still complete.
    InFlight { locked_until: DateTime<Utc> },
    /// The key completed: its answer stands (a transfer is undone by a
    /// reversal, not by a cancellation).
    Completed { transfer_id: Option<Uuid> },
    /// The key has no record but moved money before its record was purged.
    TransferExists { transfer_id: Uuid },
}

/// A key's row as `cancel` reads it under its lock: status, lease live,
/// expired, lease end, transfer.
type LockedRecord = (KeyStatus, bool, bool, DateTime<Utc>, Option<Uuid>);

/// The fingerprint of a tombstone: no request hashes to 32 zero bytes.
const TOMBSTONE_FINGERPRINT: [u8; 32] = [0; 32];

/// Cancels an intent by its key, in one transaction on the main pool: the
/// tombstone must be durable before the caller is told the intent can no
/// longer execute. A key never seen (or whose record expired), a FAILED
/// one and an abandoned claim become a tombstone; a key in flight or
/// completed is left as it is. Racing an original's claim, exactly one
/// wins: the insert of the other conflicts, and it reads the winner's row.
pub async fn cancel(
    pool: &PgPool,
    policy: Policy,
    scope: PrincipalId,
    key: &IdempotencyKey,
    route: &str,
    transfer_of_key: Option<Uuid>,
) -> Result<CancelOutcome, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let row: Option<LockedRecord> = sqlx::query_as(
        "SELECT status, locked_until > now(), expires_at <= now(), locked_until, transfer_id
         FROM idempotency_keys WHERE principal_id = $1 AND idempotency_key = $2 FOR UPDATE",
    )
    .bind(scope)
    .bind(key.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    let outcome = match (row, transfer_of_key) {
        (Some((KeyStatus::Completed, _, false, _, transfer_id)), _) => {
            CancelOutcome::Completed { transfer_id }
        }
        (Some((KeyStatus::InProgress, true, false, locked_until, _)), _) => {
            CancelOutcome::InFlight { locked_until }
        }
        (_, Some(transfer_id)) => CancelOutcome::TransferExists { transfer_id },
        // Never seen, expired, FAILED, abandoned, or already a tombstone.
        _ => tombstone(&mut tx, policy, scope, key, route).await?,
    };
    tx.commit().await?;
    Ok(outcome)
}

/// Writes (or keeps) the tombstone of a key whose row, if any, is locked
/// by the caller's transaction. When a claim inserted the row meanwhile
/// (the key had none), the insert conflicts and the claim wins.
async fn tombstone(
    conn: &mut PgConnection,
    policy: Policy,
    scope: PrincipalId,
    key: &IdempotencyKey,
    route: &str,
) -> Result<CancelOutcome, sqlx::Error> {
    let written: Option<(DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
        "INSERT INTO idempotency_keys
             (principal_id, idempotency_key, request_method, request_path, fingerprint,
              status, lock_token, locked_until, expires_at)
         VALUES ($1, $2, 'POST', $3, $4, 'CANCELLED', $5, now(), now() + make_interval(secs => $6))
         ON CONFLICT (principal_id, idempotency_key) DO UPDATE SET
             status = 'CANCELLED',
             fingerprint = EXCLUDED.fingerprint,
             lock_token = EXCLUDED.lock_token,
             locked_until = now(),
             response_status = NULL, response_headers = NULL, response_body = NULL,
             transfer_id = NULL,
             updated_at = CASE WHEN idempotency_keys.status = 'CANCELLED'
                               AND idempotency_keys.expires_at > now()
                               THEN idempotency_keys.updated_at ELSE now() END,
             created_at = CASE WHEN idempotency_keys.expires_at <= now() THEN now()
                               ELSE idempotency_keys.created_at END,
             expires_at = CASE WHEN idempotency_keys.expires_at <= now() THEN EXCLUDED.expires_at
                               ELSE idempotency_keys.expires_at END
         WHERE idempotency_keys.status <> 'COMPLETED' OR idempotency_keys.expires_at <= now()
         RETURNING updated_at, expires_at",
    )
    .bind(scope)
    .bind(key.as_str())
    .bind(route)
    .bind(TOMBSTONE_FINGERPRINT.as_slice())
    .bind(Uuid::new_v4())
    .bind(policy.ttl.as_secs_f64())
    .fetch_optional(&mut *conn)
    .await?;
    if let Some((cancelled_at, expires_at)) = written {
        return Ok(CancelOutcome::Cancelled {
            cancelled_at,
            expires_at,
        });
    }
    // The key had no row when we looked; a claim inserted one since and its
    // posting completed it before our write: its answer stands.
    let transfer_id: Option<Uuid> = sqlx::query_scalar(
        "SELECT transfer_id FROM idempotency_keys
         WHERE principal_id = $1 AND idempotency_key = $2",
    )
    .bind(scope)
    .bind(key.as_str())
    .fetch_one(&mut *conn)
    .await?;
    Ok(CancelOutcome::Completed { transfer_id })
}

/// One claim's completion: the answer to store, the fingerprint it is
/// stored under (the request's own, or, for a late retry that found its key
/// already used, the fingerprint of the intent that used it), and the
/// transfer it created or found.
#[derive(Debug, Clone, Copy)]
pub struct Completing<'a> {
    pub claim: &'a Claim,
    pub fingerprint: &'a Fingerprint,
    pub response: &'a StoredResponse,
    pub transfer_id: Option<Uuid>,
}

/// Completes claims inside the caller's transaction in one statement, each
/// fenced by its own lock token: only a claim still IN_PROGRESS under the
/// token it was given completes. Returns the tokens that completed; a claim
/// missing from them was taken over, and the caller must roll back, so a
/// late original's money movement never commits.
#[tracing::instrument(skip_all, fields(claims = completions.len()))]
pub async fn complete_all(
    conn: &mut PgConnection,
    completions: &[Completing<'_>],
) -> Result<Vec<Uuid>, sqlx::Error> {
    let (mut scopes, mut keys, mut tokens, mut fingerprints) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut statuses, mut headers, mut bodies, mut transfers) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for c in completions {
        scopes.push(c.claim.scope);
        keys.push(c.claim.key.as_str());
        tokens.push(c.claim.lock_token);
        fingerprints.push(c.fingerprint.as_bytes().as_slice());
        statuses.push(c.response.status_code());
        headers.push(c.response.header_texts());
        bodies.push(c.response.body.as_ref());
        transfers.push(c.transfer_id);
    }
    sqlx::query_scalar(
        "UPDATE idempotency_keys k SET
             status = 'COMPLETED',
             fingerprint = c.fingerprint,
             response_status = c.status,
             response_headers = c.headers,
             response_body = c.body,
             transfer_id = c.transfer_id,
             updated_at = now()
         FROM unnest($1::uuid[], $2::text[], $3::uuid[], $4::bytea[], $5::int2[], $6::jsonb[],
                     $7::bytea[], $8::uuid[])
              AS c(principal_id, idempotency_key, lock_token, fingerprint, status, headers, body,
                   transfer_id)
         WHERE k.principal_id = c.principal_id AND k.idempotency_key = c.idempotency_key
           AND k.lock_token = c.lock_token AND k.status = 'IN_PROGRESS'
         RETURNING k.lock_token",
    )
    .bind(&scopes)
    .bind(&keys)
    .bind(&tokens)
    .bind(&fingerprints)
    .bind(&statuses)
    .bind(&headers)
    .bind(&bodies)
    .bind(&transfers)
    .fetch_all(conn)
    .await
}

/// Releases claims after a technical failure, in one statement, so a retry
/// with the same key executes again at once instead of waiting out the
/// lease. Fenced like completion: a taken-over claim is left to its new
/// owner. Runs on the key pool: it must not depend on the main pool, whose
/// failure is often why it is called. Returns how many were released.
#[tracing::instrument(skip_all, fields(claims = claims.len()))]
pub async fn mark_failed_all(keys: &KeyPool, claims: &[&Claim]) -> Result<u64, sqlx::Error> {
    if claims.is_empty() {
        return Ok(0);
    }
    let scopes: Vec<PrincipalId> = claims.iter().map(|c| c.scope).collect();
    let key_texts: Vec<&str> = claims.iter().map(|c| c.key.as_str()).collect();
    let tokens: Vec<Uuid> = claims.iter().map(|c| c.lock_token).collect();
    let result = sqlx::query(
        "UPDATE idempotency_keys k
         SET status = 'FAILED', locked_until = now(), updated_at = now()
         FROM unnest($1::uuid[], $2::text[], $3::uuid[]) AS c(principal_id, idempotency_key, lock_token)
         WHERE k.principal_id = c.principal_id AND k.idempotency_key = c.idempotency_key
           AND k.lock_token = c.lock_token AND k.status = 'IN_PROGRESS'",
    )
    .bind(&scopes)
    .bind(&key_texts)
    .bind(&tokens)
    .execute(keys.pool())
    .await?;
    Ok(result.rows_affected())
}

/// How many expired rows one purge statement deletes: small enough that a
/// batch holds its locks for milliseconds, large enough to keep up with a
/// busy day's keys in a few seconds.
pub const PURGE_BATCH_ROWS_MAX: i64 = 1_000;

/// Deletes expired records in batches of at most `batch_rows` until none are
/// left; returns how many it deleted.
#[tracing::instrument(skip(pool))]
pub async fn purge_expired(pool: &PgPool, batch_rows: i64) -> Result<u64, sqlx::Error> {
    let result = purge_batches(pool, batch_rows).await;
    crate::telemetry::purge(&result);
    result
}

async fn purge_batches(pool: &PgPool, batch_rows: i64) -> Result<u64, sqlx::Error> {
    let mut total = 0;
    loop {
        let deleted = sqlx::query(
            "DELETE FROM idempotency_keys
             WHERE (principal_id, idempotency_key) IN (
                 SELECT principal_id, idempotency_key FROM idempotency_keys
                 WHERE expires_at <= now()
                 ORDER BY expires_at
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED)",
        )
        .bind(batch_rows)
        .execute(pool)
        .await?
        .rows_affected();
        total += deleted;
        if deleted < batch_rows.max(1) as u64 {
            return Ok(total);
        }
    }
}
