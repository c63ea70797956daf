//! All SQL on `idempotency_keys`: the insert-first claim, the takeover of
//! abandoned or failed claims, the fenced completion, and the purge that
//! compacts records past their TTL and deletes them past their retention.

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
    /// How long a record keeps its full response, replayed byte for byte.
    /// Past it the purge may compact the record to its outcome.
    pub ttl: Duration,
    /// How long a claim is exclusively owned. A process that dies holding one
    /// blocks its key for at most this long; then a retry takes it over.
    pub lease: Duration,
    /// How long a key is remembered from its first use (at least `ttl`):
    /// until then no request with it executes twice. Past it the record may
    /// be deleted; `transfers`' permanent unique key still stops a second
    /// posting.
    pub retention: Duration,
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
    Replay(Answer),
    /// The key was used for a different request.
    Mismatch,
    /// Another request holds the key and its lease is live.
    InFlight { locked_until: DateTime<Utc> },
    /// The intent was cancelled by its key: nothing may execute under it.
    /// Carries the id of the request that cancelled it, which its refusal
    /// names.
    Cancelled { request_id: Option<String> },
}

/// A completed key's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The exact response, kept until the record's TTL.
    Stored(StoredResponse),
    /// Past it, the compact record's outcome to rebuild the response from.
    Remembered(Outcome),
}

/// What a compact record keeps of a completed key's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub status: StatusCode,
    /// The problem type's slug of a refusal.
    pub problem_type: Option<String>,
    /// The transfer the answer is about.
    pub transfer_id: Option<Uuid>,
    /// The id of the request a refusal answered, which its document names.
    pub request_id: Option<String>,
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
    forgotten: bool,
    response_status: Option<i16>,
    response_headers: Option<StoredHeaders>,
    response_body: Option<Vec<u8>>,
    problem_type: Option<String>,
    request_id: Option<String>,
    transfer_id: Option<Uuid>,
    updated_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    retain_until: DateTime<Utc>,
    compacted: bool,
}

impl ExistingRow {
    fn response(&self) -> Option<StoredResponse> {
        StoredResponse::from_record(
            self.response_status?,
            self.response_headers.clone()?,
            self.response_body.clone()?,
        )
    }

    /// The answer of a completed row: its stored bytes, or, once compacted,
    /// the outcome to rebuild them from.
    fn answer(&self) -> Option<Answer> {
        if let Some(stored) = self.response() {
            return Some(Answer::Stored(stored));
        }
        let status = StatusCode::from_u16(u16::try_from(self.response_status?).ok()?).ok()?;
        Some(Answer::Remembered(Outcome {
            status,
            problem_type: self.problem_type.clone(),
            transfer_id: self.transfer_id,
            request_id: self.request_id.clone(),
        }))
    }
}

/// The columns of [`ExistingRow`] (and of [`ClaimAttempt`] after its
/// `claimed`), spliced into the statements that read a key's row at
/// compile time (sqlx takes only static SQL).
macro_rules! key_row_columns {
    () => {
        "fingerprint, status, locked_until, locked_until > now() AS lease_live, \
         idempotency_key_forgotten(status, locked_until, expires_at, retain_until) AS forgotten, \
         response_status, response_headers, response_body, problem_type, request_id, transfer_id, \
         updated_at, expires_at, retain_until, compacted_at IS NOT NULL AS compacted"
    };
}

/// The claim statement's answer: our token when the insert won, otherwise
/// the colliding row as the statement's snapshot saw it (all NULL when the
/// row committed after the snapshot was taken).
#[derive(sqlx::FromRow)]
pub(crate) struct ClaimAttempt {
    pub(crate) claimed: Option<Uuid>,
    fingerprint: Option<Vec<u8>>,
    status: Option<KeyStatus>,
    locked_until: Option<DateTime<Utc>>,
    lease_live: Option<bool>,
    forgotten: Option<bool>,
    response_status: Option<i16>,
    response_headers: Option<StoredHeaders>,
    response_body: Option<Vec<u8>>,
    problem_type: Option<String>,
    request_id: Option<String>,
    transfer_id: Option<Uuid>,
    updated_at: Option<DateTime<Utc>>,
    expires_at: Option<DateTime<Utc>>,
    retain_until: Option<DateTime<Utc>>,
    compacted: Option<bool>,
}

