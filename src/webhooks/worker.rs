//! The delivery worker: every [`Settings::interval`] it claims the enabled
//! endpoints that are due (`FOR UPDATE SKIP LOCKED` and a lease, so one
//! worker of all instances serves an endpoint at a time), and for each, in
//! a task of its own, delivers the events after its cursor one at a time,
//! in the feed's order, redeliveries first. Each attempt is claimed by
//! inserting its row first (the primary key lets one instance make attempt
//! n), and its outcome is written fenced by the lease token. ADR-012.

use std::future::Future;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use http::header::{CONTENT_TYPE, HeaderMap, HeaderValue};
use sqlx::PgPool;
use tokio::task::JoinSet;
use uuid::Uuid;

use super::client::{Answer, DeliveryClient};
use crate::feed;
use crate::ledger::events::{self, Cursor, Event, EventType};
use crate::principal::PrincipalId;
use crate::telemetry;

/// The first retry's ceiling; each failure in a row doubles it, up to
/// [`Settings::backoff_max`].
pub const BACKOFF_BASE: Duration = Duration::from_secs(1);
/// A lease outlives the attempt it covers by this much: time to write the
/// outcome after the request's timeout.
pub const LEASE_MARGIN: Duration = Duration::from_secs(10);
/// Deliveries one claim makes before the endpoint goes back to the pool,
/// so a long backlog of one endpoint does not keep a slot from the others.
pub const DELIVERIES_PER_CLAIM_MAX: usize = 100;
/// Events read per page when looking for the next one to deliver (an
/// endpoint filtered by type may skip many).
pub const SCAN_PAGE: i64 = 100;
/// The longest error text kept with an attempt.
pub const ERROR_LEN_MAX: usize = 500;

/// `NEXO_WEBHOOK_*` (config::WebhookConfig).
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub interval: Duration,
    pub timeout: Duration,
    pub backoff_max: Duration,
    pub retry_window: Duration,
    pub concurrency: usize,
}

impl Settings {
    fn lease(&self) -> Duration {
        self.timeout + LEASE_MARGIN
    }
}

/// Runs until `stop` resolves; then claims nothing more, waits for the
/// deliveries in flight (each bounded by the timeout) and returns.
pub async fn run(
    pool: PgPool,
    settings: Settings,
    client: DeliveryClient,
    stop: impl Future<Output = ()>,
) {
    let mut stop = std::pin::pin!(stop);
    let mut ticks = tokio::time::interval(settings.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut running = JoinSet::new();
    loop {
        tokio::select! {
            () = &mut stop => break,
            _ = ticks.tick() => {}
        }
        while running.try_join_next().is_some() {}
        let slots = settings.concurrency.saturating_sub(running.len());
        if slots > 0 {
            match claim(&pool, settings, slots).await {
                Ok(claimed) => {
                    for endpoint in claimed {
                        running.spawn(serve(pool.clone(), client.clone(), settings, endpoint));
                    }
                }
                Err(e) => tracing::warn!(error = %e, "claiming webhook endpoints failed"),
            }
        }
        match oldest_undelivered(&pool).await {
            Ok(age) => telemetry::webhook_oldest_undelivered(age),
            Err(e) => tracing::warn!(error = %e, "reading the webhook backlog failed"),
        }
    }
    let drain = async { while running.join_next().await.is_some() {} };
    if tokio::time::timeout(settings.lease(), drain).await.is_err() {
        running.abort_all();
    }
}

/// An endpoint this worker holds the lease of.
#[derive(Debug, sqlx::FromRow)]
struct Claimed {
    id: Uuid,
    lease_token: Uuid,
    principal_id: PrincipalId,
    url: String,
    secret: String,
    previous_secret: Option<String>,
    event_types: Vec<String>,
    cursor_txid: i64,
    cursor_position: i64,
    consecutive_failures: i32,
}

async fn claim(
    pool: &PgPool,
    settings: Settings,
    slots: usize,
) -> Result<Vec<Claimed>, sqlx::Error> {
    sqlx::query_as(
        "UPDATE webhook_endpoints w
         SET lease_token = $1, leased_until = now() + make_interval(secs => $2)
         FROM (SELECT id FROM webhook_endpoints
               WHERE status = 'enabled' AND next_attempt_at <= now()
                 AND (leased_until IS NULL OR leased_until < now())
               ORDER BY next_attempt_at
               LIMIT $3
               FOR UPDATE SKIP LOCKED) due
         WHERE w.id = due.id
         RETURNING w.id, w.lease_token, w.principal_id, w.url, w.secret,
                   CASE WHEN w.previous_secret_until > now() THEN w.previous_secret END
                       AS previous_secret,
                   w.event_types, w.cursor_txid::text::int8 AS cursor_txid, w.cursor_position,
                   w.consecutive_failures",
    )
    .bind(Uuid::new_v4())
    .bind(settings.lease().as_secs_f64())
    .bind(i64::try_from(slots).unwrap_or(i64::MAX))
    .fetch_all(pool)
    .await
}

/// The age of the oldest event an enabled endpoint has not had yet, in
/// seconds (0 when none waits): one aggregate over the endpoints.
async fn oldest_undelivered(pool: &PgPool) -> Result<f64, sqlx::Error> {
    let age: Option<f64> = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM now() - min(undelivered_since))::float8
         FROM webhook_endpoints WHERE status = 'enabled'",
    )
    .fetch_one(pool)
    .await?;
    Ok(age.unwrap_or(0.0).max(0.0))
}

