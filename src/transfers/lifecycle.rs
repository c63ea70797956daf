//! Holds: a pending transfer is created (`POST /transfers` with `mode:
//! pending`), then posted or voided, each under its own idempotency key,
//! or expired by a background task.
//!
//! Each of these is one transaction that locks what it changes (the hold's
//! row, then its accounts in id order), decides under those locks, writes,
//! and completes its key, fenced by the claim's token, in the same commit:
//! the same promise as a transfer (one effect per key, the same answer on
//! every retry, 409 while in flight, 422 on reuse). They do not go through
//! the batching queue: they are rarer than transfers, and a hold's row lock
//! is what orders a post, a void and the expiry racing on one hold. Every
//! lock wait is bounded by the posting layer's `lock_timeout`, and a claim
//! ends COMPLETED or FAILED whatever happens (a panic included).

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use tracing::Instrument;
use uuid::Uuid;

use super::intent::{Invalid, TransferBody, TransferIntent, ValidationKind};
use super::posting::{PostingFailure, TRANSIENT_RETRIES_MAX};
use super::{Counted, KeyOutcome, Rejection, TransferAnswer, TransferError, Transfers, render};
use crate::db::{self, Failure};
use crate::idempotency::{Claim, Completing, Fingerprint, IdempotencyKey, StoredResponse, store};
use crate::ledger::events::EventType;
use crate::ledger::holds::{self, Hold, HoldOutcome, HoldRequest, HoldStatus, Resolution};
use crate::ledger::reversals::{self, BatchOutcome, KeyUse, Leg, ReversalOutcome, ReversalRequest};
use crate::ledger::{self, AmountMinor, Description, LedgerError};
use crate::principal::PrincipalId;
use crate::telemetry;

/// The route templates that enter the fingerprints.
pub const POST_ROUTE: &str = "/transfers/{transfer_id}/post";
pub const VOID_ROUTE: &str = "/transfers/{transfer_id}/void";
pub const REVERSE_ROUTE: &str = "/transfers/{transfer_id}/reverse";
pub const BATCH_ROUTE: &str = render::BATCH_ROUTE;

/// The body of `POST /transfers/{transfer_id}/post`. Without an amount the
/// whole hold is posted; with a smaller one the rest is released.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostBody {
    #[serde(default)]
    pub amount_minor: Option<i64>,
}

/// The body of `POST /transfers/{transfer_id}/reverse`. Without an amount
/// whatever the earlier reversals left is given back.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReverseBody {
    #[serde(default)]
    pub amount_minor: Option<i64>,
    #[serde(default)]
    pub description: Option<String>,
}

/// The body of `POST /transfer-batches`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchBody {
    pub transfers: Vec<TransferBody>,
}

/// The body of `POST /transfers/{transfer_id}/void`: nothing to say.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VoidBody {}

/// What a keyed lifecycle request does once its key is claimed.
#[derive(Debug, Clone)]
pub enum Operation {
    CreateHold(TransferIntent),
    Post { hold: Uuid, amount: AmountMinor },
    Void { hold: Uuid },
    Reverse(ReversalIntent),
    Batch(Vec<TransferIntent>),
}

/// Canonical forms of a post, a void and a reversal: the transfer, and the
/// amount resolved (for a post, an absent amount is the whole hold, the same
/// intent as spelling it out), and a reversal's description.
#[derive(Serialize)]
struct CanonicalResolution<'a> {
    transfer_id: Uuid,
    #[serde(skip_serializing_if = "Option::is_none")]
    amount_minor: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    description: Option<&'a str>,
}

fn resolution_fingerprint(route: &str, canonical: &CanonicalResolution<'_>) -> Fingerprint {
    Fingerprint::compute(
        "POST",
        route,
        &serde_json::to_vec(canonical).unwrap_or_default(),
    )
}

/// What one transaction decided for its key.
struct Decided {
    /// What the key is completed with, under `stored_fingerprint`.
    stored: StoredResponse,
    stored_fingerprint: Fingerprint,
    /// What this request is answered (differs from `stored` only when the
    /// key turned out to belong to another intent).
    answer: TransferAnswer,
    problem_type: Option<&'static str>,
    transfer_id: Option<Uuid>,
    /// What happened to holds, counted once committed.
    hold_events: Vec<&'static str>,
    /// Transfers it posted, counted once committed.
    transfers_posted: usize,
    /// The events it wrote, counted once committed.
    events: Vec<(EventType, u64)>,
}

