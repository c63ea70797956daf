//! The webhook tables (migration 0009) as the API sees them: endpoints of
//! one principal, their attempts, and redelivery requests. The worker's
//! own statements (claims, attempts, outcomes) are in `worker`.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use super::{
    ENDPOINTS_MAX, PREVIOUS_SECRET_WINDOW, REDELIVER_RANGE_EVENTS_MAX, WebhookError, new_secret,
};
use crate::ledger::events::{self, Cursor, EventType};
use crate::principal::PrincipalId;
use crate::transfers::render::timestamp;

/// An endpoint without its secrets.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Endpoint {
    pub id: Uuid,
    pub url: String,
    pub event_types: Vec<String>,
    pub status: String,
    pub disabled_reason: Option<String>,
    pub disabled_at: Option<DateTime<Utc>>,
    pub consecutive_failures: i32,
    pub cursor_txid: i64,
    pub cursor_position: i64,
    pub next_attempt_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl Endpoint {
    pub fn cursor(&self) -> Cursor {
        Cursor {
            txid: self.cursor_txid,
            position: self.cursor_position,
        }
    }
}

/// One attempt to deliver one event.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Attempt {
    pub event_id: Uuid,
    pub attempt: i32,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub outcome: Option<String>,
    pub status_code: Option<i32>,
    pub error: Option<String>,
    pub duration_ms: Option<i64>,
}

/// An attempt as the API shows it.
#[derive(Serialize)]
pub struct AttemptView {
    pub event_id: Uuid,
    pub attempt: i32,
    pub started_at: String,
    pub finished_at: Option<String>,
    /// `delivered`, `http_error`, `timeout`, `connect_error`; null while in
    /// flight (or when the instance making it stopped).
    pub outcome: Option<String>,
    pub status_code: Option<i32>,
    pub error: Option<String>,
    pub duration_ms: Option<i64>,
}

/// An endpoint as the API shows it, and as a `webhook_endpoint.disabled`
/// event carries it.
#[derive(Serialize)]
pub struct EndpointView {
    pub id: Uuid,
    pub url: String,
    pub event_types: Vec<String>,
    pub status: String,
    pub disabled_reason: Option<String>,
    pub disabled_at: Option<String>,
    pub consecutive_failures: i32,
    /// The last event delivered (or given up on), as a feed cursor.
    pub cursor: String,
    pub next_attempt_at: String,
    pub created_at: String,
    /// Only in the answers that create or rotate it: never shown again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// Only on `GET /webhook-endpoints/{id}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_attempt: Option<Option<AttemptView>>,
}

pub fn attempt_view(a: Attempt) -> AttemptView {
    AttemptView {
        event_id: a.event_id,
        attempt: a.attempt,
        started_at: timestamp(a.started_at),
        finished_at: a.finished_at.map(timestamp),
        outcome: a.outcome,
        status_code: a.status_code,
        error: a.error,
        duration_ms: a.duration_ms,
    }
}

pub fn endpoint_view(e: Endpoint) -> EndpointView {
    EndpointView {
        cursor: e.cursor().encode(),
        id: e.id,
        url: e.url,
        event_types: e.event_types,
        status: e.status,
        disabled_reason: e.disabled_reason,
        disabled_at: e.disabled_at.map(timestamp),
        consecutive_failures: e.consecutive_failures,
        next_attempt_at: timestamp(e.next_attempt_at),
        created_at: timestamp(e.created_at),
        secret: None,
        last_attempt: None,
    }
}

/// The columns of [`Endpoint`], spliced into the statements at compile
/// time (sqlx takes only static SQL).
macro_rules! endpoint_columns {
    () => {
        "id, url, event_types, status, disabled_reason, disabled_at, consecutive_failures, \
         cursor_txid::text::int8 AS cursor_txid, cursor_position, next_attempt_at, created_at, \
         updated_at"
    };
}