/// What one step of an endpoint's claim did.
enum Step {
    /// Delivered one event (or skipped a page of events it does not
    /// receive): go on.
    Progressed,
    /// Nothing left to deliver.
    Drained,
    /// A failure was recorded (the lease is released), or the lease was
    /// lost: stop.
    Stopped,
}

async fn serve(pool: PgPool, client: DeliveryClient, settings: Settings, mut endpoint: Claimed) {
    let mut drained = false;
    for _ in 0..DELIVERIES_PER_CLAIM_MAX {
        match step(&pool, &client, settings, &mut endpoint).await {
            Ok(Step::Progressed) => {}
            Ok(Step::Drained) => {
                drained = true;
                if let Err(e) = catch_up(&pool, &endpoint).await {
                    tracing::warn!(endpoint_id = %endpoint.id, error = %e, "moving a caught-up webhook cursor failed");
                }
                break;
            }
            Ok(Step::Stopped) => return,
            Err(e) => {
                tracing::warn!(endpoint_id = %endpoint.id, error = %e, "webhook delivery step failed");
                break;
            }
        }
    }
    let released = sqlx::query(
        "UPDATE webhook_endpoints
         SET lease_token = NULL, leased_until = NULL,
             undelivered_since = CASE WHEN $3 THEN NULL ELSE undelivered_since END
         WHERE id = $1 AND lease_token = $2",
    )
    .bind(endpoint.id)
    .bind(endpoint.lease_token)
    .bind(drained)
    .execute(&pool)
    .await;
    if let Err(e) = released {
        // The lease runs out by itself.
        tracing::warn!(endpoint_id = %endpoint.id, error = %e, "releasing a webhook lease failed");
    }
}

/// With nothing left to deliver, moves the cursor up to the feed's
/// horizon, so an endpoint whose principal is quiet does not hold the
/// purge back (`store::oldest_pending_txid`) at the cursor of its last
/// event. The horizon is read before the page: the page's own is the same
/// or later, so finding nothing after the cursor below it means there is
/// nothing below the horizon read first either.
async fn catch_up(pool: &PgPool, endpoint: &Claimed) -> Result<(), sqlx::Error> {
    let horizon: i64 =
        sqlx::query_scalar("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::int8")
            .fetch_one(pool)
            .await?;
    let cursor = Cursor {
        txid: endpoint.cursor_txid,
        position: endpoint.cursor_position,
    };
    if horizon <= cursor.txid
        || !events::page(pool, endpoint.principal_id, cursor, 1)
            .await?
            .is_empty()
    {
        return Ok(());
    }
    sqlx::query(
        "UPDATE webhook_endpoints SET cursor_txid = $5::int8::text::xid8, cursor_position = 0
         WHERE id = $1 AND lease_token = $2
           AND cursor_txid::text::int8 = $3 AND cursor_position = $4",
    )
    .bind(endpoint.id)
    .bind(endpoint.lease_token)
    .bind(cursor.txid)
    .bind(cursor.position)
    .bind(horizon)
    .execute(pool)
    .await?;
    Ok(())
}