impl Decided {
    fn counting(mut self, event: &'static str) -> Self {
        self.hold_events.push(event);
        self
    }

    fn posting(mut self, transfers: usize) -> Self {
        self.transfers_posted += transfers;
        self
    }

    fn announcing(mut self, event: EventType, count: usize) -> Self {
        self.events
            .push((event, u64::try_from(count).unwrap_or(u64::MAX)));
        self
    }

    /// `transfer_id`: what this key made, which its record names.
    fn answered(
        stored: StoredResponse,
        fingerprint: Fingerprint,
        transfer_id: Option<Uuid>,
    ) -> Self {
        Self {
            answer: TransferAnswer::new(stored.clone()),
            stored,
            stored_fingerprint: fingerprint,
            problem_type: None,
            transfer_id,
            hold_events: Vec::new(),
            transfers_posted: 0,
            events: Vec::new(),
        }
    }

    /// A late retry of the request that did this: the same answer again.
    fn replayed(
        stored: StoredResponse,
        fingerprint: Fingerprint,
        transfer_id: Option<Uuid>,
    ) -> Self {
        Self {
            answer: TransferAnswer::replayed(stored.clone()),
            ..Self::answered(stored, fingerprint, transfer_id)
        }
    }

    /// A refusal, stored under the request's own fingerprint. Its record
    /// names no transfer: a key's record names only what that key created.
    fn refused(rejection: Rejection, fingerprint: Fingerprint, request_id: Option<&str>) -> Self {
        let stored = rejection.problem().with_request_id(request_id).to_stored();
        Self::refused_with(stored, rejection, fingerprint)
    }

    /// A refusal whose document says more than its type's fixed text.
    fn refused_with(
        stored: StoredResponse,
        rejection: Rejection,
        fingerprint: Fingerprint,
    ) -> Self {
        Self {
            answer: TransferAnswer::new(stored.clone()),
            stored,
            stored_fingerprint: fingerprint,
            problem_type: Some(rejection.problem().slug),
            transfer_id: None,
            hold_events: Vec::new(),
            transfers_posted: 0,
            events: Vec::new(),
        }
    }

    /// The key already belongs to another intent, whose answer it keeps
    /// (under that intent's fingerprint); this request is refused.
    fn key_used_by(
        theirs: StoredResponse,
        their_fingerprint: &[u8],
        own: Fingerprint,
        request_id: Option<&str>,
        transfer_id: Option<Uuid>,
    ) -> Self {
        Self {
            answer: TransferAnswer::new(
                Rejection::KeyReused
                    .problem()
                    .with_request_id(request_id)
                    .to_stored(),
            ),
            stored: theirs,
            stored_fingerprint: Fingerprint::from_bytes(their_fingerprint).unwrap_or(own),
            problem_type: None,
            transfer_id,
            hold_events: Vec::new(),
            transfers_posted: 0,
            events: Vec::new(),
        }
    }
}

enum Attempted {
    Ledger(LedgerError),
    /// The claim was taken over: nothing was committed.
    Fenced,
}

impl From<LedgerError> for Attempted {
    fn from(e: LedgerError) -> Self {
        Self::Ledger(e)
    }
}

impl From<sqlx::Error> for Attempted {
    fn from(e: sqlx::Error) -> Self {
        Self::Ledger(LedgerError::Database(e))
    }
}

/// Marks the claim FAILED if the request's task ends without settling it
/// (a panic): the key is free at once instead of after its lease.
struct Unsettled {
    claim: Option<Claim>,
    keys: db::KeyPool,
}

impl Drop for Unsettled {
    fn drop(&mut self) {
        if let Some(claim) = self.claim.take() {
            let keys = self.keys.clone();
            tokio::spawn(async move {
                if let Err(e) = store::mark_failed_all(&keys, &[&claim]).await {
                    tracing::error!(error = %e, "could not release an abandoned claim");
                }
            });
        }
    }
}