impl ClaimAttempt {
    fn existing(self) -> Option<ExistingRow> {
        Some(ExistingRow {
            fingerprint: self.fingerprint?,
            status: self.status?,
            locked_until: self.locked_until?,
            lease_live: self.lease_live?,
            forgotten: self.forgotten?,
            response_status: self.response_status,
            response_headers: self.response_headers,
            response_body: self.response_body,
            problem_type: self.problem_type,
            request_id: self.request_id,
            transfer_id: self.transfer_id,
            updated_at: self.updated_at?,
            expires_at: self.expires_at?,
            retain_until: self.retain_until?,
            compacted: self.compacted?,
        })
    }
}

/// One request's insert-first attempt: the row it would insert.
#[derive(Debug, Clone)]
pub(crate) struct ClaimInput {
    pub scope: PrincipalId,
    pub key: IdempotencyKey,
    pub method: String,
    pub path: String,
    pub fingerprint: Fingerprint,
    pub token: Uuid,
}

/// The claim statement for any number of requests at once, each with a
/// distinct (scope, key): the insert-first claims and, for each insert
/// that collided, a read of the row it collided with, in one statement.
/// A replay or a conflict is answered in the same round trip as a claim.
/// The read uses the statement's snapshot, so it misses a row committed
/// while the insert waited on it; only then is the row read again on its
/// own. A key whose row the snapshot already holds is not inserted at all:
/// inserting would wait for any transaction holding that row (a ledger
/// transaction completing it), and the whole statement, with the other
/// requests' claims, would wait with it. So a statement waits only for
/// claim statements inserting the same new keys, which take milliseconds.
/// Rows are inserted in (scope, key) order, so two of these statements
/// that wait on each other's keys wait in the same order and cannot
/// deadlock. The answers come back in `inputs`' order.
pub(crate) async fn insert_first(
    pool: &PgPool,
    policy: Policy,
    inputs: &[ClaimInput],
) -> Result<Vec<ClaimAttempt>, sqlx::Error> {
    let scopes: Vec<Uuid> = inputs.iter().map(|i| i.scope.0).collect();
    let keys: Vec<&str> = inputs.iter().map(|i| i.key.as_str()).collect();
    let methods: Vec<&str> = inputs.iter().map(|i| i.method.as_str()).collect();
    let paths: Vec<&str> = inputs.iter().map(|i| i.path.as_str()).collect();
    let fingerprints: Vec<&[u8]> = inputs
        .iter()
        .map(|i| i.fingerprint.as_bytes().as_slice())
        .collect();
    let tokens: Vec<Uuid> = inputs.iter().map(|i| i.token).collect();
    let attempts: Vec<ClaimAttempt> = sqlx::query_as(concat!(
        "WITH input AS MATERIALIZED (
             SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::bytea[],
                                  $6::uuid[])
                 WITH ORDINALITY AS i(principal_id, idempotency_key, request_method, request_path,
                                      fingerprint, lock_token, n)
         ), claimed AS (
             INSERT INTO idempotency_keys
                 (principal_id, idempotency_key, request_method, request_path, fingerprint,
                  status, lock_token, locked_until, expires_at, retain_until)
             SELECT principal_id, idempotency_key, request_method, request_path, fingerprint,
                    'IN_PROGRESS', lock_token, now() + make_interval(secs => $7),
                    now() + make_interval(secs => $8), now() + make_interval(secs => $9)
             FROM input i
             WHERE NOT EXISTS (SELECT 1 FROM idempotency_keys k
                               WHERE k.principal_id = i.principal_id
                                 AND k.idempotency_key = i.idempotency_key)
             ORDER BY principal_id, idempotency_key
             ON CONFLICT (principal_id, idempotency_key) DO NOTHING
             RETURNING lock_token
         )
         SELECT c.lock_token AS claimed, k.*
         FROM input i
         LEFT JOIN claimed c ON c.lock_token = i.lock_token
         LEFT JOIN LATERAL (
             SELECT ",
        key_row_columns!(),
        "
             FROM idempotency_keys
             WHERE principal_id = i.principal_id AND idempotency_key = i.idempotency_key
         ) AS k ON c.lock_token IS NULL
         ORDER BY i.n"
    ))
    .bind(&scopes)
    .bind(&keys)
    .bind(&methods)
    .bind(&paths)
    .bind(&fingerprints)
    .bind(&tokens)
    .bind(policy.lease.as_secs_f64())
    .bind(policy.ttl.as_secs_f64())
    .bind(policy.retention.as_secs_f64())
    .fetch_all(pool)
    .await?;
    crate::telemetry::claim_statement(inputs.len());
    if attempts.len() != inputs.len() {
        return Err(sqlx::Error::Protocol(format!(
            "the claim statement answered {} rows for {} claims",
            attempts.len(),
            inputs.len()
        )));
    }
    Ok(attempts)
}

