//! The posting layer: claimed transfers wait here for their accounts, are
//! posted in batches, and every one of them ends (COMPLETED or FAILED)
//! within a known time, whatever happens.
//!
//! Why batches: every transfer from an account must hold that account's
//! row lock from its check to its commit, and a commit waits for the WAL
//! flush; one transaction per transfer caps a hot account at a few hundred
//! a second and spends the small machine's CPU on round trips. So a batch
//! takes up to `BATCH_TRANSFERS_MAX` queued transfers whose accounts are
//! free (see `scheduler`), locks all their accounts in id order, posts
//! them in arrival order in one statement, completes every claim (each
//! fenced by its own token) in another, and commits once. Each transfer
//! stays individually idempotent, durable before its answer, and refused
//! alone when it would overdraw. A single transfer is a batch of one: there
//! is one posting path.
//!
//! Why no shared fate: a batch takes its row locks with `SKIP LOCKED`, so
//! it never waits for a lock held outside this instance (an operator's
//! `SELECT … FOR UPDATE`, another instance's batch). The transfers whose
//! accounts it could not lock are handed, grouped by the accounts they
//! share, to a lock waiter: a transaction of their own that waits at most
//! `lock_timeout` and holds only their accounts, so only transfers on those
//! accounts wait behind it.
//!
//! Every wait is bounded: in the queue (the request's `queue_timeout`, then
//! it is withdrawn), on a row lock (`lock_timeout`), on the pool (its
//! acquire timeout), any statement (`db::STATEMENT_TIMEOUT`). When a bound
//! is hit the claims are marked FAILED on the key pool, which does not
//! depend on the main pool that may just have failed, and the client is
//! told to retry (503 with `Retry-After`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio::sync::oneshot;
use uuid::Uuid;

use super::intent::TransferIntent;
use super::render;
use super::scheduler::{Admission, Limits, Refusal, Scheduler};
use super::{Rejection, TransferAnswer};
use crate::config::PostingConfig;
use crate::db::replication::Replication;
use crate::db::{self, Failure, KeyPool};
use crate::idempotency::{Claim, Completing, Fingerprint, StoredResponse, store};
use crate::ledger::events::EventType;
use crate::ledger::repo::{self, KeyLookup, Settled};
use crate::ledger::{LedgerError, LockMode, PostingKind, PostingRequest};
use crate::telemetry;

/// The most transfers one transaction posts. Bounds how long a batch holds
/// its locks, the size of its statements' arrays and how long its first
/// transfer waits for its answer.
pub const BATCH_TRANSFERS_MAX: usize = 32;

/// How many batches may run at once. Fewer make larger batches at a given
/// concurrency, so fewer statements per transfer; on the benchmark
/// machine's two cores four beat eight by a third at 32 and 64 clients and
/// two lost at 64 (ADR-006). Four transactions in flight still join their
/// flushes in group commit. A batch never waits on a row lock, so a slot is
/// held for milliseconds.
pub const BATCHES_RUNNING_MAX: usize = 4;

/// Transfers admitted on one account at once (queued or posting) per
/// instance. Past it a request is refused before its claim with a 503: a
/// queue longer than this would not drain within a client's timeout even on
/// a hot account (about 2,500 transfers/s), and a stuck account must not
/// collect the memory of every retry.
pub const ADMITTED_PER_ACCOUNT_MAX: usize = 256;

/// Transfers admitted in all per instance: about 1 KiB each, so the
/// posting layer's memory stays under a few MiB.
pub const ADMITTED_MAX: usize = 4_096;

/// Serialization failures and deadlocks are retried this many times inside
/// the service before the client sees a 503. Each retry is a fresh
/// transaction, so nothing of a failed attempt survives.
pub const TRANSIENT_RETRIES_MAX: u32 = 3;

/// What `Retry-After` says when the posting layer could not run a transfer
/// (lock, queue, pool, shutdown): long enough for a lock held by a slow
/// transaction to go, short enough for a client's patience.
pub const RETRY_AFTER_SECS: u64 = 1;