impl Transfers {
    /// `POST /transfers/{transfer_id}/post`: posts a pending transfer, in
    /// full or in part, under the request's key.
    pub async fn post_hold(
        self: &Arc<Self>,
        principal: PrincipalId,
        key: IdempotencyKey,
        transfer_id: &str,
        body: &PostBody,
        request_id: Option<String>,
    ) -> Result<TransferAnswer, TransferError> {
        let checked = self
            .post_target(principal, transfer_id, body)
            .await
            .map(|(hold, amount)| {
                let fingerprint = resolution_fingerprint(
                    POST_ROUTE,
                    &CanonicalResolution {
                        transfer_id: hold.id,
                        amount_minor: Some(amount.get()),
                        description: None,
                    },
                );
                let op = Operation::Post {
                    hold: hold.id,
                    amount,
                };
                (fingerprint, op)
            });
        self.run_checked(principal, key, POST_ROUTE, request_id, checked)
            .await
    }

    /// `POST /transfers/{transfer_id}/void`: releases a pending transfer's
    /// hold under the request's key; nothing moves.
    pub async fn void_hold(
        self: &Arc<Self>,
        principal: PrincipalId,
        key: IdempotencyKey,
        transfer_id: &str,
        request_id: Option<String>,
    ) -> Result<TransferAnswer, TransferError> {
        let checked = self.own_hold(principal, transfer_id).await.map(|hold| {
            let fingerprint = resolution_fingerprint(
                VOID_ROUTE,
                &CanonicalResolution {
                    transfer_id: hold.id,
                    amount_minor: None,
                    description: None,
                },
            );
            (fingerprint, Operation::Void { hold: hold.id })
        });
        self.run_checked(principal, key, VOID_ROUTE, request_id, checked)
            .await
    }

    /// `POST /transfers/{transfer_id}/reverse`: gives (part of) a posted
    /// transfer back, from its destination to its source, under the
    /// request's key.
    pub async fn reverse_transfer(
        self: &Arc<Self>,
        principal: PrincipalId,
        key: IdempotencyKey,
        transfer_id: &str,
        body: &ReverseBody,
        request_id: Option<String>,
    ) -> Result<TransferAnswer, TransferError> {
        let checked = self
            .reversal_target(principal, transfer_id, body)
            .await
            .map(|intent| {
                let fingerprint = resolution_fingerprint(
                    REVERSE_ROUTE,
                    &CanonicalResolution {
                        transfer_id: intent.original,
                        amount_minor: intent.amount.map(AmountMinor::get),
                        description: intent.description.as_ref().map(Description::as_str),
                    },
                );
                (fingerprint, Operation::Reverse(intent))
            });
        self.run_checked(principal, key, REVERSE_ROUTE, request_id, checked)
            .await
    }

    /// `POST /transfer-batches`: every transfer posts, or none does.
    pub async fn create_batch(
        self: &Arc<Self>,
        principal: PrincipalId,
        key: IdempotencyKey,
        body: &BatchBody,
        request_id: Option<String>,
    ) -> Result<TransferAnswer, TransferError> {
        let checked = self.batch_legs(principal, body).await.map(|legs| {
            let mut canonical = b"[".to_vec();
            for (n, leg) in legs.iter().enumerate() {
                if n > 0 {
                    canonical.push(b',');
                }
                canonical.extend(leg.canonical_bytes());
            }
            canonical.push(b']');
            let fingerprint = Fingerprint::compute("POST", BATCH_ROUTE, &canonical);
            (fingerprint, Operation::Batch(legs))
        });
        self.run_checked(principal, key, BATCH_ROUTE, request_id, checked)
            .await
    }

    /// Runs an operation whose request was checked under its key, or
    /// answers why it was not (nothing claimed); either way the outcome is
    /// counted.
    async fn run_checked(
        self: &Arc<Self>,
        principal: PrincipalId,
        key: IdempotencyKey,
        route: &'static str,
        request_id: Option<String>,
        checked: Result<(Fingerprint, Operation), TransferError>,
    ) -> Result<TransferAnswer, TransferError> {
        let counted = match checked {
            Ok((fingerprint, op)) => {
                self.keyed(principal, key, route, fingerprint, request_id, op)
                    .await
            }
            Err(e) => (None, Err(e)),
        };
        super::record(counted)
    }

