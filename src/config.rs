//! Settings, from flags with environment fallbacks. Every limit is named,
//! has a default that is safe for production and says why.

use std::time::Duration;

use crate::idempotency::Policy;

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres:postgres@localhost:5432/nexo_transfers";

/// Database connection settings, shared by every command.
#[derive(Debug, Clone, clap::Args)]
pub struct DbConfig {
    /// PostgreSQL URL (postgres:// or postgresql://; several hosts as
    /// host1:port1,host2:port2 follow the primary; sslmode and sslrootcert
    /// as libpq). Only `serve` and `migrate` create a missing database.
    #[arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE_URL, global = true, hide_env_values = true)]
    pub database_url: String,
    /// Most connections the pool opens. Measured on 2 cores: throughput falls
    /// past about 16 connections, so a small pool is the sweet spot.
    #[arg(long, env = "NEXO_DB_POOL_MAX", default_value_t = 16, global = true,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub db_pool_max: u32,
    /// How long a request waits for a pooled connection before a 503.
    #[arg(long, env = "NEXO_DB_ACQUIRE_TIMEOUT", default_value = "5s", global = true, value_parser = parse_duration)]
    pub db_acquire_timeout: Duration,
}

/// Idempotency record lifetimes.
#[derive(Debug, Clone, clap::Args)]
pub struct IdempotencyConfig {
    /// How long a key's record (and its replayable response) is kept.
    /// Stripe keeps 24h; the seed recommends 24 to 72h for transfers.
    #[arg(long, env = "NEXO_IDEMPOTENCY_TTL", default_value = "24h", value_parser = parse_duration)]
    pub idempotency_ttl: Duration,
    /// How long a claim is exclusively held before a retry may take it over.
    /// Far above a posting's milliseconds, short enough that a crashed
    /// process does not block a key for long.
    #[arg(long, env = "NEXO_IDEMPOTENCY_LEASE", default_value = "30s", value_parser = parse_duration)]
    pub idempotency_lease: Duration,
    /// How long a key is remembered from its first use. Past the TTL it is
    /// kept as a compact record (the outcome, not the response bytes):
    /// within this horizon no key executes twice, and a success, a business
    /// rejection or a cancellation is answered as it was. 400 days outlasts
    /// a yearly batch job rerun with last year's keys.
    #[arg(long, env = "NEXO_IDEMPOTENCY_RETENTION", default_value = "400days", value_parser = parse_duration)]
    pub idempotency_retention: Duration,
}

impl IdempotencyConfig {
    pub fn policy(&self) -> Result<Policy, String> {
        if self.idempotency_lease < Duration::from_secs(1) {
            return Err("NEXO_IDEMPOTENCY_LEASE must be at least 1s".to_owned());
        }
        if self.idempotency_ttl <= self.idempotency_lease {
            return Err(
                "NEXO_IDEMPOTENCY_TTL must be longer than NEXO_IDEMPOTENCY_LEASE".to_owned(),
            );
        }
        if self.idempotency_retention < self.idempotency_ttl {
            return Err(
                "NEXO_IDEMPOTENCY_RETENTION must be at least NEXO_IDEMPOTENCY_TTL".to_owned(),
            );
        }
        Ok(Policy {
            ttl: self.idempotency_ttl,
            lease: self.idempotency_lease,
            retention: self.idempotency_retention,
        })
    }
}

/// HTTP server limits.
#[derive(Debug, Clone, clap::Args)]
pub struct HttpConfig {
    /// Largest request body accepted, in bytes; a transfer is under 1 KiB.
    #[arg(long, env = "NEXO_BODY_LIMIT_BYTES", default_value_t = 16 * 1024,
          value_parser = clap::value_parser!(u32).range(256..=10 * 1024 * 1024))]
    pub body_limit_bytes: u32,
    /// Longest a client waits for an answer (503 after). A transfer still
    /// running then completes, and a retry replays it.
    #[arg(long, env = "NEXO_REQUEST_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub request_timeout: Duration,
}

