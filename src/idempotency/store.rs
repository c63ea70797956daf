//! All SQL on `idempotency_keys`: the insert-first claim, the takeover of
//! abandoned or failed claims, the fenced completion, and the purge.

use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use super::{Fingerprint, IdempotencyKey};

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

/// The idempotency scope: the authenticated principal's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scope(pub Uuid);

/// Proof of owning a key: completing it requires the same `lock_token`.
#[derive(Debug, Clone)]
pub struct Claim {
    pub scope: Scope,
    pub key: IdempotencyKey,
    pub lock_token: Uuid,
    /// The claim replaced an abandoned, failed or expired one.
    pub took_over: bool,
}

/// A response as it is stored and replayed: status, the headers that must
/// replay, and the exact body bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
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
}

/// A claim row can vanish (purged) or change hands between our statements;
/// each pass re-reads it. Three passes are plenty: the row only changes
/// through a completed request, a purge or a takeover, and each of those
/// settles the next pass.
const CLAIM_PASSES_MAX: usize = 3;

#[derive(sqlx::FromRow)]
struct ExistingRow {
    fingerprint: Vec<u8>,
    status: String,
    locked_until: DateTime<Utc>,
    lease_live: bool,
    expired: bool,
    response_status: Option<i16>,
    response_headers: Option<sqlx::types::Json<Vec<(String, String)>>>,
    response_body: Option<Vec<u8>>,
}

/// The claim statement's answer: our token when the insert won, otherwise
/// the colliding row as the statement's snapshot saw it (all NULL when the
/// row committed after the snapshot was taken).
#[derive(sqlx::FromRow)]
struct ClaimAttempt {
    claimed: Option<Uuid>,
    fingerprint: Option<Vec<u8>>,
    status: Option<String>,
    locked_until: Option<DateTime<Utc>>,
    lease_live: Option<bool>,
    expired: Option<bool>,
    response_status: Option<i16>,
    response_headers: Option<sqlx::types::Json<Vec<(String, String)>>>,
    response_body: Option<Vec<u8>>,
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
        })
    }
}