    /// What a reversal asks, checked before the claim. Only the owner of the
    /// transfer's destination may give its money back; to anyone else the
    /// transfer does not exist.
    async fn reversal_target(
        &self,
        principal: PrincipalId,
        transfer_id: &str,
        body: &ReverseBody,
    ) -> Result<ReversalIntent, TransferError> {
        let id = Uuid::parse_str(transfer_id).map_err(|_| TransferError::NotFound)?;
        let Some(original) = ledger::repo::get_transfer(&self.pool, id).await? else {
            return match holds::get(&self.pool, id).await? {
                Some(hold) if self.owns(principal, &hold.to_account).await? => {
                    Err(TransferError::Refused(Rejection::NotPosted))
                }
                _ => Err(TransferError::NotFound),
            };
        };
        // An operator's deposit is undone by the operator, not by its
        // recipient.
        if original.principal_id.is_none() || !self.owns(principal, &original.to_account).await? {
            return Err(TransferError::NotFound);
        }
        let amount = body
            .amount_minor
            .map(|requested| {
                let amount = AmountMinor::parse(requested).map_err(|e| {
                    Invalid::new(ValidationKind::InvalidAmount, "amount_minor", e.to_string())
                })?;
                if amount.get() > original.amount_minor {
                    return Err(Invalid::new(
                        ValidationKind::InvalidAmount,
                        "amount_minor",
                        format!(
                            "amount_minor must not exceed the transfer's amount, {}",
                            original.amount_minor
                        ),
                    ));
                }
                Ok(amount)
            })
            .transpose()?;
        let description = super::intent::parse_description(body.description.as_deref())?;
        Ok(ReversalIntent {
            original: id,
            amount,
            description,
        })
    }

    async fn owns(&self, principal: PrincipalId, account: &str) -> Result<bool, sqlx::Error> {
        Ok(ledger::repo::get_account(&self.pool, account)
            .await?
            .is_some_and(|a| a.principal_id == Some(principal)))
    }

    /// A batch's legs, each checked as a transfer of its own is before the
    /// claim; a refusal names the leg.
    async fn batch_legs(
        &self,
        principal: PrincipalId,
        body: &BatchBody,
    ) -> Result<Vec<TransferIntent>, TransferError> {
        if body.transfers.is_empty() || body.transfers.len() > reversals::BATCH_LEGS_MAX {
            return Err(Invalid::new(
                ValidationKind::InvalidBatch,
                "transfers",
                format!("a batch holds 1 to {} transfers", reversals::BATCH_LEGS_MAX),
            )
            .into());
        }
        let mut legs = Vec::with_capacity(body.transfers.len());
        for (n, leg) in body.transfers.iter().enumerate() {
            let in_leg = |mut invalid: Invalid| {
                invalid.detail = format!("transfers[{n}]: {}", invalid.detail);
                TransferError::Invalid(invalid)
            };
            let intent = TransferIntent::parse(leg).map_err(in_leg)?;
            if intent.hold.is_some() {
                return Err(in_leg(Invalid::new(
                    ValidationKind::InvalidMode,
                    "mode",
                    "a batch's transfers post at once: mode must be immediate",
                )));
            }
            match super::checks::check_against_accounts(self, principal, &intent).await {
                Ok(()) => {}
                Err(TransferError::Invalid(invalid)) => return Err(in_leg(invalid)),
                Err(e) => return Err(e),
            }
            legs.push(intent);
        }
        Ok(legs)
    }

    /// The hold a post names and the amount it posts, checked before the
    /// claim: what cannot change (owner, held amount) is refused without
    /// touching the key.
    async fn post_target(
        &self,
        principal: PrincipalId,
        transfer_id: &str,
        body: &PostBody,
    ) -> Result<(Hold, AmountMinor), TransferError> {
        let hold = self.own_hold(principal, transfer_id).await?;
        let requested = body.amount_minor.unwrap_or(hold.amount_minor);
        let amount = AmountMinor::parse(requested).map_err(|e| {
            Invalid::new(ValidationKind::InvalidAmount, "amount_minor", e.to_string())
        })?;
        if amount.get() > hold.amount_minor {
            return Err(Invalid::new(
                ValidationKind::InvalidAmount,
                "amount_minor",
                format!(
                    "amount_minor must not exceed the held amount, {}",
                    hold.amount_minor
                ),
            )
            .into());
        }
        Ok((hold, amount))
    }