/// [`insert_first`] for one request.
pub(crate) async fn insert_one(
    pool: &PgPool,
    policy: Policy,
    input: ClaimInput,
) -> Result<ClaimAttempt, sqlx::Error> {
    insert_first(pool, policy, std::slice::from_ref(&input))
        .await?
        .pop()
        .ok_or_else(|| sqlx::Error::Protocol("the claim statement answered no row".to_owned()))
}

/// Claims `key` with a statement of its own.
pub async fn claim(
    keys: &KeyPool,
    policy: Policy,
    scope: PrincipalId,
    key: &IdempotencyKey,
    method: &str,
    path: &str,
    fingerprint: &Fingerprint,
) -> Result<ClaimOutcome, sqlx::Error> {
    claim_with(
        keys,
        policy,
        scope,
        key,
        method,
        path,
        fingerprint,
        |input| async move {
            let mut attempts =
                insert_first(keys.pool(), policy, std::slice::from_ref(&input)).await?;
            attempts.pop().ok_or_else(|| {
                sqlx::Error::Protocol("the claim statement answered no row".to_owned())
            })
        },
    )
    .await
}

/// The claim: the insert-first attempt (`attempt`, alone or batched with
/// others), then whatever the key's row calls for (a replay, 422, 409, a
/// takeover), with the row re-read as often as it changes under us.
#[allow(clippy::too_many_arguments)]
#[tracing::instrument(skip_all, fields(key = %key))]
pub(crate) async fn claim_with<F, Fut>(
    keys: &KeyPool,
    policy: Policy,
    scope: PrincipalId,
    key: &IdempotencyKey,
    method: &str,
    path: &str,
    fingerprint: &Fingerprint,
    attempt: F,
) -> Result<ClaimOutcome, sqlx::Error>
where
    F: Fn(ClaimInput) -> Fut,
    Fut: std::future::Future<Output = Result<ClaimAttempt, sqlx::Error>>,
{
    let pool = keys.pool();
    let mut last_seen_until = Utc::now();
    for _ in 0..CLAIM_PASSES_MAX {
        let token = Uuid::new_v4();
        let attempt = attempt(ClaimInput {
            scope,
            key: key.clone(),
            method: method.to_owned(),
            path: path.to_owned(),
            fingerprint: *fingerprint,
            token,
        })
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
        if !row.forgotten {
            if row.status == KeyStatus::Cancelled {
                return Ok(ClaimOutcome::Cancelled {
                    request_id: row.request_id,
                });
            }
            if !same_request {
                return Ok(ClaimOutcome::Mismatch);
            }
            match row.status {
                KeyStatus::Completed => {
                    // The table's CHECKs make a completed row without an
                    // outcome unreachable; answer as in flight rather than
                    // execute a completed intent again.
                    return Ok(row.answer().map(ClaimOutcome::Replay).unwrap_or(
                        ClaimOutcome::InFlight {
                            locked_until: row.locked_until,
                        },
                    ));
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
             problem_type = NULL,
             request_id = NULL,
             transfer_id = NULL,
             compacted_at = NULL,
             -- A forgotten record starts a new life; a failed or abandoned
             -- one keeps its horizons. The conditions read the row itself,
             -- never a snapshot of it: a racing takeover that committed
             -- first is seen when this one re-checks its WHERE.
             created_at = CASE WHEN idempotency_key_forgotten(status, locked_until, expires_at,
                                                              retain_until)
                               THEN now() ELSE created_at END,
             expires_at = CASE WHEN idempotency_key_forgotten(status, locked_until, expires_at,
                                                              retain_until)
                               THEN now() + make_interval(secs => $5)
                               ELSE GREATEST(expires_at, now() + make_interval(secs => $4)) END,
             -- A takeover near the end of the retention must not outlive
             -- it: the record would count as forgotten while in flight.
             retain_until = CASE WHEN idempotency_key_forgotten(status, locked_until, expires_at,
                                                                retain_until)
                                 THEN now() + make_interval(secs => $9)
                                 ELSE GREATEST(retain_until, now() + make_interval(secs => $4)) END
         WHERE principal_id = $1 AND idempotency_key = $2
           AND (idempotency_key_forgotten(status, locked_until, expires_at, retain_until)
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
    .bind(policy.retention.as_secs_f64())
    .fetch_optional(pool)
    .await
}

async fn read_row(
    pool: &PgPool,
    scope: PrincipalId,
    key: &IdempotencyKey,
) -> Result<Option<ExistingRow>, sqlx::Error> {
    sqlx::query_as(concat!(
        "SELECT ",
        key_row_columns!(),
        " FROM idempotency_keys WHERE principal_id = $1 AND idempotency_key = $2"
    ))
    .bind(scope)
    .bind(key.as_str())
    .fetch_optional(pool)
    .await
}

/// The answer of a key that completed for this very request, if it did:
/// what a request that lost its claim to another one answers with.
pub async fn completed_answer(
    keys: &KeyPool,
    scope: PrincipalId,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
) -> Result<Option<Answer>, sqlx::Error> {
    Ok(read_row(keys.pool(), scope, key)
        .await?
        .filter(|row| {
            row.status == KeyStatus::Completed
                && !row.forgotten
                && row.fingerprint.as_slice() == fingerprint.as_bytes()
        })
        .and_then(|row| row.answer()))
}

/// A key's record as a lookup reports it: never the stored answer's bytes,
/// only what a client may act on.
#[derive(Debug, Clone)]
pub struct KeyRecord {
    pub status: KeyStatus,
    pub lease_live: bool,
    pub locked_until: DateTime<Utc>,
    /// The record no longer binds its key (see `idempotency_key_forgotten`).
    pub forgotten: bool,
    /// Its response bytes are gone; its outcome stays.
    pub compacted: bool,
    pub response_status: Option<i16>,
    pub transfer_id: Option<Uuid>,
    pub updated_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub retain_until: DateTime<Utc>,
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
        forgotten: row.forgotten,
        compacted: row.compacted,
        response_status: row.response_status,
        transfer_id: row.transfer_id,
        updated_at: row.updated_at,
        expires_at: row.expires_at,
        retain_until: row.retain_until,
    }))
}

/// What cancelling a key found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The key is a tombstone now (or already was).
    Cancelled {
        cancelled_at: DateTime<Utc>,
        retain_until: DateTime<Utc>,
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
/// forgotten, lease end, transfer.
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
    request_id: Option<&str>,
) -> Result<CancelOutcome, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let row: Option<LockedRecord> = sqlx::query_as(
        "SELECT status, locked_until > now(),
                idempotency_key_forgotten(status, locked_until, expires_at, retain_until),
                locked_until, transfer_id
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
        // Never seen, forgotten, FAILED, abandoned, or already a tombstone.
        _ => tombstone(&mut tx, policy, scope, key, route, request_id).await?,
    };
    tx.commit().await?;
    Ok(outcome)
}

/// Writes (or keeps) the tombstone of a key whose row, if any, is locked
/// by the caller's transaction. When a claim inserted the row meanwhile
/// (the key had none when we looked), the insert conflicts and the
/// tombstone overwrites that claim: the cancel wins, and the claim is
/// fenced out (its completion no longer finds it IN_PROGRESS, so its
/// posting rolls back and nothing moves). Only a completion that committed
/// first stands: then the answer says the intent completed.
async fn tombstone(
    conn: &mut PgConnection,
    policy: Policy,
    scope: PrincipalId,
    key: &IdempotencyKey,
    route: &str,
    request_id: Option<&str>,
) -> Result<CancelOutcome, sqlx::Error> {
    let written: Option<(DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
        "INSERT INTO idempotency_keys AS k
             (principal_id, idempotency_key, request_method, request_path, fingerprint,
              status, lock_token, locked_until, expires_at, retain_until, request_id)
         VALUES ($1, $2, 'POST', $3, $4, 'CANCELLED', $5, now(), now() + make_interval(secs => $6),
                 now() + make_interval(secs => $7), $8)
         ON CONFLICT (principal_id, idempotency_key) DO UPDATE SET
             status = 'CANCELLED',
             fingerprint = EXCLUDED.fingerprint,
             lock_token = EXCLUDED.lock_token,
             locked_until = now(),
             response_status = NULL, response_headers = NULL, response_body = NULL,
             problem_type = NULL,
             transfer_id = NULL,
             -- A live tombstone keeps its time and the request that wrote
             -- it; a forgotten record starts a new life.
             updated_at = CASE WHEN k.status = 'CANCELLED'
                                    AND NOT idempotency_key_forgotten(k.status, k.locked_until,
                                                                      k.expires_at, k.retain_until)
                               THEN k.updated_at ELSE now() END,
             request_id = CASE WHEN k.status = 'CANCELLED'
                                    AND NOT idempotency_key_forgotten(k.status, k.locked_until,
                                                                      k.expires_at, k.retain_until)
                               THEN k.request_id ELSE EXCLUDED.request_id END,
             compacted_at = CASE WHEN idempotency_key_forgotten(k.status, k.locked_until,
                                                                k.expires_at, k.retain_until)
                                 THEN NULL ELSE k.compacted_at END,
             created_at = CASE WHEN idempotency_key_forgotten(k.status, k.locked_until,
                                                              k.expires_at, k.retain_until)
                               THEN now() ELSE k.created_at END,
             expires_at = CASE WHEN idempotency_key_forgotten(k.status, k.locked_until,
                                                              k.expires_at, k.retain_until)
                               THEN EXCLUDED.expires_at ELSE k.expires_at END,
             retain_until = CASE WHEN idempotency_key_forgotten(k.status, k.locked_until,
                                                                k.expires_at, k.retain_until)
                                 THEN EXCLUDED.retain_until ELSE k.retain_until END
         WHERE k.status <> 'COMPLETED'
            OR idempotency_key_forgotten(k.status, k.locked_until, k.expires_at, k.retain_until)
         RETURNING updated_at, retain_until",
    )
    .bind(scope)
    .bind(key.as_str())
    .bind(route)
    .bind(TOMBSTONE_FINGERPRINT.as_slice())
    .bind(Uuid::new_v4())
    .bind(policy.ttl.as_secs_f64())
    .bind(policy.retention.as_secs_f64())
    .bind(request_id)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some((cancelled_at, retain_until)) = written {
        return Ok(CancelOutcome::Cancelled {
            cancelled_at,
            retain_until,
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
    /// The slug of a refusal's problem type, kept past compaction.
    pub problem_type: Option<&'a str>,
    /// The id of the request a refusal answered, kept past compaction.
    pub request_id: Option<&'a str>,
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
    let (mut problem_types, mut request_ids) = (Vec::new(), Vec::new());
    for c in completions {
        scopes.push(c.claim.scope);
        keys.push(c.claim.key.as_str());
        tokens.push(c.claim.lock_token);
        fingerprints.push(c.fingerprint.as_bytes().as_slice());
        statuses.push(c.response.status_code());
        headers.push(c.response.header_texts());
        bodies.push(c.response.body.as_ref());
        transfers.push(c.transfer_id);
        problem_types.push(c.problem_type);
        request_ids.push(c.request_id);
    }
    sqlx::query_scalar(
        "UPDATE idempotency_keys k SET
             status = 'COMPLETED',
             fingerprint = c.fingerprint,
             response_status = c.status,
             response_headers = c.headers,
             response_body = c.body,
             transfer_id = c.transfer_id,
             problem_type = c.problem_type,
             request_id = c.request_id,
             updated_at = now()
         FROM unnest($1::uuid[], $2::text[], $3::uuid[], $4::bytea[], $5::int2[], $6::jsonb[],
                     $7::bytea[], $8::uuid[], $9::text[], $10::text[])
              AS c(principal_id, idempotency_key, lock_token, fingerprint, status, headers, body,
                   transfer_id, problem_type, request_id)
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
    .bind(&problem_types)
    .bind(&request_ids)
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

/// How many records one purge statement compacts or deletes: small enough
/// that a batch holds its locks for milliseconds, large enough to keep up
/// with a busy day's keys in a few seconds.
pub const PURGE_BATCH_ROWS_MAX: i64 = 1_000;

/// What one purge did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    /// Records past their TTL reduced to their outcome.
    pub compacted: u64,
    /// Records deleted: past their retention, or past their TTL without an
    /// outcome (failed or abandoned claims).
    pub deleted: u64,
}

/// Compacts records past their TTL and deletes records no longer worth
/// keeping, in batches of at most `batch_rows`, until none are left.
#[tracing::instrument(skip(pool))]
pub async fn purge_expired(pool: &PgPool, batch_rows: i64) -> Result<Purged, sqlx::Error> {
    let result = purge_batches(pool, batch_rows).await;
    crate::telemetry::purge(&result);
    result
}

async fn purge_batches(pool: &PgPool, batch_rows: i64) -> Result<Purged, sqlx::Error> {
    let batch_rows = batch_rows.max(1);
    let mut purged = Purged::default();
    // Pass 1: records past their TTL. Each is compacted when it holds an
    // outcome still retained, deleted otherwise. A claim in flight is left
    // to finish.
    loop {
        let (seen, compacted, deleted): (i64, i64, i64) = sqlx::query_as(
            "WITH due AS (
                 SELECT principal_id, idempotency_key,
                        idempotency_key_forgotten(status, locked_until, expires_at, retain_until)
                            AS forgotten
                 FROM idempotency_keys
                 WHERE compacted_at IS NULL AND expires_at <= now()
                   AND NOT (status = 'IN_PROGRESS' AND locked_until > now())
                   -- Compacted only when its answer can be rebuilt to the
                   -- same bytes: a refusal stored by a version before
                   -- migration 0004 lacks its problem type or request id,
                   -- and is kept whole until its retention ends instead.
                   AND (idempotency_key_forgotten(status, locked_until, expires_at, retain_until)
                        OR status = 'CANCELLED'
                        OR (status = 'COMPLETED'
                            AND CASE WHEN response_status < 400
                                     -- A success is rebuilt from its transfer: only an
                                     -- immediate transfer's 201 renders from the
                                     -- transfer alone. Answers about holds keep their
                                     -- bytes until their retention ends.
                                     THEN transfer_id IS NOT NULL AND request_path = '/transfers'
                                          AND NOT EXISTS (SELECT 1 FROM holds h
                                                          WHERE h.id = idempotency_keys.transfer_id)
                                     -- A batch's refusal names its leg: not rebuilt.
                                     ELSE problem_type IS NOT NULL AND request_id IS NOT NULL
                                          AND request_path <> '/transfer-batches' END))
                 ORDER BY expires_at
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED
             ), deleted AS (
                 DELETE FROM idempotency_keys k USING due
                 WHERE k.principal_id = due.principal_id AND k.idempotency_key = due.idempotency_key
                   AND due.forgotten
                 RETURNING 1
             ), compacted AS (
                 UPDATE idempotency_keys k
                 SET compacted_at = now(), response_headers = NULL, response_body = NULL
                 FROM due
                 WHERE k.principal_id = due.principal_id AND k.idempotency_key = due.idempotency_key
                   AND NOT due.forgotten
                 RETURNING 1
             )
             SELECT (SELECT count(*) FROM due), (SELECT count(*) FROM compacted),
                    (SELECT count(*) FROM deleted)",
        )
        .bind(batch_rows)
        .fetch_one(pool)
        .await?;
        purged.compacted += u64::try_from(compacted).unwrap_or(0);
        purged.deleted += u64::try_from(deleted).unwrap_or(0);
        if seen < batch_rows {
            break;
        }
    }
    // Pass 2: compact records past their retention.
    loop {
        let deleted = sqlx::query(
            "DELETE FROM idempotency_keys
             WHERE (principal_id, idempotency_key) IN (
                 SELECT principal_id, idempotency_key FROM idempotency_keys
                 WHERE compacted_at IS NOT NULL AND retain_until <= now()
                 ORDER BY retain_until
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED)",
        )
        .bind(batch_rows)
        .execute(pool)
        .await?
        .rows_affected();
        purged.deleted += deleted;
        if deleted < batch_rows as u64 {
            return Ok(purged);
        }
    }
}