/// Registers an endpoint and returns it with its secret, which is never
/// shown again. It receives the events of transactions that had not ended
/// when it was created, and everything after.
#[tracing::instrument(skip(pool))]
pub async fn create(
    pool: &PgPool,
    principal: PrincipalId,
    url: &str,
    event_types: &[String],
) -> Result<(Endpoint, String), WebhookError> {
    let mut tx = pool.begin().await?;
    // The principal's row serialises its registrations, so the count below
    // cannot be raced past the limit.
    sqlx::query("SELECT 1 FROM principals WHERE id = $1 FOR UPDATE")
        .bind(principal)
        .execute(&mut *tx)
        .await?;
    if let Some(existing) = sqlx::query_scalar::<_, Uuid>(
        "SELECT id FROM webhook_endpoints WHERE principal_id = $1 AND url = $2",
    )
    .bind(principal)
    .bind(url)
    .fetch_optional(&mut *tx)
    .await?
    {
        return Err(WebhookError::DuplicateUrl { existing });
    }
    let count: i64 =
        sqlx::query_scalar("SELECT count(*) FROM webhook_endpoints WHERE principal_id = $1")
            .bind(principal)
            .fetch_one(&mut *tx)
            .await?;
    if count >= ENDPOINTS_MAX {
        return Err(WebhookError::TooManyEndpoints);
    }
    let secret = new_secret();
    let endpoint = sqlx::query_as(concat!(
        "INSERT INTO webhook_endpoints (principal_id, url, secret, event_types, cursor_txid)
         VALUES ($1, $2, $3, $4, pg_snapshot_xmin(pg_current_snapshot()))
         RETURNING ",
        endpoint_columns!(),
        ""
    ))
    .bind(principal)
    .bind(url)
    .bind(&secret)
    .bind(event_types)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((endpoint, secret))
}

pub async fn list(pool: &PgPool, principal: PrincipalId) -> Result<Vec<Endpoint>, WebhookError> {
    Ok(sqlx::query_as(concat!(
        "SELECT ",
        endpoint_columns!(),
        " FROM webhook_endpoints WHERE principal_id = $1
         ORDER BY created_at, id"
    ))
    .bind(principal)
    .fetch_all(pool)
    .await?)
}

/// The endpoint and its latest attempt.
pub async fn get(
    pool: &PgPool,
    principal: PrincipalId,
    id: Uuid,
) -> Result<(Endpoint, Option<Attempt>), WebhookError> {
    let endpoint: Endpoint = sqlx::query_as(concat!(
        "SELECT ",
        endpoint_columns!(),
        " FROM webhook_endpoints WHERE principal_id = $1 AND id = $2"
    ))
    .bind(principal)
    .bind(id)
    .fetch_optional(pool)
    .await?
    .ok_or(WebhookError::NotFound)?;
    let last = attempts(pool, principal, id, 1).await?.into_iter().next();
    Ok((endpoint, last))
}