/// The posting layer's settings.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Longest a transfer waits for a row lock held outside this instance,
    /// and longest it waits in the queue for its accounts.
    pub lock_timeout: Duration,
    /// Longest an answer waits for a synchronous standby's confirmation.
    pub replication_timeout: Duration,
    /// Lock waiters at once; each holds a connection of the main pool while
    /// it waits, so fewer than the pool's size leaves room for the batches
    /// of unrelated accounts.
    pub lock_waiters_max: usize,
}

impl Settings {
    /// By default half the pool may wait on locks; the other half keeps
    /// posting transfers on other accounts.
    pub fn for_pool(pool_max: u32, config: &PostingConfig) -> Self {
        let waiters = config
            .posting_lock_waiters_max
            .unwrap_or(pool_max / 2)
            .max(1);
        Self {
            lock_timeout: config.posting_lock_timeout,
            replication_timeout: config.replication_timeout,
            lock_waiters_max: usize::try_from(waiters).unwrap_or(1),
        }
    }
}

/// Why a claimed transfer did not get its answer from the posting layer.
/// Every one of them leaves its key FAILED (the request may be sent again)
/// except `FenceLost`, where another request owns the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PostingFailure {
    #[error("the claim was taken over by another request")]
    FenceLost,
    #[error("an account stayed locked past the lock timeout")]
    LockTimeout,
    #[error("the transfer waited in the queue past its bound")]
    QueueTimeout,
    #[error("the database is unavailable")]
    Unavailable,
    #[error("the service is shutting down")]
    ShuttingDown,
    /// Committed, but no synchronous standby confirmed it in time: the key
    /// is COMPLETED, and its retry replays it once it is confirmed.
    #[error("the commit was not confirmed by a synchronous standby in time")]
    NotReplicated,
    #[error("the posting broke an invariant")]
    Internal,
}

impl PostingFailure {
    pub(crate) fn of(error: &sqlx::Error) -> Self {
        match db::classify(error) {
            Failure::LockTimeout => Self::LockTimeout,
            f if f.is_retryable() => Self::Unavailable,
            _ => Self::Internal,
        }
    }
}

/// What the ledger decided for a committed transfer, counted in metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Posted,
    /// A late retry found its transfer: nothing new moved.
    AlreadyPosted,
    /// The key already had a transfer of another intent.
    KeyUsedByOther,
    InsufficientFunds,
}

/// A committed answer.
#[derive(Debug, Clone)]
pub struct Posted {
    pub answer: TransferAnswer,
    pub transfer_id: Option<Uuid>,
    pub decision: Decision,
}

pub type PostingResult = Result<Posted, PostingFailure>;

/// A claimed intent, as the posting layer needs it.
#[derive(Debug, Clone)]
pub struct ClaimedTransfer {
    pub claim: Claim,
    pub fingerprint: Fingerprint,
    pub intent: TransferIntent,
    /// The `x-request-id` of the request that claimed it, for the refusal
    /// stored under its key.
    pub request_id: Option<String>,
}

impl ClaimedTransfer {
    fn request(&self) -> PostingRequest<'_> {
        PostingRequest {
            principal_id: Some(self.claim.scope),
            idempotency_key: self.claim.key.as_str(),
            fingerprint: self.fingerprint.as_bytes(),
            from: self.intent.from.as_str(),
            to: self.intent.to.as_str(),
            amount: self.intent.amount,
            currency: &self.intent.currency,
            description: self.intent.description.as_ref(),
            kind: PostingKind::Transfer,
        }
    }
}

pub struct Job {
    transfer: ClaimedTransfer,
    reply: oneshot::Sender<PostingResult>,
    /// Held until the job ends; frees the request's place in the queue.
    _admission: Admission,
}

/// The queued and running postings of this instance.
pub struct Postings {
    scheduler: Scheduler<Job>,
    pool: PgPool,
    keys: KeyPool,
    replication: Arc<Replication>,
    settings: Settings,
    /// Claims of jobs not yet answered, so that a shutdown past its
    /// deadline can release every one of them. A std Mutex: never held
    /// across an await.
    live: Mutex<Live>,
    idle: tokio::sync::Notify,
}

