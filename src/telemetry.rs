//! Prometheus metrics: their names, the process-wide recorder, and one
//! function per thing worth counting, so call sites stay one line and the
//! whole catalogue (described in `docs/operations.md`) is in this file.
//!
//! Label values come only from closed sets (route templates, status codes,
//! outcome and problem names, check names): never a key, an id or a token,
//! so the number of series stays bounded whatever clients send.

use std::sync::OnceLock;
use std::time::Duration;

use axum::http::Method;
use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use sqlx::PgPool;

use crate::idempotency::store::Purged;
use crate::ledger::events::{EventType, EventsPurged};
use crate::reconcile::{Check, Report};

pub const HTTP_REQUESTS_TOTAL: &str = "nexo_http_requests_total";
pub const HTTP_REQUEST_DURATION_SECONDS: &str = "nexo_http_request_duration_seconds";
pub const IDEMPOTENCY_OUTCOMES_TOTAL: &str = "nexo_idempotency_outcomes_total";
pub const CLAIM_STATEMENTS_TOTAL: &str = "nexo_idempotency_claim_statements_total";
pub const CLAIM_ATTEMPTS_TOTAL: &str = "nexo_idempotency_claim_attempts_total";
pub const CLAIMS_QUEUED: &str = "nexo_idempotency_claims_queued";
pub const CLAIM_BATCHES_SPLIT_TOTAL: &str = "nexo_idempotency_claim_batches_split_total";
pub const TRANSFERS_POSTED_TOTAL: &str = "nexo_transfers_posted_total";
pub const TRANSFERS_REJECTED_TOTAL: &str = "nexo_transfers_rejected_total";
pub const HOLDS_TOTAL: &str = "nexo_holds_total";
pub const DB_POOL_CONNECTIONS: &str = "nexo_db_pool_connections";
pub const DB_POOL_MAX_CONNECTIONS: &str = "nexo_db_pool_max_connections";
pub const DB_POOL_ACQUIRE_TIMEOUTS_TOTAL: &str = "nexo_db_pool_acquire_timeouts_total";
pub const PURGE_RUNS_TOTAL: &str = "nexo_idempotency_purge_runs_total";
pub const PURGED_KEYS_TOTAL: &str = "nexo_idempotency_keys_purged_total";
pub const RECONCILE_RUNS_TOTAL: &str = "nexo_reconcile_runs_total";
pub const RECONCILE_LAST_RUN_TIMESTAMP_SECONDS: &str = "nexo_reconcile_last_run_timestamp_seconds";
pub const RECONCILE_LAST_RUN_DURATION_SECONDS: &str = "nexo_reconcile_last_run_duration_seconds";
pub const RECONCILE_LAST_RUN_DISCREPANCIES: &str = "nexo_reconcile_last_run_discrepancies";
pub const EVENTS_WRITTEN_TOTAL: &str = "nexo_events_written_total";
pub const EVENTS_PURGED_TOTAL: &str = "nexo_events_purged_total";
pub const EVENTS_OLDEST_TIMESTAMP_SECONDS: &str = "nexo_events_oldest_timestamp_seconds";
pub const EVENT_FEED_WAITERS: &str = "nexo_event_feed_waiters";
pub const WEBHOOK_ATTEMPTS_TOTAL: &str = "nexo_webhook_attempts_total";
pub const WEBHOOK_ENDPOINTS_DISABLED_TOTAL: &str = "nexo_webhook_endpoints_disabled_total";
pub const WEBHOOK_OLDEST_UNDELIVERED_SECONDS: &str = "nexo_webhook_oldest_undelivered_seconds";