/// Writes the `webhook_endpoint.disabled` event of an endpoint the
/// caller's transaction has just disabled, carrying the endpoint as
/// `GET /webhook-endpoints/{id}` shows it: the owner's feed (and its other
/// endpoints) learn of it in the transaction that did it, or not at all.
pub async fn announce_disabled(
    tx: &mut sqlx::PgConnection,
    principal: PrincipalId,
    id: Uuid,
) -> Result<(), sqlx::Error> {
    let endpoint: Endpoint = sqlx::query_as(concat!(
        "SELECT ",
        endpoint_columns!(),
        " FROM webhook_endpoints WHERE principal_id = $1 AND id = $2"
    ))
    .bind(principal)
    .bind(id)
    .fetch_one(&mut *tx)
    .await?;
    let resource = serde_json::to_value(endpoint_view(endpoint))
        .map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    sqlx::query(
        "INSERT INTO events (type, resource_id, resource, from_principal)
         VALUES ($1, $2, $3, $4)",
    )
    .bind(EventType::WebhookEndpointDisabled.as_str())
    .bind(id)
    .bind(resource)
    .bind(principal)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

pub async fn delete(pool: &PgPool, principal: PrincipalId, id: Uuid) -> Result<(), WebhookError> {
    let deleted = sqlx::query("DELETE FROM webhook_endpoints WHERE principal_id = $1 AND id = $2")
        .bind(principal)
        .bind(id)
        .execute(pool)
        .await?
        .rows_affected();
    if deleted == 0 {
        return Err(WebhookError::NotFound);
    }
    Ok(())
}

/// A new secret, shown once; the old one keeps signing for
/// [`PREVIOUS_SECRET_WINDOW`].
pub async fn rotate_secret(
    pool: &PgPool,
    principal: PrincipalId,
    id: Uuid,
) -> Result<(Endpoint, String), WebhookError> {
    let secret = new_secret();
    let endpoint = sqlx::query_as(concat!(
        "UPDATE webhook_endpoints
         SET previous_secret = secret, secret = $3,
             previous_secret_until = now() + make_interval(secs => $4), updated_at = now()
         WHERE principal_id = $1 AND id = $2
         RETURNING ",
        endpoint_columns!(),
        ""
    ))
    .bind(principal)
    .bind(id)
    .bind(&secret)
    .bind(PREVIOUS_SECRET_WINDOW.as_secs_f64())
    .fetch_optional(pool)
    .await?
    .ok_or(WebhookError::NotFound)?;
    Ok((endpoint, secret))
}

/// Enables an endpoint again: delivery resumes from its cursor, at once.
pub async fn enable(
    pool: &PgPool,
    principal: PrincipalId,
    id: Uuid,
) -> Result<Endpoint, WebhookError> {
    sqlx::query_as(concat!(
        "UPDATE webhook_endpoints
         SET status = 'enabled', disabled_reason = NULL, disabled_at = NULL,
             consecutive_failures = 0, failing_since = NULL, next_attempt_at = now(),
             updated_at = now()
         WHERE principal_id = $1 AND id = $2
         RETURNING ",
        endpoint_columns!(),
        ""
    ))
    .bind(principal)
    .bind(id)
    .fetch_optional(pool)
    .await?
    .ok_or(WebhookError::NotFound)
}

/// Queues one event the principal may see, to be delivered before what
/// follows the cursor.
pub async fn redeliver_event(
    pool: &PgPool,
    principal: PrincipalId,
    id: Uuid,
    event_id: Uuid,
) -> Result<(), WebhookError> {
    let queued: Option<bool> = sqlx::query_scalar(
        "WITH endpoint AS (
             SELECT id FROM webhook_endpoints WHERE principal_id = $1 AND id = $2
         ), event AS (
             SELECT id FROM events WHERE id = $3 AND (from_principal = $1 OR to_principal = $1)
         ), queued AS (
             INSERT INTO webhook_redeliveries (endpoint_id, event_id)
             SELECT endpoint.id, event.id FROM endpoint, event
             ON CONFLICT DO NOTHING
         ), due AS (
             UPDATE webhook_endpoints SET next_attempt_at = now(), updated_at = now()
             WHERE id = (SELECT id FROM endpoint) AND EXISTS (SELECT 1 FROM event)
         )
         SELECT EXISTS (SELECT 1 FROM event) FROM endpoint",
    )
    .bind(principal)
    .bind(id)
    .bind(event_id)
    .fetch_optional(pool)
    .await?;
    match queued {
        None => Err(WebhookError::NotFound),
        Some(false) => Err(WebhookError::InvalidRedelivery(
            "event_id: no event with this id that you may see (it may have been purged)".to_owned(),
        )),
        Some(true) => Ok(()),
    }
}

