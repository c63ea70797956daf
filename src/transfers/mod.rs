//! The transfers service: everything between an authenticated request and
//! the ledger, without HTTP. `http::transfers` extracts a request, calls
//! [`Transfers::create`], and maps the result to a response; a test or a
//! fuzz target reaches the same code without a socket.
//!
//! - [`intent`]: the request body, its typed intent, canonical form and
//!   fingerprint.
//! - [`checks`]: what is checked against the database before the claim.
//! - [`keys`]: what became of a key, for the lookup.
//! - [`scheduler`]: which queued posting may run next, and admission.
//! - [`posting`]: batches, lock waiters, bounds, shutdown.
//! - [`render`]: a transfer's JSON.

pub mod checks;
pub mod intent;
pub mod keys;
pub mod lifecycle;
pub mod posting;
pub mod render;
pub mod scheduler;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use sqlx::PgPool;
use tracing::Instrument;

use crate::caches::Caches;
use crate::db::replication::Replication;
use crate::db::{self, KeyPool};
use crate::idempotency::claims::ClaimBatcher;
use crate::idempotency::{
    Answer, Claim, ClaimOutcome, Fingerprint, IdempotencyKey, Outcome, Policy, StoredResponse,
    store,
};
use crate::ledger;
use crate::principal::PrincipalId;
use crate::problem::Problem;
use crate::telemetry;
use intent::{Invalid, ROUTE, TransferBody, TransferIntent};
use posting::{ClaimedTransfer, PostingFailure, Postings, Settings};
use scheduler::{Admission, Refusal};

/// What a 409 tells the client to wait: a posting takes milliseconds, so one
/// second is enough for the first request to finish in the normal case.
pub const IN_FLIGHT_RETRY_AFTER_SECS: u64 = 1;

/// An answer to send: stored under the key (or replayed from it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferAnswer {
    pub response: StoredResponse,
    /// Sent with `Idempotent-Replayed: true`.
    pub replayed: bool,
}

impl TransferAnswer {
    pub fn new(response: StoredResponse) -> Self {
        Self {
            response,
            replayed: false,
        }
    }

    pub fn replayed(response: StoredResponse) -> Self {
        Self {
            response,
            replayed: true,
        }
    }
}

/// Refusals decided by the ledger or by a key's history, stored and
/// replayed like a success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    InsufficientFunds,
    KeyReused,
    /// A post or void of a transfer that is no longer pending (or never
    /// was).
    NotPending,
    /// Reversals that would give back more than the transfer moved.
    ReversalExceedsTransfer,
    /// A reversal of a transfer that is not posted (still pending, voided
    /// or expired): refused before the claim.
    NotPosted,
}

impl Rejection {
    const ALL: [Self; 5] = [
        Self::InsufficientFunds,
        Self::KeyReused,
        Self::NotPending,
        Self::ReversalExceedsTransfer,
        Self::NotPosted,
    ];

    /// The rejection whose problem type has this slug.
    pub fn from_slug(slug: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.problem().slug == slug)
    }

    pub fn problem(self) -> Problem {
        match self {
            Self::InsufficientFunds => Problem::new(
                "insufficient-funds",
                "Insufficient funds",
                StatusCode::UNPROCESSABLE_ENTITY,
                "the source account balance cannot cover this transfer",
            )
            .with_param("amount_minor"),
            Self::KeyReused => Problem::new(
                "idempotency-key-reused",
                "Idempotency key reused",
                StatusCode::UNPROCESSABLE_ENTITY,
                "this idempotency key was already used for a different request; use a new key \
                 for a new transfer, or resend the original body to get the original result",
            )
            .with_param("Idempotency-Key"),
            // Fixed text: a refusal compacted past its TTL is rebuilt to the
            // same bytes. The transfer itself says what became of it.
            Self::NotPending => Problem::new(
                "transfer-not-pending",
                "Transfer not pending",
                StatusCode::CONFLICT,
                "only a pending transfer can be posted or voided, and this one is not: it was \
                 posted, voided or expired (GET /transfers/{transfer_id} says which); nothing moved",
            ),
            Self::ReversalExceedsTransfer => Problem::new(
                "reversal-exceeds-transfer",
                "Reversal exceeds the transfer",
                StatusCode::UNPROCESSABLE_ENTITY,
                "the reversals of a transfer cannot give back more than it moved; \
                 GET /transfers/{transfer_id} shows reversed_minor, what was given back so far",
            )
            .with_param("amount_minor"),
            Self::NotPosted => Problem::new(
                "transfer-not-posted",
                "Transfer not posted",
                StatusCode::CONFLICT,
                "only a posted transfer can be reversed; a pending one is voided instead, and a \
                 voided or expired one moved nothing",
            ),
        }
    }
}