/// Every metric this process exports; `docs/operations.md` describes each.
pub const METRICS: [&str; 26] = [
    HTTP_REQUESTS_TOTAL,
    HTTP_REQUEST_DURATION_SECONDS,
    IDEMPOTENCY_OUTCOMES_TOTAL,
    CLAIM_STATEMENTS_TOTAL,
    CLAIM_ATTEMPTS_TOTAL,
    CLAIMS_QUEUED,
    CLAIM_BATCHES_SPLIT_TOTAL,
    TRANSFERS_POSTED_TOTAL,
    TRANSFERS_REJECTED_TOTAL,
    HOLDS_TOTAL,
    DB_POOL_CONNECTIONS,
    DB_POOL_MAX_CONNECTIONS,
    DB_POOL_ACQUIRE_TIMEOUTS_TOTAL,
    PURGE_RUNS_TOTAL,
    PURGED_KEYS_TOTAL,
    RECONCILE_RUNS_TOTAL,
    RECONCILE_LAST_RUN_TIMESTAMP_SECONDS,
    RECONCILE_LAST_RUN_DURATION_SECONDS,
    RECONCILE_LAST_RUN_DISCREPANCIES,
    EVENTS_WRITTEN_TOTAL,
    EVENTS_PURGED_TOTAL,
    EVENTS_OLDEST_TIMESTAMP_SECONDS,
    EVENT_FEED_WAITERS,
    WEBHOOK_ATTEMPTS_TOTAL,
    WEBHOOK_ENDPOINTS_DISABLED_TOTAL,
    WEBHOOK_OLDEST_UNDELIVERED_SECONDS,
];

/// How a webhook attempt ended.
pub const WEBHOOK_OUTCOMES: [&str; 4] = ["delivered", "http_error", "timeout", "connect_error"];

/// Every idempotency outcome the transfer handler records: the result of
/// the claim (`claimed`, `taken_over`, `replayed`, `mismatch`, `in_flight`,
/// `cancelled` for a key whose intent was cancelled) and, after a claim, an
/// execution that did not complete the key (`failed`, `fence_lost`).
pub const IDEMPOTENCY_OUTCOMES: [&str; 8] = [
    "claimed",
    "taken_over",
    "replayed",
    "mismatch",
    "in_flight",
    "cancelled",
    "failed",
    "fence_lost",
];

/// Request latency buckets, in seconds: from a replay's millisecond to the
/// 10 s default request timeout, dense where postings land (5 to 50 ms).
const HTTP_DURATION_BUCKETS_SECONDS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// How often histogram samples are folded into their buckets when nobody
/// scrapes; without it they would pile up in memory between scrapes.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

static RECORDER: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// The process-wide recorder, installed on first use. A process has one
/// global recorder, but tests serve many apps in one process: they all share
/// it, and a test reads differences between two scrapes. `None` when some
/// other recorder was installed first; `/metrics` then answers 503.
pub fn recorder() -> Option<&'static PrometheusHandle> {
    RECORDER.get_or_init(install).as_ref()
}