/// Moves the endpoint's cursor back to `after`, so every event the
/// principal may see after it is delivered again, at most
/// [`REDELIVER_RANGE_EVENTS_MAX`]. A cursor at or past the endpoint's
/// changes nothing.
pub async fn redeliver_after(
    pool: &PgPool,
    principal: PrincipalId,
    id: Uuid,
    after: Cursor,
) -> Result<(), WebhookError> {
    let mut tx = pool.begin().await?;
    let endpoint: Endpoint = sqlx::query_as(concat!(
        "SELECT ",
        endpoint_columns!(),
        " FROM webhook_endpoints WHERE principal_id = $1 AND id = $2
         FOR UPDATE"
    ))
    .bind(principal)
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or(WebhookError::NotFound)?;
    if after >= endpoint.cursor() {
        return Ok(());
    }
    let range = events::page(&mut *tx, principal, after, REDELIVER_RANGE_EVENTS_MAX + 1).await?;
    let behind = range
        .iter()
        .take_while(|e| e.cursor() <= endpoint.cursor())
        .count();
    if i64::try_from(behind).unwrap_or(i64::MAX) > REDELIVER_RANGE_EVENTS_MAX {
        return Err(WebhookError::InvalidRedelivery(format!(
            "after: the range holds more than {REDELIVER_RANGE_EVENTS_MAX} events; redeliver a later cursor"
        )));
    }
    sqlx::query(
        "UPDATE webhook_endpoints
         SET cursor_txid = $2::int8::text::xid8, cursor_position = $3, next_attempt_at = now(),
             updated_at = now()
         WHERE id = $1",
    )
    .bind(id)
    .bind(after.txid)
    .bind(after.position)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// The endpoint's attempts, newest first, at most `limit`.
pub async fn attempts(
    pool: &PgPool,
    principal: PrincipalId,
    id: Uuid,
    limit: i64,
) -> Result<Vec<Attempt>, WebhookError> {
    let exists: Option<Uuid> =
        sqlx::query_scalar("SELECT id FROM webhook_endpoints WHERE principal_id = $1 AND id = $2")
            .bind(principal)
            .bind(id)
            .fetch_optional(pool)
            .await?;
    if exists.is_none() {
        return Err(WebhookError::NotFound);
    }
    Ok(sqlx::query_as(
        "SELECT event_id, attempt, started_at, finished_at, outcome, status_code, error, duration_ms
         FROM webhook_attempts WHERE endpoint_id = $1
         ORDER BY started_at DESC, attempt DESC LIMIT $2",
    )
    .bind(id)
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// The oldest transaction whose events an enabled endpoint may not have
/// passed yet: every event after an endpoint's cursor belongs to its
/// cursor's transaction or a later one. `None` when no endpoint is enabled.
/// The purge keeps those events, so a failing endpoint loses nothing to
/// the retention until it is disabled.
pub async fn oldest_pending_txid(pool: &PgPool) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT min(cursor_txid::text::int8) FROM webhook_endpoints WHERE status = 'enabled'",
    )
    .fetch_one(pool)
    .await
}

/// Deletes attempts started longer than `retention` ago (the events'
/// retention: an attempt outlives its event by no more), oldest first, in
/// statements of at most `batch_rows`. Returns how many.
pub async fn purge_attempts(
    pool: &PgPool,
    retention: std::time::Duration,
    batch_rows: i64,
) -> Result<u64, sqlx::Error> {
    let batch_rows = batch_rows.max(1);
    let mut deleted = 0u64;
    loop {
        let gone = sqlx::query(
            "WITH old AS (
                 SELECT endpoint_id, event_id, attempt FROM webhook_attempts
                 WHERE started_at < now() - make_interval(secs => $1)
                 ORDER BY started_at LIMIT $2
             )
             DELETE FROM webhook_attempts a USING old
             WHERE (a.endpoint_id, a.event_id, a.attempt) = (old.endpoint_id, old.event_id, old.attempt)",
        )
        .bind(retention.as_secs_f64())
        .bind(batch_rows)
        .execute(pool)
        .await?
        .rows_affected();
        deleted += gone;
        if gone < u64::try_from(batch_rows).unwrap_or(u64::MAX) {
            return Ok(deleted);
        }
    }
}
