//! Acknowledged means replicated. With synchronous replication a commit
//! returns once a standby has it, unless its wait was cancelled (a
//! statement timeout, `pg_cancel_backend`, a dropped connection):
//! PostgreSQL then keeps the commit, says so only with a WARNING that sqlx
//! does not surface, and the row vanishes if the primary fails over. So an
//! answer that promises an outcome (a 201, a stored 422, a replay) is given
//! only once the standby has confirmed WAL at or past the commit.
//!
//! WAL is ordered: a standby that flushed up to L has every commit before
//! L. One watcher reads the primary's insert position once per round (L,
//! later than every commit that asked before the round began) and waits
//! until a synchronous standby's `flush_lsn` reaches it; every caller that
//! asked before the round began is then confirmed at once. A round costs
//! two statements, whatever the number of callers.
//!
//! When the primary has no synchronous standby configured
//! (`synchronous_standby_names` empty: a single server, or pg_auto_failover
//! while its standby is away) there is nothing to wait for, unless the
//! service is told to require a standby (`NEXO_REQUIRE_SYNC_STANDBY`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{Notify, watch};

use super::PRIMARY_SWITCHES;

/// How often the watcher re-reads whether the primary has a synchronous
/// standby, when nobody waits.
pub const SETTING_REFRESH: Duration = Duration::from_secs(1);

/// Pause between two reads of the standby's position within a round.
pub const POLL_INTERVAL: Duration = Duration::from_millis(1);

/// A commit could not be confirmed on a standby within the bound: it may
/// still be there, or be lost at a failover. The caller answers 503 and the
/// client's retry replays it once it is confirmed, or executes it anew on a
/// primary that never had it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the commit was not confirmed by a synchronous standby in time")]
pub struct NotReplicated;

/// A confirmed round: its number, and the primary it was read on.
#[derive(Debug, Clone, Copy, Default)]
struct Confirmed {
    round: u64,
    switches: u64,
}

pub struct Replication {
    pool: PgPool,
    /// Wait for a standby even when the primary has none configured.
    strict: bool,
    /// The primary has a synchronous standby configured (or `strict`).
    required: AtomicBool,
    rounds_started: AtomicU64,
    confirmed: watch::Sender<Confirmed>,
    waiting: AtomicUsize,
    wake: Notify,
}

impl Replication {
    /// Starts the watcher on `pool`.
    pub fn start(pool: PgPool, strict: bool) -> Arc<Self> {
        let replication = Arc::new(Self {
            pool,
            strict,
            required: AtomicBool::new(strict),
            rounds_started: AtomicU64::new(0),
            confirmed: watch::Sender::new(Confirmed::default()),
            waiting: AtomicUsize::new(0),
            wake: Notify::new(),
        });
        tokio::spawn(Arc::clone(&replication).watch());
        replication
    }

    /// Returns once every commit this caller made before calling is on a
    /// synchronous standby, or fails after `bound`.
    pub async fn confirm(&self, bound: Duration) -> Result<(), NotReplicated> {
        if !self.required.load(Ordering::SeqCst) {
            return Ok(());
        }
        let switches = PRIMARY_SWITCHES.load(Ordering::SeqCst);
        let needed = self.rounds_started.load(Ordering::SeqCst) + 1;
        let mut confirmed = self.confirmed.subscribe();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        self.wake.notify_one();
        let outcome = tokio::time::timeout(
            bound,
            confirmed.wait_for(|c| c.round >= needed || c.switches != switches),
        )
        .await;
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        match outcome {
            Ok(Ok(c)) if c.switches == switches => Ok(()),
            _ => Err(NotReplicated),
        }
    }

    async fn watch(self: Arc<Self>) {
        loop {
            if self.waiting.load(Ordering::SeqCst) == 0 {
                let _ = tokio::time::timeout(SETTING_REFRESH, self.wake.notified()).await;
                if self.pool.is_closed() {
                    return;
                }
                if self.waiting.load(Ordering::SeqCst) == 0 {
                    if let Ok(required) = self.standby_configured().await {
                        self.required
                            .store(required || self.strict, Ordering::SeqCst);
                    }
                    continue;
                }
            }
            let switches = PRIMARY_SWITCHES.load(Ordering::SeqCst);
            let round = self.rounds_started.fetch_add(1, Ordering::SeqCst) + 1;
            match self.round().await {
                Ok(true) => {
                    self.confirmed.send_replace(Confirmed { round, switches });
                }
                // Every caller gave up before the standby caught up.
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "could not read the standby's position");
                    tokio::time::sleep(POLL_INTERVAL * 10).await;
                }
            }
        }
    }

    /// One round: the primary's insert position now, then the standby's
    /// flush position until it reaches it (bounded by the callers' own
    /// bounds: when they all gave up, the round ends unconfirmed).
    async fn round(&self) -> Result<bool, sqlx::Error> {
        let (target, required): (String, bool) = sqlx::query_as(
            "SELECT pg_current_wal_insert_lsn()::text,
                    current_setting('synchronous_standby_names') <> ''",
        )
        .fetch_one(&self.pool)
        .await?;
        self.required
            .store(required || self.strict, Ordering::SeqCst);
        if !required && !self.strict {
            return Ok(true);
        }
        loop {
            let reached: bool = sqlx::query_scalar(
                "SELECT coalesce(max(flush_lsn) >= $1::pg_lsn, false)
                 FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')",
            )
            .bind(&target)
            .fetch_one(&self.pool)
            .await?;
            if reached {
                return Ok(true);
            }
            if self.waiting.load(Ordering::SeqCst) == 0 {
                return Ok(false);
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    async fn standby_configured(&self) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar("SELECT current_setting('synchronous_standby_names') <> ''")
            .fetch_one(&self.pool)
            .await
    }
}