fn install() -> Option<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(HTTP_REQUEST_DURATION_SECONDS.to_owned()),
            &HTTP_DURATION_BUCKETS_SECONDS,
        )
        .and_then(PrometheusBuilder::install_recorder);
    let handle = match handle {
        Ok(handle) => handle,
        Err(e) => {
            tracing::error!(error = %e, "cannot install the metrics recorder; /metrics is off");
            return None;
        }
    };
    let upkeep = handle.clone();
    // A plain thread, not a task: it must outlive any one Tokio runtime.
    let spawned = std::thread::Builder::new()
        .name("metrics-upkeep".to_owned())
        .spawn(move || {
            loop {
                std::thread::sleep(UPKEEP_INTERVAL);
                upkeep.run_upkeep();
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no metrics upkeep thread; histograms fold in at each scrape");
    }
    describe();
    Some(handle)
}

/// HELP lines, and a zero for every series an alert or a rate may need
/// before its first event (a missing series is not a zero in PromQL).
fn describe() {
    describe_counter!(
        HTTP_REQUESTS_TOTAL,
        Unit::Count,
        "HTTP requests answered, by method, route template and status"
    );
    describe_histogram!(
        HTTP_REQUEST_DURATION_SECONDS,
        Unit::Seconds,
        "Time to answer an HTTP request, by method, route template and status"
    );
    describe_counter!(
        IDEMPOTENCY_OUTCOMES_TOTAL,
        Unit::Count,
        "POST /transfers idempotency outcomes: claim results and executions that did not complete"
    );
    describe_counter!(
        CLAIM_STATEMENTS_TOTAL,
        Unit::Count,
        "Insert-first claim statements run; claims arriving together share one"
    );
    describe_counter!(
        CLAIM_ATTEMPTS_TOTAL,
        Unit::Count,
        "Insert-first claim attempts those statements carried (attempts / statements = claims per statement)"
    );
    describe_gauge!(
        CLAIMS_QUEUED,
        Unit::Count,
        "Claims waiting in memory for a claim statement on this instance, sampled at each scrape"
    );
    describe_counter!(
        CLAIM_BATCHES_SPLIT_TOTAL,
        Unit::Count,
        "Claim statements of several claims that failed and were retried claim by claim"
    );
    describe_counter!(
        HOLDS_TOTAL,
        Unit::Count,
        "Pending transfers (holds) by what happened to them: created, posted, voided, expired"
    );
    describe_counter!(
        TRANSFERS_POSTED_TOTAL,
        Unit::Count,
        "Transfers committed to the ledger (money moved)"
    );
    describe_counter!(
        TRANSFERS_REJECTED_TOTAL,
        Unit::Count,
        "Transfer requests refused, by problem type"
    );
    describe_gauge!(
        DB_POOL_CONNECTIONS,
        Unit::Count,
        "Database pool connections by state (in_use, idle), sampled at each scrape"
    );
    describe_gauge!(
        DB_POOL_MAX_CONNECTIONS,
        Unit::Count,
        "Most connections the database pool opens (NEXO_DB_POOL_MAX)"
    );
    describe_counter!(
        DB_POOL_ACQUIRE_TIMEOUTS_TOTAL,
        Unit::Count,
        "Requests that waited NEXO_DB_ACQUIRE_TIMEOUT for a connection and got a 503"
    );
    describe_counter!(
        PURGE_RUNS_TOTAL,
        Unit::Count,
        "Purges of expired idempotency records, by result"
    );
    describe_counter!(
        PURGED_KEYS_TOTAL,
        Unit::Count,
        "Idempotency records the purge compacted (past their TTL) or deleted, by action"
    );
    describe_counter!(
        RECONCILE_RUNS_TOTAL,
        Unit::Count,
        "Scheduled reconciliations, by result (ok, discrepancies, error)"
    );
    describe_gauge!(
        RECONCILE_LAST_RUN_TIMESTAMP_SECONDS,
        Unit::Seconds,
        "Unix time at which the last completed reconciliation took its snapshot"
    );
    describe_gauge!(
        RECONCILE_LAST_RUN_DURATION_SECONDS,
        Unit::Seconds,
        "How long the last completed reconciliation took"
    );
    describe_gauge!(
        RECONCILE_LAST_RUN_DISCREPANCIES,
        Unit::Count,
        "Discrepancies the last completed reconciliation found, by check"
    );
    describe_counter!(
        EVENTS_WRITTEN_TOTAL,
        Unit::Count,
        "Events committed to the outbox by this instance, by type"
    );
    describe_counter!(
        EVENTS_PURGED_TOTAL,
        Unit::Count,
        "Events the purge deleted past NEXO_EVENT_RETENTION"
    );
    describe_gauge!(
        EVENTS_OLDEST_TIMESTAMP_SECONDS,
        Unit::Seconds,
        "Unix time of the oldest event kept, as the last purge found it (the purge's time when none)"
    );
    describe_gauge!(
        EVENT_FEED_WAITERS,
        Unit::Count,
        "GET /events requests waiting for events (long polls) on this instance"
    );
    describe_counter!(
        WEBHOOK_ATTEMPTS_TOTAL,
        Unit::Count,
        "Webhook delivery attempts this instance made, by outcome"
    );
    describe_counter!(
        WEBHOOK_ENDPOINTS_DISABLED_TOTAL,
        Unit::Count,
        "Webhook endpoints this instance disabled after the retry window"
    );
    describe_gauge!(
        WEBHOOK_OLDEST_UNDELIVERED_SECONDS,
        Unit::Seconds,
        "Age of the oldest event an enabled webhook endpoint has not had yet"
    );

    for outcome in IDEMPOTENCY_OUTCOMES {
        counter!(IDEMPOTENCY_OUTCOMES_TOTAL, "outcome" => outcome).absolute(0);
    }
    counter!(TRANSFERS_POSTED_TOTAL).absolute(0);
    for event in HOLD_EVENTS {
        counter!(HOLDS_TOTAL, "event" => event).absolute(0);
    }
    counter!(DB_POOL_ACQUIRE_TIMEOUTS_TOTAL).absolute(0);
    counter!(CLAIM_STATEMENTS_TOTAL).absolute(0);
    counter!(CLAIM_ATTEMPTS_TOTAL).absolute(0);
    gauge!(CLAIMS_QUEUED).set(0.0);
    counter!(CLAIM_BATCHES_SPLIT_TOTAL).absolute(0);
    for result in ["ok", "error"] {
        counter!(PURGE_RUNS_TOTAL, "result" => result).absolute(0);
    }
    for action in ["compacted", "deleted"] {
        counter!(PURGED_KEYS_TOTAL, "action" => action).absolute(0);
    }
    for result in ["ok", "discrepancies", "error"] {
        counter!(RECONCILE_RUNS_TOTAL, "result" => result).absolute(0);
    }
    for event in EventType::ALL {
        counter!(EVENTS_WRITTEN_TOTAL, "type" => event.as_str()).absolute(0);
    }
    counter!(EVENTS_PURGED_TOTAL).absolute(0);
    gauge!(EVENT_FEED_WAITERS).set(0.0);
    for outcome in WEBHOOK_OUTCOMES {
        counter!(WEBHOOK_ATTEMPTS_TOTAL, "outcome" => outcome).absolute(0);
    }
    counter!(WEBHOOK_ENDPOINTS_DISABLED_TOTAL).absolute(0);
    gauge!(WEBHOOK_OLDEST_UNDELIVERED_SECONDS).set(0.0);
}

/// Methods outside the standard set become `other`: a client may send any
/// token as a method, and each would otherwise be a new series.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// One answered request. `route` is a route template (or `unmatched`).
pub fn http_request(method: &Method, route: &str, status: u16, latency: Duration) {
    let labels = [
        ("method", method_label(method).to_owned()),
        ("route", route.to_owned()),
        ("status", status.to_string()),
    ];
    counter!(HTTP_REQUESTS_TOTAL, &labels).increment(1);
    histogram!(HTTP_REQUEST_DURATION_SECONDS, &labels).record(latency.as_secs_f64());
}

/// One of [`IDEMPOTENCY_OUTCOMES`].
pub fn idempotency_outcome(outcome: &'static str) {
    counter!(IDEMPOTENCY_OUTCOMES_TOTAL, "outcome" => outcome).increment(1);
}

/// What can happen to a hold: the `event` label's closed set.
pub const HOLD_EVENTS: [&str; 4] = ["created", "posted", "voided", "expired"];

/// `event` is one of [`HOLD_EVENTS`].
pub fn hold_event(event: &'static str) {
    counter!(HOLDS_TOTAL, "event" => event).increment(1);
}

pub fn hold_events(event: &'static str, count: u64) {
    counter!(HOLDS_TOTAL, "event" => event).increment(count);
}

pub fn transfer_posted() {
    counter!(TRANSFERS_POSTED_TOTAL).increment(1);
}

/// Events of one type, counted once their transaction committed.
pub fn events_written(event: EventType, count: u64) {
    counter!(EVENTS_WRITTEN_TOTAL, "type" => event.as_str()).increment(count);
}

/// A long poll of the event feed started (`1.0`) or ended (`-1.0`) waiting.
pub fn event_feed_waiters(change: f64) {
    gauge!(EVENT_FEED_WAITERS).increment(change);
}

/// One purge of events; `at` is when it ran, the oldest event's age when
/// none is left.
pub fn events_purge(result: &Result<EventsPurged, sqlx::Error>, at: chrono::DateTime<chrono::Utc>) {
    if let Ok(purged) = result {
        counter!(EVENTS_PURGED_TOTAL).increment(purged.deleted);
        let oldest = purged.oldest.unwrap_or(at);
        gauge!(EVENTS_OLDEST_TIMESTAMP_SECONDS).set(oldest.timestamp_micros() as f64 / 1e6);
    }
}

/// One webhook attempt ended; `outcome` is one of [`WEBHOOK_OUTCOMES`].
pub fn webhook_attempt(outcome: &'static str) {
    counter!(WEBHOOK_ATTEMPTS_TOTAL, "outcome" => outcome).increment(1);
}

/// One insert-first claim statement carrying `attempts` claims.
pub fn claim_statement(attempts: usize) {
    counter!(CLAIM_STATEMENTS_TOTAL).increment(1);
    counter!(CLAIM_ATTEMPTS_TOTAL).increment(u64::try_from(attempts).unwrap_or(u64::MAX));
}

/// The claim queue's length, sampled at each scrape.
pub fn sample_claims_queued(queued: usize) {
    gauge!(CLAIMS_QUEUED).set(queued as f64);
}

/// A claim statement of several claims failed; each is tried alone.
pub fn claim_batch_split() {
    counter!(CLAIM_BATCHES_SPLIT_TOTAL).increment(1);
}

/// The worker disabled an endpoint whose head event failed past the retry
/// window.
pub fn webhook_endpoint_disabled() {
    counter!(WEBHOOK_ENDPOINTS_DISABLED_TOTAL).increment(1);
}

/// The age of the oldest event an enabled endpoint has not had yet.
pub fn webhook_oldest_undelivered(seconds: f64) {
    gauge!(WEBHOOK_OLDEST_UNDELIVERED_SECONDS).set(seconds);
}

/// `reason` is a problem type slug: a closed set.
pub fn transfer_rejected(reason: &'static str) {
    counter!(TRANSFERS_REJECTED_TOTAL, "reason" => reason).increment(1);
}

pub fn pool_acquire_timeout() {
    counter!(DB_POOL_ACQUIRE_TIMEOUTS_TOTAL).increment(1);
}

/// Samples the pool. sqlx does not expose how many tasks wait for a
/// connection: `in_use` at the maximum is saturation, and the acquire
/// timeouts counter counts the waits that gave up.
pub fn sample_pool(pool: &PgPool) {
    let size = pool.size();
    let idle = u32::try_from(pool.num_idle()).unwrap_or(size).min(size);
    gauge!(DB_POOL_CONNECTIONS, "state" => "in_use").set(f64::from(size - idle));
    gauge!(DB_POOL_CONNECTIONS, "state" => "idle").set(f64::from(idle));
    gauge!(DB_POOL_MAX_CONNECTIONS).set(f64::from(pool.options().get_max_connections()));
}

pub fn purge(result: &Result<Purged, sqlx::Error>) {
    match result {
        Ok(purged) => {
            counter!(PURGE_RUNS_TOTAL, "result" => "ok").increment(1);
            counter!(PURGED_KEYS_TOTAL, "action" => "compacted").increment(purged.compacted);
            counter!(PURGED_KEYS_TOTAL, "action" => "deleted").increment(purged.deleted);
        }
        Err(_) => counter!(PURGE_RUNS_TOTAL, "result" => "error").increment(1),
    }
}

pub fn reconciliation(result: &Result<Report, sqlx::Error>) {
    let report = match result {
        Ok(report) => report,
        Err(_) => {
            counter!(RECONCILE_RUNS_TOTAL, "result" => "error").increment(1);
            return;
        }
    };
    let verdict = if report.ok { "ok" } else { "discrepancies" };
    counter!(RECONCILE_RUNS_TOTAL, "result" => verdict).increment(1);
    gauge!(RECONCILE_LAST_RUN_TIMESTAMP_SECONDS)
        .set(report.started_at.timestamp_micros() as f64 / 1e6);
    gauge!(RECONCILE_LAST_RUN_DURATION_SECONDS).set(report.duration_ms as f64 / 1e3);
    for check in Check::ALL {
        let found = report.check(check).map_or(0, |c| c.discrepancies_total);
        gauge!(RECONCILE_LAST_RUN_DISCREPANCIES, "check" => check.name()).set(found as f64);
    }
}