/// The posting layer's bounds and the shutdown's deadline.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct PostingConfig {
    /// Longest a transfer waits for its accounts: in this instance's queue
    /// behind work on the same accounts, and again for a row lock held
    /// elsewhere (an operator's transaction, another instance). Past it the
    /// key is marked FAILED and the client gets 503 with Retry-After.
    /// Transfers on other accounts never wait behind it.
    #[arg(long, env = "NEXO_POSTING_LOCK_TIMEOUT", default_value = "2s", value_parser = parse_duration)]
    pub posting_lock_timeout: Duration,
    /// On SIGTERM or SIGINT: how long queued transfers may still be posted
    /// before what is left is marked FAILED (retryable) and the process
    /// exits. Keep it under the orchestrator's kill grace period.
    #[arg(long, env = "NEXO_SHUTDOWN_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,
    /// Transfers (groups of transfers sharing accounts) that may wait for a
    /// row lock held elsewhere at once; more are refused at once with 503.
    /// Each waiter holds a connection of the pool, so the default, half of
    /// NEXO_DB_POOL_MAX, leaves the other half to transfers on other
    /// accounts. Set it to the pool's size only to accept that locked
    /// accounts may exhaust the pool (every request is then still answered
    /// within NEXO_DB_ACQUIRE_TIMEOUT).
    #[arg(long, env = "NEXO_POSTING_LOCK_WAITERS_MAX",
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub posting_lock_waiters_max: Option<u32>,
    /// Acknowledge a transfer only once a synchronous standby has it, even
    /// when the primary has no synchronous standby configured (then every
    /// transfer waits NEXO_REPLICATION_TIMEOUT and is answered 503). Off:
    /// wait for a standby whenever the primary has one configured
    /// (`synchronous_standby_names`), which is what a pg_auto_failover or
    /// Patroni cluster in synchronous mode sets. See
    /// docs/high-availability.md.
    #[arg(long, env = "NEXO_REQUIRE_SYNC_STANDBY", default_value_t = false)]
    pub require_sync_standby: bool,
    /// Longest an answer waits for a synchronous standby to confirm its
    /// commit; then 503 (the retry replays the transfer once confirmed, or
    /// executes it on a new primary that never had it).
    #[arg(long, env = "NEXO_REPLICATION_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub replication_timeout: Duration,
    /// How often the expiry task releases pending transfers past their
    /// expiry; `0s` turns it off on this instance (another instance's task
    /// does it; a post or void always refuses a hold past its expiry).
    #[arg(long, env = "NEXO_HOLD_EXPIRY_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub hold_expiry_interval: Duration,
}

impl PostingConfig {
    /// A lock timeout longer than the lease is allowed: a retry may then
    /// take the key over while the first request still waits, and the
    /// first request's completion is fenced out, so money still moves once.
    pub fn validated(self) -> Result<Self, String> {
        if self.posting_lock_timeout < POSTING_LOCK_TIMEOUT_MIN {
            return Err(format!(
                "NEXO_POSTING_LOCK_TIMEOUT must be at least {}ms",
                POSTING_LOCK_TIMEOUT_MIN.as_millis()
            ));
        }
        if self.shutdown_timeout > SHUTDOWN_TIMEOUT_MAX {
            return Err(format!(
                "NEXO_SHUTDOWN_TIMEOUT must be at most {}s",
                SHUTDOWN_TIMEOUT_MAX.as_secs()
            ));
        }
        Ok(self)
    }
}

impl Default for PostingConfig {
    fn default() -> Self {
        Self {
            posting_lock_timeout: Duration::from_secs(2),
            shutdown_timeout: Duration::from_secs(10),
            posting_lock_waiters_max: None,
            require_sync_standby: false,
            replication_timeout: Duration::from_secs(5),
            hold_expiry_interval: Duration::from_secs(1),
        }
    }
}

/// Shorter lock waits would fail transfers behind an ordinary batch of
/// another instance (milliseconds).
pub const POSTING_LOCK_TIMEOUT_MIN: Duration = Duration::from_millis(100);