#[derive(Default)]
struct Live {
    claims: HashMap<Uuid, Claim>,
    /// Set by a shutdown past its deadline: from then on a claim is
    /// released instead of queued. Under the same lock as `claims`, so no
    /// claim can be registered after the shutdown collected them.
    stopped: bool,
}

/// The posting layer has shut down: the caller still owns its claim and
/// must release it.
#[derive(Debug)]
pub struct Stopped;

/// A submitted job: its place in the queue and where its answer arrives.
pub struct Submitted {
    seq: u64,
    pub answer: oneshot::Receiver<PostingResult>,
}

impl Postings {
    pub fn new(
        pool: PgPool,
        keys: KeyPool,
        replication: Arc<Replication>,
        settings: Settings,
    ) -> Arc<Self> {
        Arc::new(Self {
            scheduler: Scheduler::new(Limits {
                batch_transfers_max: BATCH_TRANSFERS_MAX,
                batches_running_max: BATCHES_RUNNING_MAX,
                lock_waiters_max: settings.lock_waiters_max,
                admitted_per_account_max: ADMITTED_PER_ACCOUNT_MAX,
                admitted_max: ADMITTED_MAX,
            }),
            pool,
            keys,
            replication,
            settings,
            live: Mutex::default(),
            idle: tokio::sync::Notify::new(),
        })
    }

    pub fn settings(&self) -> Settings {
        self.settings
    }

    /// A place for a transfer between these accounts, taken before its key
    /// is claimed.
    pub fn admit(&self, intent: &TransferIntent) -> Result<Admission, Refusal> {
        self.scheduler
            .admit(intent.from.as_str(), intent.to.as_str())
    }

    /// Queues a claimed transfer. From here on the posting layer owns the
    /// claim: it completes it or marks it FAILED, whether or not anyone
    /// waits for the answer.
    pub fn submit(
        self: &Arc<Self>,
        transfer: ClaimedTransfer,
        admission: Admission,
    ) -> Result<Submitted, Stopped> {
        {
            let mut live = self.live_state();
            if live.stopped {
                return Err(Stopped);
            }
            live.claims
                .insert(transfer.claim.lock_token, transfer.claim.clone());
        }
        let (reply, answer) = oneshot::channel();
        let (from, to) = (
            transfer.intent.from.as_str().to_owned(),
            transfer.intent.to.as_str().to_owned(),
        );
        let job = Job {
            transfer,
            reply,
            _admission: admission,
        };
        let seq = self.scheduler.enqueue(&from, &to, job);
        self.dispatch();
        Ok(Submitted { seq, answer })
    }

    /// Takes a job that has not started back, fails it (its claim FAILED)
    /// with `failure` and answers it. False when it had already started:
    /// its batch will answer.
    pub async fn withdraw(
        self: &Arc<Self>,
        submitted: &Submitted,
        failure: PostingFailure,
    ) -> bool {
        match self.scheduler.withdraw(submitted.seq) {
            Some(job) => {
                self.fail(vec![job], failure).await;
                true
            }
            None => false,
        }
    }

    /// Marks FAILED the claim of a job that was dropped unanswered (its
    /// batch panicked), and forgets it.
    pub async fn release_abandoned(&self, claim: &Claim) {
        self.live_state().claims.remove(&claim.lock_token);
        if let Err(e) = store::mark_failed_all(&self.keys, &[claim]).await {
            // The lease still frees the key.
            tracing::error!(error = %e, "could not mark the claim FAILED");
        }
    }

    /// Jobs waiting for their accounts, for the metrics.
    pub fn queued(&self) -> usize {
        self.scheduler.queued()
    }