    /// A hold the caller made. Only its maker (the owner of its source) may
    /// post or void it; to anyone else it does not exist. A transfer that
    /// was never pending is refused as not pending.
    async fn own_hold(
        &self,
        principal: PrincipalId,
        transfer_id: &str,
    ) -> Result<Hold, TransferError> {
        let id = Uuid::parse_str(transfer_id).map_err(|_| TransferError::NotFound)?;
        match holds::get(&self.pool, id).await? {
            Some(hold) if hold.principal_id == principal => Ok(hold),
            Some(_) => Err(TransferError::NotFound),
            None => match ledger::repo::get_transfer(&self.pool, id).await? {
                Some(t) if t.principal_id == Some(principal) => {
                    Err(TransferError::Refused(Rejection::NotPending))
                }
                _ => Err(TransferError::NotFound),
            },
        }
    }

    /// Claims the key and runs the operation in a task of its own, so a
    /// client that hangs up cannot leave its claim unsettled.
    pub(super) async fn keyed(
        self: &Arc<Self>,
        principal: PrincipalId,
        key: IdempotencyKey,
        route: &'static str,
        fingerprint: Fingerprint,
        request_id: Option<String>,
        op: Operation,
    ) -> Counted {
        let this = Arc::clone(self);
        let task = tokio::spawn(
            async move {
                this.claim_and_run(principal, key, route, fingerprint, request_id, op)
                    .await
            }
            .in_current_span(),
        );
        match task.await {
            Ok(done) => done,
            Err(join_error) => {
                tracing::error!(error = %join_error, "lifecycle task did not finish");
                (Some(KeyOutcome::Failed), Err(TransferError::Internal))
            }
        }
    }

    async fn claim_and_run(
        &self,
        principal: PrincipalId,
        key: IdempotencyKey,
        route: &'static str,
        fingerprint: Fingerprint,
        request_id: Option<String>,
        op: Operation,
    ) -> Counted {
        let claim = match self.claim_key(principal, &key, route, &fingerprint).await {
            Ok(claim) => claim,
            Err(decided) => return decided,
        };
        let claimed_as = if claim.took_over {
            KeyOutcome::TakenOver
        } else {
            KeyOutcome::Claimed
        };
        let mut unsettled = Unsettled {
            claim: Some(claim.clone()),
            keys: self.keys.clone(),
        };
        let executed = self
            .execute(&claim, &fingerprint, request_id.as_deref(), &op)
            .await;
        let decided = match executed {
            Ok(decided) => {
                unsettled.claim = None;
                decided
            }
            Err(PostingFailure::FenceLost) => {
                unsettled.claim = None;
                let answer = self.after_fence_lost(principal, &key, &fingerprint).await;
                return (Some(KeyOutcome::FenceLost), answer);
            }
            Err(failure) => {
                unsettled.claim = None;
                if let Err(e) = store::mark_failed_all(&self.keys, &[&claim]).await {
                    // The lease still frees the key.
                    tracing::error!(error = %e, "could not mark the claim FAILED");
                }
                return (Some(KeyOutcome::Failed), Err(failure.into()));
            }
        };
        if self.confirm_replicated().await.is_err() {
            return (
                Some(KeyOutcome::Failed),
                Err(PostingFailure::NotReplicated.into()),
            );
        }
        if decided.answer.response.status.is_success() {
            if let Some(id) = decided.transfer_id {
                tracing::Span::current().record("transfer_id", tracing::field::display(id));
            }
            self.caches.remember_completed(
                principal,
                key.as_str(),
                &fingerprint,
                &decided.answer.response,
            );
        }
        (Some(claimed_as), Ok(decided.answer))
    }

    /// Runs the operation until it commits, retrying serialization
    /// failures and deadlocks a bounded number of times.
    async fn execute(
        &self,
        claim: &Claim,
        fingerprint: &Fingerprint,
        request_id: Option<&str>,
        op: &Operation,
    ) -> Result<Decided, PostingFailure> {
        let mut retries = 0;
        loop {
            match self.attempt(claim, fingerprint, request_id, op).await {
                Ok(decided) => return Ok(decided),
                Err(Attempted::Fenced) => return Err(PostingFailure::FenceLost),
                Err(Attempted::Ledger(LedgerError::Database(e)))
                    if db::classify(&e) == Failure::Transient
                        && retries < TRANSIENT_RETRIES_MAX =>
                {
                    retries += 1;
                    tracing::warn!(attempt = retries, error = %e, "transient database failure, retrying");
                    tokio::time::sleep(Duration::from_millis(5 * u64::from(retries))).await;
                }
                Err(Attempted::Ledger(LedgerError::Database(e))) => {
                    if matches!(e, sqlx::Error::PoolTimedOut) {
                        telemetry::pool_acquire_timeout();
                    }
                    let failure = PostingFailure::of(&e);
                    if failure == PostingFailure::Internal {
                        tracing::error!(error = %e, "lifecycle operation failed");
                    } else {
                        tracing::warn!(error = %e, %failure, "lifecycle operation not done");
                    }
                    return Err(failure);
                }
                Err(Attempted::Ledger(e)) => {
                    tracing::error!(error = %e, "lifecycle operation broke an invariant");
                    return Err(PostingFailure::Internal);
                }
            }
        }
    }