#[tracing::instrument(skip_all, fields(key = %key))]
pub async fn claim(
    pool: &PgPool,
    policy: Policy,
    scope: Scope,
    key: &IdempotencyKey,
    method: &str,
    path: &str,
    fingerprint: &Fingerprint,
) -> Result<ClaimOutcome, sqlx::Error> {
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
                        response_status, response_headers, response_body
                 FROM idempotency_keys
                 WHERE principal_id = $1 AND idempotency_key = $2
             ) AS k ON true",
        )
        .bind(scope.0)
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
            None => {
                sqlx::query_as(
                    "SELECT fingerprint, status, locked_until,
                            locked_until > now() AS lease_live,
                            expires_at <= now() AS expired,
                            response_status, response_headers, response_body
                     FROM idempotency_keys
                     WHERE principal_id = $1 AND idempotency_key = $2",
                )
                .bind(scope.0)
                .bind(key.as_str())
                .fetch_optional(pool)
                .await?
            }
        };
        let Some(row) = existing else {
            continue; // purged between the two statements: claim again
        };
        last_seen_until = row.locked_until;

        let same_request = row.fingerprint.as_slice() == fingerprint.as_bytes().as_slice();
        if !row.expired {
            if !same_request {
                return Ok(ClaimOutcome::Mismatch);
            }
            match row.status.as_str() {
                "COMPLETED" => {
                    if let (Some(status), Some(headers), Some(body)) =
                        (row.response_status, row.response_headers, row.response_body)
                    {
                        return Ok(ClaimOutcome::Replay(StoredResponse {
                            status: u16::try_from(status).unwrap_or(500),
                            headers: headers.0,
                            body: Bytes::from(body),
                        }));
                    }
                    // The table's CHECK makes this unreachable; answer as in flight
                    // rather than execute a completed intent again.
                    return Ok(ClaimOutcome::InFlight {
                        locked_until: row.locked_until,
                    });
                }
                "IN_PROGRESS" if row.lease_live => {
                    return Ok(ClaimOutcome::InFlight {
                        locked_until: row.locked_until,
                    });
                }
                _ => {}
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
    scope: Scope,
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
    .bind(scope.0)
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

/// Completes the claim inside the caller's transaction, fenced by the lock
/// token. Returns false when the claim was taken over: the caller must roll
/// back, so the late original's money movement never commits.
#[tracing::instrument(skip_all, fields(key = %claim.key, status = response.status))]
pub async fn complete(
    conn: &mut PgConnection,
    claim: &Claim,
    response: &StoredResponse,
    transfer_id: Option<Uuid>,
) -> Result<bool, sqlx::Error> {
    let result = sqlx::query(
        "UPDATE idempotency_keys SET
             status = 'COMPLETED',
             response_status = $4,
             response_headers = $5,
             response_body = $6,
             transfer_id = $7,
             updated_at = now()
         WHERE principal_id = $1 AND idempotency_key = $2
           AND lock_token = $3 AND status = 'IN_PROGRESS'",
    )
    .bind(claim.scope.0)
    .bind(claim.key.as_str())
    .bind(claim.lock_token)
    .bind(i16::try_from(response.status).unwrap_or(500))
    .bind(sqlx::types::Json(&response.headers))
    .bind(response.body.as_ref())
    .bind(transfer_id)
    .execute(conn)
    .await?;
    Ok(result.rows_affected() == 1)
}

/// Completes several claims inside the caller's transaction in one
/// statement, each fenced by its own lock token as in [`complete`]. Returns
/// how many were completed: fewer than given means at least one was taken
/// over, and the caller must roll back everything.
#[tracing::instrument(skip_all, fields(claims = completions.len()))]
pub async fn complete_all(
    conn: &mut PgConnection,
    completions: &[(&Claim, &StoredResponse, Option<Uuid>)],
) -> Result<usize, sqlx::Error> {
    let (mut scopes, mut keys, mut tokens) = (Vec::new(), Vec::new(), Vec::new());
    let (mut statuses, mut headers, mut bodies, mut transfers) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (claim, response, transfer_id) in completions {
        scopes.push(claim.scope.0);
        keys.push(claim.key.as_str());
        tokens.push(claim.lock_token);
        statuses.push(i16::try_from(response.status).unwrap_or(500));
        headers.push(sqlx::types::Json(&response.headers));
        bodies.push(response.body.as_ref());
        transfers.push(*transfer_id);
    }
    let result = sqlx::query(
        "UPDATE idempotency_keys k SET
             status = 'COMPLETED',
             response_status = c.status,
             response_headers = c.headers,
             response_body = c.body,
             transfer_id = c.transfer_id,
             updated_at = now()
         FROM unnest($1::uuid[], $2::text[], $3::uuid[], $4::int2[], $5::jsonb[], $6::bytea[], $7::uuid[])
              AS c(principal_id, idempotency_key, lock_token, status, headers, body, transfer_id)
         WHERE k.principal_id = c.principal_id AND k.idempotency_key = c.idempotency_key
           AND k.lock_token = c.lock_token AND k.status = 'IN_PROGRESS'",
    )
    .bind(&scopes)
    .bind(&keys)
    .bind(&tokens)
    .bind(&statuses)
    .bind(&headers)
    .bind(&bodies)
    .bind(&transfers)
    .execute(conn)
    .await?;
    Ok(usize::try_from(result.rows_affected()).unwrap_or(usize::MAX))
}

/// Releases a claim after a technical failure so a retry with the same key
/// executes again at once instead of waiting out the lease. Fenced like
/// completion: a taken-over claim is left to its new owner.
#[tracing::instrument(skip_all, fields(key = %claim.key))]
pub async fn mark_failed(pool: &PgPool, claim: &Claim) -> Result<bool, sqlx::Error> {
    let result = sqlx::query(
        "UPDATE idempotency_keys SET status = 'FAILED', locked_until = now(), updated_at = now()
         WHERE principal_id = $1 AND idempotency_key = $2
           AND lock_token = $3 AND status = 'IN_PROGRESS'",
    )
    .bind(claim.scope.0)
    .bind(claim.key.as_str())
    .bind(claim.lock_token)
    .execute(pool)
    .await?;
    Ok(result.rows_affected() == 1)
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