    fn live_state(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts every batch that may start now.
    fn dispatch(self: &Arc<Self>) {
        while let Some(started) = self.scheduler.start_batch() {
            let guard = Running {
                postings: Arc::clone(self),
                accounts: started.accounts.clone(),
                waiter: false,
            };
            tokio::spawn(Arc::clone(self).run_holding(started.jobs, LockMode::SkipLocked, guard));
        }
    }

    /// Answers a job and forgets its claim.
    fn answer(&self, job: Job, result: PostingResult) {
        self.live_state()
            .claims
            .remove(&job.transfer.claim.lock_token);
        let _ = job.reply.send(result);
    }

    /// Marks the jobs' claims FAILED, in one statement on the key pool,
    /// and answers them with `failure`.
    async fn fail(&self, jobs: Vec<Job>, failure: PostingFailure) {
        if jobs.is_empty() {
            return;
        }
        let claims: Vec<&Claim> = jobs.iter().map(|j| &j.transfer.claim).collect();
        if let Err(e) = store::mark_failed_all(&self.keys, &claims).await {
            // The lease still frees the keys.
            tracing::error!(error = %e, claims = claims.len(), "could not mark claims FAILED");
        }
        tracing::warn!(transfers = jobs.len(), %failure, "transfers not posted");
        for job in jobs {
            self.answer(job, Err(failure));
        }
    }

    /// `run`, then the release of the accounts it held. Boxed: a batch's
    /// lock waiters run this too, and a future that spawns itself needs a
    /// named type.
    fn run_holding(
        self: Arc<Self>,
        jobs: Vec<Job>,
        mode: LockMode,
        guard: Running,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(async move {
            self.run(jobs, mode).await;
            drop(guard);
        })
    }

    /// Posts the jobs until each is answered: retries transient failures,
    /// drops fenced-out claims, hands locked-out jobs to lock waiters.
    async fn run(self: &Arc<Self>, mut jobs: Vec<Job>, mode: LockMode) {
        let mut conn = match self.pool.acquire().await {
            Ok(conn) => conn,
            Err(e) => {
                if db::classify(&e) == Failure::Unavailable {
                    telemetry::pool_acquire_timeout();
                }
                return self.fail(jobs, PostingFailure::of(&e)).await;
            }
        };
        let mut lookup = KeyLookup::Optimistic;
        let mut transient_retries = 0;
        while !jobs.is_empty() {
            match self.attempt(&mut conn, &jobs, mode, lookup).await {
                Ok(Attempt::Committed(results, deferred)) => {
                    let (done, waiting) = split(jobs, &deferred);
                    // Answered only from a commit a synchronous standby has.
                    let replicated = if done.is_empty() {
                        Ok(())
                    } else {
                        self.replication
                            .confirm(self.settings.replication_timeout)
                            .await
                    };
                    for (job, result) in done.into_iter().zip(results) {
                        match replicated {
                            Ok(()) => self.answer(job, Ok(result)),
                            Err(_) => self.answer(job, Err(PostingFailure::NotReplicated)),
                        }
                    }
                    return self.wait_for_locks(waiting).await;
                }
                Ok(Attempt::Fenced(lost)) => {
                    let (rest, fenced) = split(jobs, &lost);
                    for job in fenced {
                        self.answer(job, Err(PostingFailure::FenceLost));
                    }
                    jobs = rest;
                }
                Err(AttemptError::Ledger(LedgerError::KeyAlreadyUsed))
                    if lookup == KeyLookup::Optimistic =>
                {
                    lookup = KeyLookup::First;
                }
                Err(AttemptError::Ledger(LedgerError::Database(e)))
                    if db::classify(&e) == Failure::Transient
                        && transient_retries < TRANSIENT_RETRIES_MAX =>
                {
                    transient_retries += 1;
                    tracing::warn!(attempt = transient_retries, error = %e, "transient database failure, retrying the batch");
                    tokio::time::sleep(Duration::from_millis(5 * u64::from(transient_retries)))
                        .await;
                }
                Err(AttemptError::Ledger(LedgerError::Database(e))) => {
                    let failure = PostingFailure::of(&e);
                    if failure == PostingFailure::Internal {
                        tracing::error!(error = %e, "posting failed");
                    }
                    return self.fail(jobs, failure).await;
                }
                Err(AttemptError::Ledger(e)) => {
                    tracing::error!(error = %e, "posting broke an invariant");
                    return self.fail(jobs, PostingFailure::Internal).await;
                }
            }
        }
    }

    /// Jobs whose accounts another transaction holds: each group of jobs
    /// that share accounts waits in a transaction of its own, bounded by
    /// `lock_timeout`, holding only its own accounts in the scheduler.
    async fn wait_for_locks(self: &Arc<Self>, jobs: Vec<Job>) {
        for group in groups_sharing_accounts(jobs) {
            let accounts = accounts_of(&group);
            if !self.scheduler.start_waiter(&accounts) {
                self.fail(group, PostingFailure::LockTimeout).await;
                continue;
            }
            let guard = Running {
                postings: Arc::clone(self),
                accounts,
                waiter: true,
            };
            tokio::spawn(Arc::clone(self).run_holding(group, LockMode::Wait, guard));
        }
    }

    /// One transaction over the jobs. Returns the answers of the jobs it
    /// posted (in order, skipping the deferred ones) and the positions of
    /// the jobs whose accounts it could not lock; or the positions of the
    /// claims it lost, after rolling everything back.
    async fn attempt(
        &self,
        conn: &mut PoolConnection<Postgres>,
        jobs: &[Job],
        mode: LockMode,
        lookup: KeyLookup,
    ) -> Result<Attempt, AttemptError> {
        let mut tx = sqlx::Connection::begin(&mut **conn).await.map_err(ledger)?;
        if mode == LockMode::Wait {
            sqlx::query("SELECT set_config('lock_timeout', $1, true)")
                .bind(format!(
                    "{}ms",
                    self.settings.lock_timeout.as_millis().max(1)
                ))
                .execute(&mut *tx)
                .await
                .map_err(ledger)?;
        }
        let requests: Vec<PostingRequest<'_>> = jobs.iter().map(|j| j.transfer.request()).collect();
        let mut ids: Vec<&str> = requests.iter().flat_map(|r| [r.from, r.to]).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut locked = repo::lock_accounts(&mut tx, &ids, mode)
            .await
            .map_err(ledger)?;
        let locked_ids: HashSet<&str> = locked.iter().map(|a| a.id.as_str()).collect();
        let deferred: Vec<usize> = match mode {
            LockMode::SkipLocked => (0..jobs.len())
                .filter(|&i| {
                    ![requests[i].from, requests[i].to]
                        .iter()
                        .all(|a| locked_ids.contains(a))
                })
                .collect(),
            LockMode::Wait => Vec::new(),
        };
        let ready: Vec<usize> = (0..jobs.len()).filter(|i| !deferred.contains(i)).collect();
        if ready.is_empty() {
            return Ok(Attempt::Committed(Vec::new(), deferred));
        }
        let ready_requests: Vec<PostingRequest<'_>> =
            ready.iter().map(|&i| requests[i].clone()).collect();
        let outcomes = repo::post_locked(&mut tx, &ready_requests, &mut locked, lookup).await?;
        let settled: Vec<Settlement> = ready
            .iter()
            .zip(outcomes)
            .map(|(&i, outcome)| {
                settle(
                    &jobs[i].transfer,
                    outcome.settle(jobs[i].transfer.fingerprint.as_bytes()),
                )
            })
            .collect();
        let completions: Vec<Completing<'_>> = ready
            .iter()
            .zip(&settled)
            .map(|(&i, s)| Completing {
                claim: &jobs[i].transfer.claim,
                fingerprint: &s.stored_fingerprint,
                response: &s.stored,
                problem_type: s.stored_problem_type,
                request_id: s
                    .stored_problem_type
                    .and(jobs[i].transfer.request_id.as_deref()),
                transfer_id: s.posted.transfer_id,
            })
            .collect();
        let completed = store::complete_all(&mut tx, &completions)
            .await
            .map_err(ledger)?;
        if completed.len() != ready.len() {
            // Dropping the transaction rolls back every posting in it.
            let held: HashSet<Uuid> = completed.into_iter().collect();
            let lost = ready
                .into_iter()
                .filter(|&i| !held.contains(&jobs[i].transfer.claim.lock_token))
                .collect();
            return Ok(Attempt::Fenced(lost));
        }
        #[cfg(feature = "failpoints")]
        fail::fail_point!("posting::before_commit");
        tx.commit().await.map_err(ledger)?;
        #[cfg(feature = "failpoints")]
        fail::fail_point!("posting::after_commit");
        for s in &settled {
            count(s.posted.decision);
        }
        Ok(Attempt::Committed(
            settled.into_iter().map(|s| s.posted).collect(),
            deferred,
        ))
    }

    /// Stops admitting, lets queued and running work finish until
    /// `deadline`, then fails what is still queued and releases every claim
    /// still unanswered, so that no key is left IN_PROGRESS by this
    /// instance. A transaction still running past the deadline cannot
    /// commit its claims after that: their completion is fenced on
    /// IN_PROGRESS. A claim made after that is released at once.
    pub async fn shut_down(self: &Arc<Self>, deadline: Duration) {
        self.scheduler.close();
        let drained = tokio::time::timeout(deadline, async {
            while !self.scheduler.is_idle() {
                let notified = self.idle.notified();
                if self.scheduler.is_idle() {
                    break;
                }
                // Woken when work finishes; the timer covers a wake-up lost
                // between the check and the wait.
                let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
            }
        })
        .await;
        let running: Vec<Claim> = {
            let mut live = self.live_state();
            live.stopped = true;
            live.claims.values().cloned().collect()
        };
        if drained.is_ok() && running.is_empty() {
            return;
        }
        let queued = self.scheduler.withdraw_all();
        tracing::warn!(
            queued = queued.len(),
            running = running.len(),
            "shutdown deadline reached, failing what is left"
        );
        self.fail(queued, PostingFailure::ShuttingDown).await;
        let claims: Vec<&Claim> = running.iter().collect();
        match store::mark_failed_all(&self.keys, &claims).await {
            Ok(released) => tracing::warn!(released, "released the claims of unfinished postings"),
            Err(e) => tracing::error!(error = %e, "could not release unfinished claims"),
        }
    }
}

/// Running work's hold on its accounts. Released on drop, also when the
/// task panics, so a panicking batch never leaves accounts held; the jobs
/// it dropped answer their callers with a closed channel.
struct Running {
    postings: Arc<Postings>,
    accounts: Vec<String>,
    waiter: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.waiter {
            self.postings.scheduler.finish_waiter(&self.accounts);
        } else {
            self.postings.scheduler.finish_batch(&self.accounts);
        }
        self.postings.dispatch();
        if self.postings.scheduler.is_idle() {
            self.postings.idle.notify_waiters();
        }
    }
}