    /// One transaction: decide under the locks, write, complete the key.
    async fn attempt(
        &self,
        claim: &Claim,
        fingerprint: &Fingerprint,
        request_id: Option<&str>,
        op: &Operation,
    ) -> Result<Decided, Attempted> {
        let mut conn = self.pool.acquire().await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        set_lock_timeout(&mut tx, self.postings.settings().lock_timeout).await?;
        // What the key already did, should its record have been purged.
        let used = reversals::key_use(&mut tx, claim.scope, claim.key.as_str()).await?;
        let decided = match (op, used) {
            (Operation::Post { hold, amount }, used) => {
                let resolution = Resolution::Post {
                    amount: *amount,
                    key: claim.key.as_str(),
                    fingerprint: fingerprint.as_bytes(),
                };
                resolve_hold(
                    &mut tx,
                    claim,
                    fingerprint,
                    request_id,
                    *hold,
                    resolution,
                    used,
                )
                .await?
            }
            (Operation::Void { hold }, used) => {
                let resolution = Resolution::Void {
                    key: claim.key.as_str(),
                    fingerprint: fingerprint.as_bytes(),
                };
                resolve_hold(
                    &mut tx,
                    claim,
                    fingerprint,
                    request_id,
                    *hold,
                    resolution,
                    used,
                )
                .await?
            }
            (_, Some(used)) => replay_or_refuse(used, fingerprint, request_id),
            (Operation::CreateHold(intent), None) => {
                create_hold(&mut tx, claim, fingerprint, request_id, intent).await?
            }
            (Operation::Reverse(reversal), None) => {
                reverse(&mut tx, claim, fingerprint, request_id, reversal).await?
            }
            (Operation::Batch(legs), None) => {
                post_batch(&mut tx, claim, fingerprint, request_id, legs).await?
            }
        };
        let completion = Completing {
            claim,
            fingerprint: &decided.stored_fingerprint,
            response: &decided.stored,
            problem_type: decided.problem_type,
            request_id: decided.problem_type.and(request_id),
            transfer_id: decided.transfer_id,
        };
        let completed = store::complete_all(&mut tx, &[completion]).await?;
        if completed.is_empty() {
            // Dropping the transaction rolls everything back.
            return Err(Attempted::Fenced);
        }
        tx.commit().await?;
        for event in &decided.hold_events {
            telemetry::hold_event(event);
        }
        for _ in 0..decided.transfers_posted {
            telemetry::transfer_posted();
        }
        for &(event, count) in &decided.events {
            telemetry::events_written(event, count);
        }
        Ok(decided)
    }
}

async fn set_lock_timeout(conn: &mut PgConnection, timeout: Duration) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT set_config('lock_timeout', $1, true)")
        .bind(format!("{}ms", timeout.as_millis().max(1)))
        .execute(conn)
        .await
        .map(drop)
}

/// A key that already made something (its record purged, the client
/// retrying late): the same request gets that answer again, any other is
/// refused and the key keeps its first answer.
fn replay_or_refuse(used: KeyUse, fingerprint: &Fingerprint, request_id: Option<&str>) -> Decided {
    let (stored, theirs, transfer_id) = match &used {
        KeyUse::Transfer(t) => (render::created(t), &t.request_fingerprint, Some(t.id)),
        KeyUse::Hold(h) => (render::hold_created(h), &h.request_fingerprint, Some(h.id)),
        KeyUse::Batch(b, legs) => (render::batch_created(b, legs), &b.request_fingerprint, None),
    };
    if theirs.as_slice() == fingerprint.as_bytes() {
        Decided::replayed(stored, *fingerprint, transfer_id)
    } else {
        Decided::key_used_by(stored, theirs, *fingerprint, request_id, transfer_id)
    }
}

