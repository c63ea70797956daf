//! Claims that arrive together share one statement. A claim finding no
//! statement of its own kind running is sent at once, alone; while
//! [`CLAIM_STATEMENTS_IN_FLIGHT_MAX`] are running, the claims that arrive
//! wait in memory, and the next statement takes up to
//! [`CLAIM_BATCH_MAX`] of them. Nothing waits for a batch to fill: under
//! light load every claim is a statement of its own, as before; under
//! load, the claim round trip and its transaction are shared. ADR-006.
//!
//! Each claim is still insert-first and atomic (its row, its own token),
//! and everything after the insert (a replay, 422, 409, a takeover) is
//! decided per request as before: a duplicate's 409 or 422 waits at most
//! for the statements ahead of it, each bounded by the key pool's
//! `lock_timeout` and `statement_timeout`.

use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};

use super::store::{self, ClaimAttempt, ClaimInput, ClaimOutcome, Policy};
use super::{Claim, Fingerprint, IdempotencyKey};
use crate::db::KeyPool;
use crate::principal::PrincipalId;
use crate::telemetry;

/// The most claims one statement carries: the posting batches' size
/// (`BATCH_TRANSFERS_MAX`) twice, so a full posting batch's claims never
/// need two statements.
pub const CLAIM_BATCH_MAX: usize = 64;
/// Claim statements running at once. Two: one fills while the other runs,
/// and the key pool keeps connections for takeovers and FAILED marks.
pub const CLAIM_STATEMENTS_IN_FLIGHT_MAX: usize = 2;
/// Claims waiting for a statement. Each is a request that passed admission
/// (bounded per instance), so this is only a backstop: past it a claim
/// waits to be queued, it is never refused.
pub const CLAIM_QUEUE_MAX: usize = 4_096;

struct Pending {
    input: ClaimInput,
    reply: oneshot::Sender<Result<ClaimAttempt, sqlx::Error>>,
}

/// The instance's claim batcher; its task ends when the last clone of it is
/// dropped.
#[derive(Clone)]
pub struct ClaimBatcher {
    keys: KeyPool,
    policy: Policy,
    queue: mpsc::Sender<Pending>,
}

impl ClaimBatcher {
    pub fn start(keys: KeyPool, policy: Policy) -> Self {
        let (queue, waiting) = mpsc::channel(CLAIM_QUEUE_MAX);
        tokio::spawn(dispatch(keys.clone(), policy, waiting));
        Self {
            keys,
            policy,
            queue,
        }
    }

    /// `store::claim`, with the insert-first attempt batched.
    pub async fn claim(
        &self,
        scope: PrincipalId,
        key: &IdempotencyKey,
        method: &str,
        path: &str,
        fingerprint: &Fingerprint,
    ) -> Result<ClaimOutcome, sqlx::Error> {
        store::claim_with(
            &self.keys,
            self.policy,
            scope,
            key,
            method,
            path,
            fingerprint,
            |input| self.attempt(input),
        )
        .await
    }

    /// Claims waiting for a statement right now: the queue's length,
    /// read off the channel, so nothing on the claim path counts it.
    pub fn queued(&self) -> usize {
        self.queue.max_capacity() - self.queue.capacity()
    }

    async fn attempt(&self, input: ClaimInput) -> Result<ClaimAttempt, sqlx::Error> {
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            input: input.clone(),
            reply,
        };
        if self.queue.send(pending).await.is_err() {
            // The dispatcher is gone (the runtime is shutting down).
            return store::insert_one(self.keys.pool(), self.policy, input).await;
        }
        answer.await.unwrap_or_else(|_| {
            // The statement's task ended without answering (it panicked):
            // whether the claim was inserted is unknown, and a row with
            // this token, if any, is left to its lease.
            Err(sqlx::Error::WorkerCrashed)
        })
    }
}

async fn dispatch(keys: KeyPool, policy: Policy, mut waiting: mpsc::Receiver<Pending>) {
    let slots = Arc::new(Semaphore::new(CLAIM_STATEMENTS_IN_FLIGHT_MAX));
    loop {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let Some(first) = waiting.recv().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < CLAIM_BATCH_MAX {
            match waiting.try_recv() {
                Ok(pending) => batch.push(pending),
                Err(_) => break,
            }
        }
        let keys = keys.clone();
        tokio::spawn(async move {
            run(&keys, policy, batch).await;
            drop(slot);
        });
    }
}

async fn run(keys: &KeyPool, policy: Policy, batch: Vec<Pending>) {
    let inputs: Vec<ClaimInput> = batch.iter().map(|p| p.input.clone()).collect();
    match store::insert_first(keys.pool(), policy, &inputs).await {
        Ok(attempts) => {
            let orphaned: Vec<Claim> = batch
                .into_iter()
                .zip(attempts)
                .filter_map(|(pending, attempt)| deliver(pending, Ok(attempt)))
                .collect();
            release(keys, &orphaned).await;
        }
        Err(e) if batch.len() == 1 => {
            if let Some(pending) = batch.into_iter().next() {
                // An error means nothing was claimed: nothing to release.
                deliver(pending, Err(e));
            }
        }
        Err(e) => {
            // Each claim alone, so each gets its own answer or error (a
            // transient one is retried by its request, a bad row fails
            // only its own).
            tracing::warn!(error = %e, claims = batch.len(), "a claim batch failed; claiming one by one");
            telemetry::claim_batch_split();
            for pending in batch {
                let keys = keys.clone();
                tokio::spawn(async move {
                    let attempt =
                        store::insert_one(keys.pool(), policy, pending.input.clone()).await;
                    if let Some(orphan) = deliver(pending, attempt) {
                        release(&keys, std::slice::from_ref(&orphan)).await;
                    }
                });
            }
        }
    }
}

/// Hands the attempt to its request; returns the claim it won if the
/// request stopped waiting for it.
fn deliver(pending: Pending, attempt: Result<ClaimAttempt, sqlx::Error>) -> Option<Claim> {
    match pending.reply.send(attempt) {
        Err(Ok(attempt)) if attempt.claimed.is_some() => Some(Claim {
            scope: pending.input.scope,
            key: pending.input.key,
            lock_token: pending.input.token,
            took_over: false,
        }),
        _ => None,
    }
}

/// Claims won for requests that stopped waiting: FAILED at once, so a
/// retry takes the key over instead of waiting for the lease.
async fn release(keys: &KeyPool, orphaned: &[Claim]) {
    if orphaned.is_empty() {
        return;
    }
    let claims: Vec<&Claim> = orphaned.iter().collect();
    if let Err(e) = store::mark_failed_all(keys, &claims).await {
        tracing::warn!(error = %e, "claims nobody waits for are left to their lease");
    }
}