/// Why a transfer request got no stored answer.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// The source account is not the caller's (or does not exist: the two
    /// are indistinguishable to the caller).
    #[error("not found")]
    SourceNotFound,
    /// The transfer named in the path is not the caller's to act on (or
    /// does not exist).
    #[error("not found")]
    NotFound,
    /// Refused before the claim, for a reason that will not change.
    #[error("refused: {0:?}")]
    Refused(Rejection),
    /// The key was used for another request.
    #[error("idempotency key reused")]
    KeyReused,
    /// Another request holds the key.
    #[error("a request with this key is in flight")]
    InFlight,
    /// The intent was cancelled by its key (by the request with this id).
    #[error("the intent was cancelled")]
    Cancelled { request_id: Option<String> },
    /// Not posted, and safe to send again: the key is free (or was never
    /// claimed). Carries why, for logs and metrics.
    #[error("not posted: {0}")]
    Retryable(RetryReason),
    #[error("internal error")]
    Internal,
}

/// Why a request may simply be sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RetryReason {
    #[error("the transfer was not posted: too many transfers are queued on one of its accounts")]
    AccountQueueFull,
    #[error("the transfer was not posted: too many transfers are queued")]
    QueueFull,
    #[error("the transfer was not posted: the service is shutting down")]
    ShuttingDown,
    #[error("the transfer was not posted: one of its accounts stayed locked")]
    LockTimeout,
    #[error("the transfer was not posted: it waited too long for its accounts")]
    QueueTimeout,
    #[error("the transfer was not posted: the database is unavailable")]
    Unavailable,
    #[error(
        "the answer is not yet confirmed by a synchronous standby; the retry returns it once it is"
    )]
    NotReplicated,
}

impl From<Refusal> for RetryReason {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::AccountQueueFull => Self::AccountQueueFull,
            Refusal::QueueFull => Self::QueueFull,
            Refusal::Closed => Self::ShuttingDown,
        }
    }
}

impl From<sqlx::Error> for TransferError {
    fn from(e: sqlx::Error) -> Self {
        if matches!(e, sqlx::Error::PoolTimedOut) {
            telemetry::pool_acquire_timeout();
        }
        if db::classify(&e).is_retryable() {
            tracing::warn!(error = %e, "database unavailable");
            Self::Retryable(RetryReason::Unavailable)
        } else {
            tracing::error!(error = %e, "database error");
            Self::Internal
        }
    }
}

/// The transfers service of one instance.
pub struct Transfers {
    pub pool: PgPool,
    pub keys: KeyPool,
    /// Claims arriving together share a statement (ADR-006).
    pub claims: ClaimBatcher,
    pub policy: Policy,
    pub caches: Arc<Caches>,
    /// The `currencies` table, read at start-up: it only changes by migration.
    pub currencies: HashSet<String>,
    pub postings: Arc<Postings>,
    /// Confirms commits on a synchronous standby before they are answered.
    pub replication: Arc<Replication>,
}

/// A request's answer, and how its key was used (none when it was refused
/// before the claim).
type Counted = (Option<KeyOutcome>, Result<TransferAnswer, TransferError>);

/// How the request's key was used, once per request, on its span and in
/// the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyOutcome {
    Claimed,
    TakenOver,
    Replayed,
    Mismatch,
    InFlight,
    FenceLost,
    Failed,
    Cancelled,
}