/// A shutdown longer than this outlives any orchestrator's grace period.
pub const SHUTDOWN_TIMEOUT_MAX: Duration = Duration::from_secs(300);

/// Per-principal rate limits: past them a request gets 429 with
/// `Retry-After`, before it touches an idempotency key.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct RateLimitConfig {
    /// Requests per second each principal may sustain; `0` turns limiting
    /// off. The default is above what one instance serves on the reference
    /// 2-core machine (about 3,000 new transfers/s, 15,000 replays/s), so
    /// it never throttles a well-behaved client, a test or a benchmark: it
    /// stops a runaway client from taking a shared fleet. Set it to each
    /// deployment's contract.
    #[arg(long, env = "NEXO_RATE_LIMIT_PER_SECOND", default_value_t = RateLimitConfig::PER_SECOND_DEFAULT)]
    pub rate_limit_per_second: u32,
    /// Requests a principal may send at once above the sustained rate (the
    /// bucket's size): absorbs a client's retry burst after an outage.
    #[arg(long, env = "NEXO_RATE_LIMIT_BURST", default_value_t = RateLimitConfig::BURST_DEFAULT,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub rate_limit_burst: u32,
}

impl RateLimitConfig {
    pub const PER_SECOND_DEFAULT: u32 = 20_000;
    pub const BURST_DEFAULT: u32 = 20_000;
}

impl Default for RateLimitConfig {
    fn default() -> Self {
        Self {
            rate_limit_per_second: Self::PER_SECOND_DEFAULT,
            rate_limit_burst: Self::BURST_DEFAULT,
        }
    }
}

/// The background purge of expired idempotency records.
#[derive(Debug, Clone, clap::Args)]
pub struct PurgeConfig {
    /// How often `serve` purges expired records; `0s` turns it off.
    #[arg(long, env = "NEXO_PURGE_INTERVAL", default_value = "5m", value_parser = parse_duration)]
    pub purge_interval: Duration,
    /// Rows deleted per purge statement.
    #[arg(long, env = "NEXO_PURGE_BATCH_ROWS", default_value_t = crate::idempotency::store::PURGE_BATCH_ROWS_MAX,
          value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub purge_batch_rows: i64,
    #[command(flatten)]
    pub events: EventRetentionConfig,
}

/// How long the event feed keeps its events.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct EventRetentionConfig {
    /// How long an event stays readable in `GET /events`; the purge deletes
    /// older ones. A consumer that stops for longer misses what it did not
    /// read. 30 days outlasts a long weekend of a broken consumer with room
    /// to spare, at about 820 bytes per event.
    #[arg(long, env = "NEXO_EVENT_RETENTION", default_value = "30days", value_parser = parse_event_retention)]
    pub event_retention: Duration,
}

impl Default for EventRetentionConfig {
    fn default() -> Self {
        Self {
            event_retention: EVENT_RETENTION_DEFAULT,
        }
    }
}

pub const EVENT_RETENTION_DEFAULT: Duration = Duration::from_secs(30 * 24 * 3600);

/// The shortest event retention accepted: a consumer restarted after a
/// deploy or an incident must still find what it had not read.
pub const EVENT_RETENTION_MIN: Duration = Duration::from_secs(3600);

fn parse_event_retention(value: &str) -> Result<Duration, String> {
    let retention = parse_duration(value)?;
    if retention < EVENT_RETENTION_MIN {
        return Err(format!(
            "must be at least {}s",
            EVENT_RETENTION_MIN.as_secs()
        ));
    }
    Ok(retention)
}

/// The scheduled reconciliation and the admin endpoint that shows it.
#[derive(Debug, Clone, clap::Args)]
pub struct OperationsConfig {
    /// How often `serve` reconciles the whole ledger; `0s` (the default)
    /// turns it off. Each run reads every transfer and entry (5 to 11 s per
    /// million transfers on 2 busy cores, see docs/operations.md), so enable it on one
    /// instance only, at most once a minute.
    #[arg(long, env = "NEXO_RECONCILE_INTERVAL", default_value = "0s", value_parser = parse_duration)]
    pub reconcile_interval: Duration,
    /// Bearer token for `GET /admin/reconciliation`; unset turns the admin
    /// endpoint off. Only its SHA-256 is kept once the server has started.
    #[arg(long, env = "NEXO_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
}