/// The next event to deliver: a redelivery first, else the first event
/// after the cursor among those the principal may see, of a type the
/// endpoint receives.
enum Next {
    Redelivery(Event),
    AfterCursor(Event),
    /// A page of events the endpoint does not receive: the cursor moves
    /// past it.
    Skip(Cursor),
    Nothing,
}

async fn next(pool: &PgPool, endpoint: &Claimed) -> Result<Next, sqlx::Error> {
    let redelivery: Option<Event> = sqlx::query_as(
        "SELECT e.id, e.position, e.txid::text::int8 AS txid, e.type, e.resource_id, e.resource,
                e.occurred_at, e.from_account, e.to_account, e.from_principal, e.to_principal,
                e.from_seq, e.to_seq
         FROM webhook_redeliveries r JOIN events e ON e.id = r.event_id
         WHERE r.endpoint_id = $1
         ORDER BY r.requested_at, r.event_id LIMIT 1",
    )
    .bind(endpoint.id)
    .fetch_optional(pool)
    .await?;
    if let Some(event) = redelivery {
        return Ok(Next::Redelivery(event));
    }
    // Requests for events purged since are dropped: there is nothing left
    // to send.
    sqlx::query(
        "DELETE FROM webhook_redeliveries r WHERE r.endpoint_id = $1
         AND NOT EXISTS (SELECT 1 FROM events e WHERE e.id = r.event_id)",
    )
    .bind(endpoint.id)
    .execute(pool)
    .await?;
    let cursor = Cursor {
        txid: endpoint.cursor_txid,
        position: endpoint.cursor_position,
    };
    let page = events::page(pool, endpoint.principal_id, cursor, SCAN_PAGE).await?;
    let Some(last) = page.last().map(Event::cursor) else {
        return Ok(Next::Nothing);
    };
    let wanted =
        |e: &Event| endpoint.event_types.is_empty() || endpoint.event_types.contains(&e.event_type);
    Ok(match page.into_iter().find(wanted) {
        Some(event) => Next::AfterCursor(event),
        None => Next::Skip(last),
    })
}

async fn step(
    pool: &PgPool,
    client: &DeliveryClient,
    settings: Settings,
    endpoint: &mut Claimed,
) -> Result<Step, sqlx::Error> {
    let (event, redelivery) = match next(pool, endpoint).await? {
        Next::Nothing => return Ok(Step::Drained),
        Next::Skip(cursor) => {
            return Ok(if advance(pool, endpoint, cursor).await? {
                Step::Progressed
            } else {
                Step::Stopped
            });
        }
        Next::Redelivery(event) => (event, true),
        Next::AfterCursor(event) => (event, false),
    };
    let undelivered_since = (!redelivery).then_some(event.occurred_at);
    let Some((attempt, started_at)) =
        claim_attempt(pool, settings, endpoint, &event, undelivered_since).await?
    else {
        return Ok(Step::Stopped);
    };
    let began = Instant::now();
    let outcome = post(client, settings, endpoint, &event, attempt).await;
    let duration_ms = i64::try_from(began.elapsed().as_millis()).unwrap_or(i64::MAX);
    telemetry::webhook_attempt(outcome.label());
    record_attempt(pool, endpoint.id, event.id, attempt, &outcome, duration_ms).await?;
    if matches!(outcome, Outcome::Delivered(_)) {
        let kept = delivered(pool, endpoint, &event, redelivery).await?;
        return Ok(if kept {
            Step::Progressed
        } else {
            Step::Stopped
        });
    }
    failed(pool, settings, endpoint, &event, started_at, &outcome).await?;
    Ok(Step::Stopped)
}

/// Inserts attempt n (one more than the event's attempts so far) while the
/// lease holds, and extends the lease over it. `None`: the lease is gone,
/// or another instance made attempt n.
async fn claim_attempt(
    pool: &PgPool,
    settings: Settings,
    endpoint: &Claimed,
    event: &Event,
    undelivered_since: Option<DateTime<Utc>>,
) -> Result<Option<(i32, DateTime<Utc>)>, sqlx::Error> {
    sqlx::query_as(
        "WITH fence AS (
             UPDATE webhook_endpoints
             SET leased_until = now() + make_interval(secs => $3),
                 undelivered_since = COALESCE($4, undelivered_since)
             WHERE id = $1 AND lease_token = $2 AND status = 'enabled'
             RETURNING id
         )
         INSERT INTO webhook_attempts (endpoint_id, event_id, attempt)
         SELECT fence.id, $5,
                COALESCE((SELECT max(attempt) FROM webhook_attempts
                          WHERE endpoint_id = $1 AND event_id = $5), 0) + 1
         FROM fence
         ON CONFLICT DO NOTHING
         RETURNING attempt, started_at",
    )
    .bind(endpoint.id)
    .bind(endpoint.lease_token)
    .bind(settings.lease().as_secs_f64())
    .bind(undelivered_since)
    .bind(event.id)
    .fetch_optional(pool)
    .await
}