enum Attempt {
    /// Answers of the posted jobs, and positions of the deferred ones.
    Committed(Vec<Posted>, Vec<usize>),
    /// Positions of the claims taken over; nothing was committed.
    Fenced(Vec<usize>),
}

enum AttemptError {
    Ledger(LedgerError),
}

impl From<LedgerError> for AttemptError {
    fn from(e: LedgerError) -> Self {
        Self::Ledger(e)
    }
}

fn ledger(e: sqlx::Error) -> AttemptError {
    AttemptError::Ledger(LedgerError::Database(e))
}

/// What a job's key is completed with, and what its request is answered.
struct Settlement {
    stored: StoredResponse,
    /// The request's own fingerprint, or that of the intent whose transfer
    /// the key already has, so that intent's retries keep replaying it.
    stored_fingerprint: Fingerprint,
    /// The slug of the stored answer's problem type, when it is a refusal.
    stored_problem_type: Option<&'static str>,
    posted: Posted,
}

fn settle(transfer: &ClaimedTransfer, settled: Settled) -> Settlement {
    let own = transfer.fingerprint;
    let mut stored_problem_type = None;
    let (stored, stored_fingerprint, answer, transfer_id, decision) = match settled {
        Settled::Posted(t) => {
            let stored = render::created(&t);
            (
                stored.clone(),
                own,
                TransferAnswer::new(stored),
                Some(t.id),
                Decision::Posted,
            )
        }
        Settled::Replayed(t) => {
            let stored = render::created(&t);
            (
                stored.clone(),
                own,
                TransferAnswer::replayed(stored),
                Some(t.id),
                Decision::AlreadyPosted,
            )
        }
        Settled::KeyUsedByOther(t) => {
            let theirs = Fingerprint::from_bytes(&t.request_fingerprint).unwrap_or(own);
            let refusal = TransferAnswer::new(
                Rejection::KeyReused
                    .problem()
                    .with_request_id(transfer.request_id.as_deref())
                    .to_stored(),
            );
            (
                render::created(&t),
                theirs,
                refusal,
                Some(t.id),
                Decision::KeyUsedByOther,
            )
        }
        Settled::InsufficientFunds => {
            stored_problem_type = Some(Rejection::InsufficientFunds.problem().slug);
            let stored = Rejection::InsufficientFunds
                .problem()
                .with_request_id(transfer.request_id.as_deref())
                .to_stored();
            (
                stored.clone(),
                own,
                TransferAnswer::new(stored),
                None,
                Decision::InsufficientFunds,
            )
        }
    };
    Settlement {
        stored,
        stored_fingerprint,
        stored_problem_type,
        posted: Posted {
            answer,
            transfer_id,
            decision,
        },
    }
}