/// Shortest reconciliation interval accepted: a run scans the whole ledger,
/// so running it back to back would only add load without finding more.
pub const RECONCILE_INTERVAL_MIN: Duration = Duration::from_secs(60);

impl OperationsConfig {
    /// The schedule, or `None` when it is off.
    pub fn reconcile_every(&self) -> Result<Option<Duration>, String> {
        match self.reconcile_interval {
            d if d.is_zero() => Ok(None),
            d if d < RECONCILE_INTERVAL_MIN => Err(format!(
                "NEXO_RECONCILE_INTERVAL must be 0s (off) or at least {}s",
                RECONCILE_INTERVAL_MIN.as_secs()
            )),
            d => Ok(Some(d)),
        }
    }
}

/// The webhook delivery worker (docs/events.md, ADR-012).
#[derive(Debug, Clone, clap::Args)]
pub struct WebhookConfig {
    /// How often the worker looks for endpoints with something to deliver;
    /// `0s` turns delivery off on this instance (another instance's worker
    /// delivers). An event reaches an idle endpoint within about this.
    #[arg(long, env = "NEXO_WEBHOOK_INTERVAL", default_value = "200ms", value_parser = parse_duration)]
    pub webhook_interval: Duration,
    /// Longest one delivery attempt may take, connecting included; past it
    /// the attempt counts as a timeout and is retried.
    #[arg(long, env = "NEXO_WEBHOOK_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub webhook_timeout: Duration,
    /// The longest wait between two attempts of a failing endpoint (the
    /// waits double from 1 s up to this, each drawn at random below its
    /// ceiling).
    #[arg(long, env = "NEXO_WEBHOOK_BACKOFF_MAX", default_value = "5m", value_parser = parse_duration)]
    pub webhook_backoff_max: Duration,
    /// How long one event is retried before its endpoint is disabled (its
    /// owner enables it again, and delivery resumes where it stopped).
    /// Three days outlast a receiver broken over a weekend.
    #[arg(long, env = "NEXO_WEBHOOK_RETRY_WINDOW", default_value = "3days", value_parser = parse_duration)]
    pub webhook_retry_window: Duration,
    /// Endpoints this instance delivers to at once (one request in flight
    /// each): a slow or hanging receiver holds one slot for at most
    /// NEXO_WEBHOOK_TIMEOUT, never the others.
    #[arg(long, env = "NEXO_WEBHOOK_CONCURRENCY", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub webhook_concurrency: u32,
    /// A PEM file of CA certificates trusted for `https` endpoints beside
    /// the public roots compiled in (receivers behind a private CA); at
    /// most 1 MiB. A file that cannot be read stops the server at start.
    #[arg(long, env = "NEXO_WEBHOOK_CA_FILE")]
    pub webhook_ca_file: Option<std::path::PathBuf>,
}

impl WebhookConfig {
    /// The worker's settings, or `None` when delivery is off here.
    pub fn settings(&self) -> Result<Option<crate::webhooks::worker::Settings>, String> {
        if self.webhook_timeout < WEBHOOK_TIMEOUT_MIN {
            return Err(format!(
                "NEXO_WEBHOOK_TIMEOUT must be at least {}ms",
                WEBHOOK_TIMEOUT_MIN.as_millis()
            ));
        }
        if self.webhook_backoff_max.is_zero() || self.webhook_retry_window.is_zero() {
            return Err(
                "NEXO_WEBHOOK_BACKOFF_MAX and NEXO_WEBHOOK_RETRY_WINDOW must be longer than 0s"
                    .to_owned(),
            );
        }
        Ok(
            (!self.webhook_interval.is_zero()).then(|| crate::webhooks::worker::Settings {
                interval: self.webhook_interval,
                timeout: self.webhook_timeout,
                backoff_max: self.webhook_backoff_max,
                retry_window: self.webhook_retry_window,
                concurrency: usize::try_from(self.webhook_concurrency).unwrap_or(1),
            }),
        )
    }
}