/// How one attempt ended.
enum Outcome {
    Delivered(u16),
    HttpError(u16),
    Timeout(String),
    ConnectError(String),
}

impl Outcome {
    fn label(&self) -> &'static str {
        match self {
            Self::Delivered(_) => "delivered",
            Self::HttpError(_) => "http_error",
            Self::Timeout(_) => "timeout",
            Self::ConnectError(_) => "connect_error",
        }
    }

    fn status_code(&self) -> Option<i32> {
        match self {
            Self::Delivered(code) | Self::HttpError(code) => Some(i32::from(*code)),
            _ => None,
        }
    }

    fn error(&self) -> Option<String> {
        match self {
            Self::Delivered(_) => None,
            Self::HttpError(code) => Some(format!("the endpoint answered {code}")),
            Self::Timeout(e) | Self::ConnectError(e) => {
                Some(e.chars().take(ERROR_LEN_MAX).collect())
            }
        }
    }
}

/// The event as `GET /events` shows it to the endpoint's principal,
/// signed with every live secret.
async fn post(
    client: &DeliveryClient,
    settings: Settings,
    endpoint: &Claimed,
    event: &Event,
    attempt: i32,
) -> Outcome {
    let body = match serde_json::to_vec(&feed::view(event, endpoint.principal_id)) {
        Ok(body) => body,
        Err(e) => return Outcome::ConnectError(format!("the event could not be rendered: {e}")),
    };
    let mut secrets: Vec<&[u8]> = vec![endpoint.secret.as_bytes()];
    if let Some(previous) = &endpoint.previous_secret {
        secrets.push(previous.as_bytes());
    }
    let signature = nexo_signature::sign(&secrets, Utc::now().timestamp(), &body);
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    for (name, value) in [
        (nexo_signature::HEADER, signature),
        ("nexo-event-id", event.id.to_string()),
        ("nexo-event-type", event.event_type.as_str().to_owned()),
        ("nexo-delivery-attempt", attempt.to_string()),
    ] {
        // Made of ASCII digits, hex, letters and punctuation: always valid.
        if let Ok(value) = HeaderValue::try_from(value) {
            headers.insert(name, value);
        }
    }
    match client
        .post(&endpoint.url, headers, body, settings.timeout)
        .await
    {
        Answer::Status(status) if (200..300).contains(&status) => Outcome::Delivered(status),
        Answer::Status(status) => Outcome::HttpError(status),
        Answer::Timeout => Outcome::Timeout(format!(
            "no answer within {} ms",
            settings.timeout.as_millis()
        )),
        Answer::Failed(why) => Outcome::ConnectError(why),
    }
}

async fn record_attempt(
    pool: &PgPool,
    endpoint_id: Uuid,
    event_id: Uuid,
    attempt: i32,
    outcome: &Outcome,
    duration_ms: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE webhook_attempts
         SET finished_at = now(), outcome = $4, status_code = $5, error = $6, duration_ms = $7
         WHERE endpoint_id = $1 AND event_id = $2 AND attempt = $3",
    )
    .bind(endpoint_id)
    .bind(event_id)
    .bind(attempt)
    .bind(outcome.label())
    .bind(outcome.status_code())
    .bind(outcome.error())
    .bind(duration_ms)
    .execute(pool)
    .await?;
    Ok(())
}