/// Counted once its transaction committed: a rolled-back attempt moved
/// nothing.
fn count(decision: Decision) {
    match decision {
        Decision::Posted => {
            telemetry::transfer_posted();
            telemetry::events_written(EventType::TransferPosted, 1);
        }
        Decision::InsufficientFunds => telemetry::transfer_rejected("insufficient-funds"),
        Decision::KeyUsedByOther => telemetry::transfer_rejected("idempotency-key-reused"),
        Decision::AlreadyPosted => {}
    }
}

/// Splits jobs into the rest and those at `positions`, keeping order.
fn split(jobs: Vec<Job>, positions: &[usize]) -> (Vec<Job>, Vec<Job>) {
    let (picked, rest): (Vec<_>, Vec<_>) = jobs
        .into_iter()
        .enumerate()
        .partition(|(i, _)| !positions.contains(i));
    (
        picked.into_iter().map(|(_, j)| j).collect(),
        rest.into_iter().map(|(_, j)| j).collect(),
    )
}

fn accounts_of(jobs: &[Job]) -> Vec<String> {
    let mut accounts: Vec<String> = jobs
        .iter()
        .flat_map(|j| {
            [
                j.transfer.intent.from.as_str().to_owned(),
                j.transfer.intent.to.as_str().to_owned(),
            ]
        })
        .collect();
    accounts.sort_unstable();
    accounts.dedup();
    accounts
}

/// Groups jobs so that two jobs sharing an account (directly or through
/// others) are in one group, keeping arrival order within each.
fn groups_sharing_accounts(jobs: Vec<Job>) -> Vec<Vec<Job>> {
    let mut groups: Vec<(HashSet<String>, Vec<Job>)> = Vec::new();
    for job in jobs {
        let mine: HashSet<String> = [
            job.transfer.intent.from.as_str().to_owned(),
            job.transfer.intent.to.as_str().to_owned(),
        ]
        .into();
        let (touching, mut apart): (Vec<_>, Vec<_>) = groups
            .into_iter()
            .partition(|(accounts, _)| !accounts.is_disjoint(&mine));
        let mut merged = (mine, Vec::new());
        for (accounts, group) in touching {
            merged.0.extend(accounts);
            merged.1.extend(group);
        }
        merged.1.push(job);
        apart.push(merged);
        groups = apart;
    }
    groups.into_iter().map(|(_, group)| group).collect()
}