async fn create_hold(
    conn: &mut PgConnection,
    claim: &Claim,
    fingerprint: &Fingerprint,
    request_id: Option<&str>,
    intent: &TransferIntent,
) -> Result<Decided, LedgerError> {
    let terms = intent.hold.ok_or(LedgerError::PlanMismatch(
        ledger::PlanMismatch::StoredValue("a hold was asked without its terms".to_owned()),
    ))?;
    let request = HoldRequest {
        principal_id: claim.scope,
        idempotency_key: claim.key.as_str(),
        fingerprint: fingerprint.as_bytes(),
        from: intent.from.as_str(),
        to: intent.to.as_str(),
        amount: intent.amount,
        currency: &intent.currency,
        description: intent.description.as_ref(),
        expires_in_seconds: terms.expires_in_seconds,
    };
    Ok(match holds::create(conn, &request).await? {
        HoldOutcome::Created(hold) => {
            Decided::answered(render::hold_created(&hold), *fingerprint, Some(hold.id))
                .counting("created")
                .announcing(EventType::HoldCreated, 1)
        }
        HoldOutcome::InsufficientFunds => {
            Decided::refused(Rejection::InsufficientFunds, *fingerprint, request_id)
        }
    })
}

/// Posts or voids a hold under the locks of its row and accounts. A hold
/// found past its expiry is expired here and now (whether or not the expiry
/// task got to it), and the request refused: the expiry is committed with
/// the refusal.
async fn resolve_hold(
    conn: &mut PgConnection,
    claim: &Claim,
    fingerprint: &Fingerprint,
    request_id: Option<&str>,
    id: Uuid,
    resolution: Resolution<'_>,
    used: Option<KeyUse>,
) -> Result<Decided, LedgerError> {
    let hold = holds::lock(&mut *conn, id)
        .await?
        .ok_or_else(|| ledger::PlanMismatch::StoredValue(format!("hold {id} vanished")))?;
    let not_pending = |fingerprint: &Fingerprint| {
        Decided::refused(Rejection::NotPending, *fingerprint, request_id)
    };
    if hold.status != HoldStatus::Pending {
        return Ok(
            match hold.resolved_by(claim.key.as_str(), fingerprint.as_bytes()) {
                // A late retry of the request that resolved it (its key's
                // record purged): the same answer.
                Some(true) => {
                    let posted = ledger::repo::get_transfer(&mut *conn, id).await?;
                    Decided::replayed(
                        render::hold_resolved(&hold, posted.as_ref()),
                        *fingerprint,
                        Some(id),
                    )
                }
                Some(false) => Decided::refused(Rejection::KeyReused, *fingerprint, request_id),
                None => not_pending(fingerprint),
            },
        );
    }
    if hold.due {
        holds::resolve(&mut *conn, &hold, Resolution::Expire).await?;
        return Ok(not_pending(fingerprint)
            .counting("expired")
            .announcing(EventType::HoldExpired, 1));
    }
    // A key that already made something else keeps that intent.
    if let Some(used) = used {
        return Ok(replay_or_refuse(used, fingerprint, request_id));
    }
    let (resolved, posted) = holds::resolve(&mut *conn, &hold, resolution).await?;
    let decided = Decided::answered(
        render::hold_resolved(&resolved, posted.as_ref()),
        *fingerprint,
        Some(id),
    )
    .counting(resolved.status.as_str());
    Ok(match posted {
        Some(_) => decided.posting(1).announcing(EventType::HoldPosted, 1),
        None => decided.announcing(EventType::HoldVoided, 1),
    })
}

/// A reversal asked of a transfer: what it gives back.
#[derive(Debug, Clone)]
pub struct ReversalIntent {
    pub original: Uuid,
    /// `None`: whatever is left to give back, decided under the lock.
    pub amount: Option<AmountMinor>,
    pub description: Option<Description>,
}