/// Moves the cursor past `to`, fenced by the lease, unless a redelivery
/// request moved it meanwhile (then that request wins). False: the lease
/// is lost.
async fn advance(pool: &PgPool, endpoint: &mut Claimed, to: Cursor) -> Result<bool, sqlx::Error> {
    let cursor: Option<(i64, i64)> = sqlx::query_as(
        "UPDATE webhook_endpoints
         SET cursor_txid = CASE WHEN (cursor_txid::text::int8, cursor_position) = ($3, $4)
                                THEN $5::int8::text::xid8 ELSE cursor_txid END,
             cursor_position = CASE WHEN (cursor_txid::text::int8, cursor_position) = ($3, $4)
                                    THEN $6 ELSE cursor_position END,
             consecutive_failures = 0, failing_since = NULL, updated_at = now()
         WHERE id = $1 AND lease_token = $2
         RETURNING cursor_txid::text::int8, cursor_position",
    )
    .bind(endpoint.id)
    .bind(endpoint.lease_token)
    .bind(endpoint.cursor_txid)
    .bind(endpoint.cursor_position)
    .bind(to.txid)
    .bind(to.position)
    .fetch_optional(pool)
    .await?;
    let Some((txid, position)) = cursor else {
        return Ok(false);
    };
    endpoint.cursor_txid = txid;
    endpoint.cursor_position = position;
    endpoint.consecutive_failures = 0;
    Ok(true)
}

/// A 2xx: the cursor moves past the event (or its redelivery request is
/// done) and the failures are forgotten.
async fn delivered(
    pool: &PgPool,
    endpoint: &mut Claimed,
    event: &Event,
    redelivery: bool,
) -> Result<bool, sqlx::Error> {
    if !redelivery {
        return advance(pool, endpoint, event.cursor()).await;
    }
    sqlx::query("DELETE FROM webhook_redeliveries WHERE endpoint_id = $1 AND event_id = $2")
        .bind(endpoint.id)
        .bind(event.id)
        .execute(pool)
        .await?;
    let cursor = Cursor {
        txid: endpoint.cursor_txid,
        position: endpoint.cursor_position,
    };
    advance(pool, endpoint, cursor).await
}

/// Anything but a 2xx: one more failure, the next attempt after a backoff,
/// and the endpoint disabled once the event has failed for longer than the
/// retry window. Releases the lease.
async fn failed(
    pool: &PgPool,
    settings: Settings,
    endpoint: &Claimed,
    event: &Event,
    started_at: DateTime<Utc>,
    outcome: &Outcome,
) -> Result<(), sqlx::Error> {
    let failures = endpoint.consecutive_failures.saturating_add(1);
    let wait = super::backoff(failures, BACKOFF_BASE, settings.backoff_max);
    let reason = format!(
        "event {} failed for longer than the retry window ({} s); last: {}",
        event.id,
        settings.retry_window.as_secs(),
        outcome.error().unwrap_or_default()
    );
    let mut tx = pool.begin().await?;
    let status: Option<String> = sqlx::query_scalar(
        "WITH since AS (
             SELECT COALESCE(failing_since, $3) AS at FROM webhook_endpoints WHERE id = $1
         ), give_up AS (
             SELECT at < now() - make_interval(secs => $5) AS yes FROM since
         )
         UPDATE webhook_endpoints
         SET consecutive_failures = consecutive_failures + 1,
             failing_since = (SELECT at FROM since),
             next_attempt_at = now() + make_interval(secs => $4),
             status = CASE WHEN (SELECT yes FROM give_up) THEN 'disabled' ELSE status END,
             disabled_at = CASE WHEN (SELECT yes FROM give_up) THEN now() ELSE disabled_at END,
             disabled_reason = CASE WHEN (SELECT yes FROM give_up) THEN $6 ELSE disabled_reason END,
             lease_token = NULL, leased_until = NULL, updated_at = now()
         WHERE id = $1 AND lease_token = $2
         RETURNING status",
    )
    .bind(endpoint.id)
    .bind(endpoint.lease_token)
    .bind(started_at)
    .bind(wait.as_secs_f64())
    .bind(settings.retry_window.as_secs_f64())
    .bind(&reason)
    .fetch_optional(&mut *tx)
    .await?;
    let disabled = status.as_deref() == Some("disabled");
    if disabled {
        super::store::announce_disabled(&mut tx, endpoint.principal_id, endpoint.id).await?;
    }
    tx.commit().await?;
    if disabled {
        telemetry::webhook_endpoint_disabled();
        telemetry::events_written(EventType::WebhookEndpointDisabled, 1);
        tracing::warn!(endpoint_id = %endpoint.id, event_id = %event.id, %reason, "webhook endpoint disabled");
    }
    Ok(())
}