/// A shorter attempt timeout would fail healthy receivers across a slow
/// network.
pub const WEBHOOK_TIMEOUT_MIN: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, clap::Args)]
pub struct ServeConfig {
    /// Address to listen on: host:port, the host a name (localhost) or an
    /// address (0.0.0.0, [::1]). Bound before anything else is done, so a
    /// port in use is reported first.
    #[arg(long, env = "NEXO_BIND", default_value = "127.0.0.1:8080")]
    pub bind: String,
    /// Load the synthetic demo principals and accounts (tokens tok_test_A
    /// and tok_test_B). Never in production.
    #[arg(long)]
    pub demo: bool,
    #[command(flatten)]
    pub idempotency: IdempotencyConfig,
    #[command(flatten)]
    pub http: HttpConfig,
    #[command(flatten)]
    pub purge: PurgeConfig,
    #[command(flatten)]
    pub operations: OperationsConfig,
    #[command(flatten)]
    pub rate_limit: RateLimitConfig,
    #[command(flatten)]
    pub posting: PostingConfig,
    #[command(flatten)]
    pub webhooks: WebhookConfig,
}

/// Durations in humantime form: `30s`, `5m`, `24h`, `1h 30m`.
pub fn parse_duration(value: &str) -> Result<Duration, String> {
    humantime::parse_duration(value)
        .map_err(|e| format!("{e} (expected a duration such as 30s, 5m or 24h)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_in_human_form() {
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert!(parse_duration("thirty").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn reconciliation_is_off_by_default_and_never_back_to_back() {
        let every = |interval| {
            OperationsConfig {
                reconcile_interval: interval,
                admin_token: None,
            }
            .reconcile_every()
        };
        assert_eq!(every(Duration::ZERO), Ok(None));
        assert!(every(Duration::from_secs(5)).is_err());
        assert_eq!(
            every(Duration::from_secs(300)),
            Ok(Some(Duration::from_secs(300)))
        );
    }

    #[test]
    fn webhook_delivery_is_off_at_a_zero_interval_and_refuses_tiny_timeouts() {
        let config = |interval, timeout| WebhookConfig {
            webhook_interval: Duration::from_millis(interval),
            webhook_timeout: Duration::from_millis(timeout),
            webhook_backoff_max: Duration::from_secs(300),
            webhook_retry_window: Duration::from_secs(3 * 86_400),
            webhook_concurrency: 16,
            webhook_ca_file: None,
        };
        assert!(matches!(config(0, 10_000).settings(), Ok(None)));
        assert!(matches!(config(200, 10_000).settings(), Ok(Some(_))));
        assert!(config(200, 50).settings().is_err());
    }

    #[test]
    fn events_are_kept_at_least_an_hour() {
        assert_eq!(parse_event_retention("30days"), Ok(EVENT_RETENTION_DEFAULT));
        assert_eq!(parse_event_retention("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_event_retention("59m").is_err());
        assert!(parse_event_retention("0s").is_err());
    }

    #[test]
    fn the_lease_must_be_shorter_than_the_ttl() {
        let config = IdempotencyConfig {
            idempotency_ttl: Duration::from_secs(10),
            idempotency_lease: Duration::from_secs(30),
            idempotency_retention: Duration::from_secs(3_600),
        };
        assert!(config.policy().is_err());
    }

    #[test]
    fn the_retention_may_not_be_shorter_than_the_ttl() {
        let config = |retention| IdempotencyConfig {
            idempotency_ttl: Duration::from_secs(86_400),
            idempotency_lease: Duration::from_secs(30),
            idempotency_retention: Duration::from_secs(retention),
        };
        assert!(config(3_600).policy().is_err());
        assert!(config(86_400).policy().is_ok());
        assert_eq!(
            parse_duration("400days"),
            Ok(Duration::from_secs(400 * 86_400))
        );
    }
}