async fn reverse(
    conn: &mut PgConnection,
    claim: &Claim,
    fingerprint: &Fingerprint,
    request_id: Option<&str>,
    intent: &ReversalIntent,
) -> Result<Decided, LedgerError> {
    let request = ReversalRequest {
        principal_id: claim.scope,
        idempotency_key: claim.key.as_str(),
        fingerprint: fingerprint.as_bytes(),
        original: intent.original,
        amount: intent.amount,
        description: intent.description.as_ref(),
    };
    Ok(match reversals::reverse(conn, &request).await? {
        ReversalOutcome::Posted(reversal) => {
            Decided::answered(render::created(&reversal), *fingerprint, Some(reversal.id))
                .posting(1)
                .announcing(EventType::TransferReversed, 1)
        }
        ReversalOutcome::ExceedsTransfer => {
            Decided::refused(Rejection::ReversalExceedsTransfer, *fingerprint, request_id)
        }
        ReversalOutcome::InsufficientFunds => {
            Decided::refused(Rejection::InsufficientFunds, *fingerprint, request_id)
        }
    })
}

async fn post_batch(
    conn: &mut PgConnection,
    claim: &Claim,
    fingerprint: &Fingerprint,
    request_id: Option<&str>,
    intents: &[TransferIntent],
) -> Result<Decided, LedgerError> {
    let legs: Vec<Leg<'_>> = intents
        .iter()
        .map(|i| Leg {
            from: i.from.as_str(),
            to: i.to.as_str(),
            amount: i.amount,
            currency: &i.currency,
            description: i.description.as_ref(),
        })
        .collect();
    let outcome = reversals::post_batch(
        conn,
        claim.scope,
        claim.key.as_str(),
        fingerprint.as_bytes(),
        &legs,
    )
    .await?;
    Ok(match outcome {
        BatchOutcome::Posted(batch, posted) => {
            Decided::answered(render::batch_created(&batch, &posted), *fingerprint, None)
                .posting(posted.len())
                .announcing(EventType::TransferPosted, posted.len())
        }
        BatchOutcome::InsufficientFunds { leg } => {
            // The one reason the batch was refused, naming its leg: stored
            // whole (a batch's refusal is never rebuilt from its type).
            let mut problem = Rejection::InsufficientFunds
                .problem()
                .with_request_id(request_id);
            problem.detail = format!(
                "transfers[{leg}]: the source account balance cannot cover this transfer, counting \
                 the transfers before it in the batch; nothing in the batch was posted"
            );
            problem.param = Some(format!("transfers[{leg}].amount_minor").into());
            Decided::refused_with(
                problem.to_stored(),
                Rejection::InsufficientFunds,
                *fingerprint,
            )
        }
    })
}

/// How often the expiry task looks for due holds, by default: a hold is
/// released at most about this long after its expiry (a post or void that
/// finds it due expires it at once).
pub const HOLD_EXPIRY_INTERVAL_DEFAULT: Duration = Duration::from_secs(1);

/// Expires every due hold, in transactions of at most
/// [`holds::EXPIRY_BATCH_MAX`], each waiting at most `lock_timeout` for an
/// account. Safe on any number of instances at once: a hold is locked
/// (`SKIP LOCKED`) before it is expired, and only a pending one is.
pub async fn expire_due_holds(pool: &PgPool, lock_timeout: Duration) -> Result<u64, LedgerError> {
    let mut expired = 0;
    loop {
        // Most ticks find nothing: no transaction is opened for them.
        let due: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM holds WHERE status = 'pending' AND expires_at <= now())",
        )
        .fetch_one(pool)
        .await?;
        if !due {
            return Ok(expired);
        }
        let mut tx = pool.begin().await?;
        set_lock_timeout(&mut tx, lock_timeout).await?;
        let batch = holds::expire_due(&mut tx, holds::EXPIRY_BATCH_MAX).await?;
        tx.commit().await?;
        expired += batch;
        telemetry::hold_events("expired", batch);
        telemetry::events_written(EventType::HoldExpired, batch);
        if batch < holds::EXPIRY_BATCH_MAX as u64 {
            return Ok(expired);
        }
    }
}

/// The expiry task of `serve`.
pub async fn expire_holds_periodically(pool: PgPool, every: Duration, lock_timeout: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match expire_due_holds(&pool, lock_timeout).await {
            Ok(0) => {}
            Ok(expired) => tracing::info!(expired, "expired pending transfers"),
            Err(e) => {
                tracing::warn!(error = %e, "expiry of pending transfers failed; retried next tick")
            }
        }
    }
}