impl KeyOutcome {
    fn label(self) -> &'static str {
        match self {
            Self::Claimed => "claimed",
            Self::TakenOver => "taken_over",
            Self::Replayed => "replayed",
            Self::Mismatch => "mismatch",
            Self::InFlight => "in_flight",
            Self::FenceLost => "fence_lost",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

impl Transfers {
    /// `strict_replication`: acknowledge only what a synchronous standby
    /// confirmed, even when the primary has none configured.
    pub async fn new(
        pool: PgPool,
        policy: Policy,
        settings: Settings,
        strict_replication: bool,
    ) -> Result<Arc<Self>, sqlx::Error> {
        let currencies = crate::ledger::repo::supported_currencies(&pool).await?;
        let keys = KeyPool::beside(&pool);
        let replication = Replication::start(pool.clone(), strict_replication);
        Ok(Arc::new(Self {
            postings: Postings::new(
                pool.clone(),
                keys.clone(),
                Arc::clone(&replication),
                settings,
            ),
            replication,
            pool,
            claims: ClaimBatcher::start(keys.clone(), policy),
            keys,
            policy,
            caches: Arc::new(Caches::new(policy.ttl)),
            currencies: currencies.into_iter().collect(),
        }))
    }

    /// One transfer intent under its key: refused before the claim, replayed,
    /// or claimed and posted exactly once. `request_id` goes into a refusal
    /// stored under the key, so its replays name the request that got it.
    pub async fn create(
        self: &Arc<Self>,
        principal: PrincipalId,
        key: IdempotencyKey,
        body: &TransferBody,
        request_id: Option<String>,
    ) -> Result<TransferAnswer, TransferError> {
        // Bounded like the HTTP layer bounds it: the id is stored with a
        // refusal, and a column that refused it would fail a whole batch.
        let request_id =
            request_id.filter(|id| crate::problem::acceptable_request_id(id.as_bytes()));
        let counted = match TransferIntent::parse(body) {
            Ok(intent) => {
                self.create_counted(principal, key, intent, request_id)
                    .await
            }
            Err(invalid) => (None, Err(invalid.into())),
        };
        record(counted)
    }

    async fn create_counted(
        self: &Arc<Self>,
        principal: PrincipalId,
        key: IdempotencyKey,
        intent: TransferIntent,
        request_id: Option<String>,
    ) -> (Option<KeyOutcome>, Result<TransferAnswer, TransferError>) {
        if let Err(e) = checks::check_against_accounts(self, principal, &intent).await {
            return (None, Err(e));
        }
        let fingerprint = intent.fingerprint();
        if intent.hold.is_some() {
            return self
                .keyed(
                    principal,
                    key,
                    ROUTE,
                    fingerprint,
                    request_id,
                    lifecycle::Operation::CreateHold(intent),
                )
                .await;
        }
        // An intent completed lately is replayed from memory: no round trip.
        if let Some(stored) = self.caches.replay(principal, key.as_str(), &fingerprint) {
            return (
                Some(KeyOutcome::Replayed),
                Ok(TransferAnswer::replayed(stored)),
            );
        }
        let admission = match self.postings.admit(&intent) {
            Ok(admission) => admission,
            Err(refusal) => return (None, Err(TransferError::Retryable(refusal.into()))),
        };
        // The claim and the wait for the posting run in a task of their own.
        // If the client hangs up, hyper drops this future; were the claim
        // awaited here, a claim committed just before that would be left
        // IN_PROGRESS for a whole lease. Once claimed, the posting layer
        // owns the key and always ends it.
        let task = tokio::spawn(
            Arc::clone(self)
                .claim_and_post(principal, key, fingerprint, intent, admission, request_id)
                .in_current_span(),
        );
        match task.await {
            Ok(done) => done,
            Err(join_error) => {
                tracing::error!(error = %join_error, "transfer task did not finish");
                (Some(KeyOutcome::Failed), Err(TransferError::Internal))
            }
        }
    }

    async fn claim_and_post(
        self: Arc<Self>,
        principal: PrincipalId,
        key: IdempotencyKey,
        fingerprint: Fingerprint,
        intent: TransferIntent,
        admission: Admission,
        request_id: Option<String>,
    ) -> (Option<KeyOutcome>, Result<TransferAnswer, TransferError>) {
        let claim = match self.claim_key(principal, &key, ROUTE, &fingerprint).await {
            Ok(claim) => claim,
            Err(decided) => return decided,
        };
        #[cfg(feature = "failpoints")]
        fail::fail_point!("transfer::after_claim");
        let claimed_as = if claim.took_over {
            KeyOutcome::TakenOver
        } else {
            KeyOutcome::Claimed
        };
        let transfer = ClaimedTransfer {
            claim,
            fingerprint,
            intent,
            request_id,
        };
        let (lost, result) = self.post_resolved(transfer, admission).await;
        let outcome = match &result {
            _ if lost => KeyOutcome::FenceLost,
            Ok(_) => claimed_as,
            Err(_) => KeyOutcome::Failed,
        };
        (Some(outcome), result)
    }

    /// Claims the key for this request, or answers with what the key's
    /// record already decided: a replay, 422, 409 in flight, cancelled.
    async fn claim_key(
        &self,
        principal: PrincipalId,
        key: &IdempotencyKey,
        route: &'static str,
        fingerprint: &Fingerprint,
    ) -> Result<Claim, Counted> {
        let claimed = self
            .claims
            .claim(principal, key, "POST", route, fingerprint)
            .await;
        match claimed {
            Err(e) => Err((None, Err(e.into()))),
            Ok(ClaimOutcome::Replay(answer)) => {
                let replayed = self.replay(principal, key, fingerprint, answer).await;
                Err((Some(KeyOutcome::Replayed), replayed))
            }
            Ok(ClaimOutcome::Mismatch) => {
                Err((Some(KeyOutcome::Mismatch), Err(TransferError::KeyReused)))
            }
            Ok(ClaimOutcome::InFlight { .. }) => {
                Err((Some(KeyOutcome::InFlight), Err(TransferError::InFlight)))
            }
            Ok(ClaimOutcome::Cancelled { request_id }) => {
                // Like a replay: the refusal promises the intent never
                // executes, so it waits for the standby to have the tombstone.
                let refusal = match self.confirm_replicated().await {
                    Ok(()) => TransferError::Cancelled { request_id },
                    Err(_) => TransferError::Retryable(RetryReason::NotReplicated),
                };
                Err((Some(KeyOutcome::Cancelled), Err(refusal)))
            }
            Ok(ClaimOutcome::Claimed(claim)) => Ok(claim),
        }
    }

    /// Posts a transfer whose key this caller claimed, and answers for it:
    /// with the stored answer, or, when its claim was taken over meanwhile,
    /// with the key's completed answer if the other request completed this
    /// same intent (409 while it is still running).
    pub async fn execute_claimed(
        &self,
        transfer: ClaimedTransfer,
        admission: Admission,
    ) -> Result<TransferAnswer, TransferError> {
        self.post_resolved(transfer, admission).await.1
    }

    /// `execute_claimed`, and whether the claim was lost.
    async fn post_resolved(
        &self,
        transfer: ClaimedTransfer,
        admission: Admission,
    ) -> (bool, Result<TransferAnswer, TransferError>) {
        let (principal, key, fingerprint) = (
            transfer.claim.scope,
            transfer.claim.key.clone(),
            transfer.fingerprint,
        );
        match self.post(transfer, admission).await {
            Ok(answer) => (false, Ok(answer)),
            Err(PostingFailure::FenceLost) => (
                true,
                self.after_fence_lost(principal, &key, &fingerprint).await,
            ),
            Err(failure) => (false, Err(failure.into())),
        }
    }

    /// Posts a claimed transfer through the queue and waits for its answer:
    /// at most `lock_timeout` in the queue, then it is withdrawn and its key
    /// FAILED. A started batch always answers (its waits are bounded too).
    pub async fn post(
        &self,
        transfer: ClaimedTransfer,
        admission: Admission,
    ) -> Result<TransferAnswer, PostingFailure> {
        let claim = transfer.claim.clone();
        let (principal, key, fingerprint) = (claim.scope, claim.key.clone(), transfer.fingerprint);
        let mut submitted = match self.postings.submit(transfer, admission) {
            Ok(submitted) => submitted,
            Err(_stopped) => {
                self.postings.release_abandoned(&claim).await;
                return Err(PostingFailure::ShuttingDown);
            }
        };
        let queue_bound = self.postings.settings().lock_timeout;
        let result = match tokio::time::timeout(queue_bound, &mut submitted.answer).await {
            Ok(answer) => answer,
            Err(_) => {
                self.postings
                    .withdraw(&submitted, PostingFailure::QueueTimeout)
                    .await;
                (&mut submitted.answer).await
            }
        };
        let posted = match result {
            Ok(posted) => posted?,
            Err(_closed) => {
                // The batch's task panicked and dropped the job: its
                // transaction rolled back with its connection; the key is
                // released so the retry need not wait out the lease.
                tracing::error!("the posting did not finish");
                self.postings.release_abandoned(&claim).await;
                return Err(PostingFailure::Internal);
            }
        };
        if posted.answer.response.status.is_success() {
            if let Some(id) = posted.transfer_id {
                tracing::Span::current().record("transfer_id", tracing::field::display(id));
            }
            // Committed as COMPLETED: from now on a retry is a replay.
            self.caches.remember_completed(
                principal,
                key.as_str(),
                &fingerprint,
                &posted.answer.response,
            );
        }
        Ok(posted.answer)
    }

    /// A request whose claim was taken over while it waited: the key's
    /// completed answer when the other request finished this same intent,
    /// otherwise 409 (the other request is still running it).
    async fn after_fence_lost(
        &self,
        principal: PrincipalId,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
    ) -> Result<TransferAnswer, TransferError> {
        match store::completed_answer(&self.keys, principal, key, fingerprint).await? {
            Some(answer) => self.replay(principal, key, fingerprint, answer).await,
            None => Err(TransferError::InFlight),
        }
    }

    /// The answer of a key that completed for this same request: its stored
    /// bytes, or, once its record was compacted, the response rebuilt from
    /// its outcome. A completed row another session can see may be a commit
    /// whose replication wait was cancelled: it is replayed only once a
    /// standby has it.
    async fn replay(
        &self,
        principal: PrincipalId,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        answer: Answer,
    ) -> Result<TransferAnswer, TransferError> {
        let stored = match answer {
            Answer::Stored(stored) => stored,
            Answer::Remembered(outcome) => self.rebuild(&outcome).await?,
        };
        self.confirm_replicated()
            .await
            .map_err(|_| TransferError::Retryable(RetryReason::NotReplicated))?;
        self.caches
            .remember_completed(principal, key.as_str(), fingerprint, &stored);
        Ok(TransferAnswer::replayed(stored))
    }

    /// A compacted answer, rebuilt: a transfer's 201 from the transfer
    /// (the same bytes: it renders from the row alone), a refusal from its
    /// problem type and the id of the request it answered (the same bytes:
    /// its text is fixed).
    async fn rebuild(&self, outcome: &Outcome) -> Result<StoredResponse, TransferError> {
        if outcome.status.is_success() {
            let id = outcome.transfer_id.ok_or(TransferError::Internal)?;
            return match ledger::repo::get_transfer(&self.pool, id).await? {
                Some(transfer) => Ok(render::created(&transfer)),
                None => {
                    tracing::error!(%id, "a compact key record names a transfer that does not exist");
                    Err(TransferError::Internal)
                }
            };
        }
        match outcome
            .problem_type
            .as_deref()
            .and_then(Rejection::from_slug)
        {
            Some(rejection) => Ok(rejection
                .problem()
                .with_request_id(outcome.request_id.as_deref())
                .to_stored()),
            None => {
                tracing::error!(problem_type = ?outcome.problem_type, "a compact key record's refusal is of an unknown type");
                Err(TransferError::Internal)
            }
        }
    }

    async fn confirm_replicated(&self) -> Result<(), db::replication::NotReplicated> {
        self.replication
            .confirm(self.postings.settings().replication_timeout)
            .await
    }

    /// Stops admitting transfers, drains the queue until `deadline`, then
    /// releases every claim left (see `Postings::shut_down`).
    pub async fn shut_down(&self, deadline: Duration) {
        self.postings.shut_down(deadline).await;
    }
}

impl From<PostingFailure> for TransferError {
    fn from(f: PostingFailure) -> Self {
        match f {
            PostingFailure::LockTimeout => Self::Retryable(RetryReason::LockTimeout),
            PostingFailure::QueueTimeout => Self::Retryable(RetryReason::QueueTimeout),
            PostingFailure::Unavailable => Self::Retryable(RetryReason::Unavailable),
            PostingFailure::ShuttingDown => Self::Retryable(RetryReason::ShuttingDown),
            PostingFailure::NotReplicated => Self::Retryable(RetryReason::NotReplicated),
            PostingFailure::FenceLost => Self::InFlight,
            PostingFailure::Internal => Self::Internal,
        }
    }
}

/// Notes how the request's key was used (on its span and in the metrics)
/// and what refused it before the claim.
fn record(counted: Counted) -> Result<TransferAnswer, TransferError> {
    let (outcome, result) = counted;
    if let Some(outcome) = outcome {
        tracing::Span::current().record("idempotency_outcome", outcome.label());
        telemetry::idempotency_outcome(outcome.label());
    }
    if let Err(e) = &result
        && let Some(slug) = rejection_slug(e)
    {
        telemetry::transfer_rejected(slug);
    }
    result
}

/// Requests refused before their key was claimed, by problem type.
fn rejection_slug(e: &TransferError) -> Option<&'static str> {
    match e {
        TransferError::Invalid(invalid) => Some(invalid.kind.slug()),
        TransferError::SourceNotFound | TransferError::NotFound => Some("not-found"),
        TransferError::Refused(rejection) => Some(rejection.problem().slug),
        _ => None,
    }
}
