//! Transfers that debit the same account are posted one batch at a time,
//! several in one transaction.
//!
//! Every transfer from an account must hold that account's row lock from
//! its check to its commit, and a commit waits for the WAL flush (about
//! 3 ms on the benchmark machine's disk): one account can then post only a
//! few hundred transfers a second, and with many clients the waiters pile up
//! on the row lock inside PostgreSQL, each holding a pooled connection. Here
//! the service queues them instead: while one batch for an account runs,
//! later transfers from it wait in memory, and the next batch takes all of
//! them (up to `BATCH_TRANSFERS_MAX`) into one transaction that locks every
//! account involved in id order, posts each transfer in arrival order and
//! completes each claim, fenced by its own token, then commits once. Each
//! transfer stays individually idempotent (its own key, its own stored
//! answer), is durable before its answer (the reply is sent after the
//! commit), and is refused alone when it would overdraw (the check runs
//! under the lock, after the transfers before it in the batch). If
//! anything in a batch fails (a lost fence, a database error), the batch is
//! rolled back whole and its transfers run again one by one through the
//! ordinary path, which handles each failure on its own.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use sqlx::PgPool;
use tokio::sync::oneshot;

use crate::idempotency::{self, Claim, Completion, ExecuteError, Operation, store};
use crate::ledger;

/// The most transfers one transaction posts. Bounds how long a batch holds
/// its locks and how long its first transfer waits for its answer (about
/// three round trips per transfer, so tens of milliseconds at most).
pub const BATCH_TRANSFERS_MAX: usize = 32;

/// The most source accounts with work queued at once; beyond it a transfer
/// runs on its own as if unbatched, so the map cannot grow without bound.
pub const QUEUED_ACCOUNTS_MAX: usize = 10_000;

/// An operation that moves money between accounts, which a batch must lock.
pub trait Posting: Operation {
    fn accounts(&self) -> [&str; 2];
}

type Reply = Result<Completion, ExecuteError>;

struct Job<P> {
    claim: Claim,
    operation: P,
    reply: oneshot::Sender<Reply>,
}

/// The queued work per source account. An account has an entry exactly
/// while a task is posting its batches.
pub struct AccountQueues<P> {
    /// A std Mutex, not a tokio one: nothing awaits while it is held.
    queues: Mutex<HashMap<String, VecDeque<Job<P>>>>,
}

impl<P> Default for AccountQueues<P> {
    fn default() -> Self {
        Self {
            queues: Mutex::new(HashMap::new()),
        }
    }
}

impl<P: Posting> AccountQueues<P> {
    /// Posts the claimed operation, batched with other transfers from the
    /// same account that are waiting. The work runs in a task of its own:
    /// if the caller goes away, it still finishes and completes the key.
    pub async fn submit(
        self: &Arc<Self>,
        pool: &PgPool,
        account: &str,
        claim: Claim,
        operation: P,
    ) -> Result<Reply, oneshot::error::RecvError> {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            claim,
            operation,
            reply,
        };
        match self.enqueue(account, job) {
            Enqueued::Queued => {}
            Enqueued::Lead => {
                tokio::spawn(Arc::clone(self).drain(pool.clone(), account.to_owned()));
            }
            Enqueued::Full(job) => {
                let pool = pool.clone();
                tokio::spawn(async move {
                    let result = idempotency::execute(&pool, &job.claim, &job.operation).await;
                    let _ = job.reply.send(result);
                });
            }
        }
        answer.await
    }

    fn enqueue(&self, account: &str, job: Job<P>) -> Enqueued<P> {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(queue) = queues.get_mut(account) {
            queue.push_back(job);
            return Enqueued::Queued;
        }
        if queues.len() >= QUEUED_ACCOUNTS_MAX {
            return Enqueued::Full(job);
        }
        queues.insert(account.to_owned(), VecDeque::from([job]));
        Enqueued::Lead
    }

    /// Takes the next batch, or removes the account's entry when nothing is
    /// left (under the lock, so no job can be queued without a drainer).
    fn next_batch(&self, account: &str) -> Vec<Job<P>> {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        let Some(queue) = queues.get_mut(account) else {
            return Vec::new();
        };
        let take = queue.len().min(BATCH_TRANSFERS_MAX);
        let batch: Vec<Job<P>> = queue.drain(..take).collect();
        if batch.is_empty() {
            queues.remove(account);
        }
        batch
    }

    async fn drain(self: Arc<Self>, pool: PgPool, account: String) {
        loop {
            let batch = self.next_batch(&account);
            if batch.is_empty() {
                return;
            }
            run_batch(&pool, batch).await;
        }
    }
}

enum Enqueued<P> {
    Queued,
    Lead,
    Full(Job<P>),
}

async fn run_batch<P: Posting>(pool: &PgPool, mut batch: Vec<Job<P>>) {
    if batch.len() > 1 {
        match post_together(pool, &batch).await {
            Ok(completions) => {
                for (job, completion) in batch.into_iter().zip(completions) {
                    let _ = job.reply.send(Ok(completion));
                }
                return;
            }
            Err(reason) => {
                tracing::warn!(
                    transfers = batch.len(),
                    %reason,
                    "batch rolled back, posting its transfers one by one"
                );
            }
        }
    }
    // One by one: the ordinary path, with its retries, its FAILED marking
    // and its fence. A claim whose batch did commit after all finds its key
    // completed, so the fence stops a second posting.
    for job in batch.drain(..) {
        let result = idempotency::execute(pool, &job.claim, &job.operation).await;
        let _ = job.reply.send(result);
    }
}

/// One transaction for the whole batch: lock every account in id order (so
/// two batches, or a batch and a single transfer, cannot deadlock), then
/// post and complete each transfer in order, then commit once.
async fn post_together<P: Posting>(
    pool: &PgPool,
    batch: &[Job<P>],
) -> Result<Vec<Completion>, String> {
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    let mut accounts: Vec<&str> = batch
        .iter()
        .flat_map(|job| job.operation.accounts())
        .collect();
    accounts.sort_unstable();
    accounts.dedup();
    ledger::repo::lock_accounts(&mut tx, &accounts)
        .await
        .map_err(|e| e.to_string())?;
    let mut completions = Vec::with_capacity(batch.len());
    for job in batch {
        let completion = job
            .operation
            .execute(&mut tx)
            .await
            .map_err(|e| e.to_string())?;
        let completed = store::complete(
            &mut tx,
            &job.claim,
            &completion.response,
            completion.transfer_id,
        )
        .await
        .map_err(|e| e.to_string())?;
        if !completed {
            // Dropping the transaction rolls back every posting in it.
            return Err(format!("the claim of {} was taken over", job.claim.key));
        }
        completions.push(completion);
    }
    tx.commit().await.map_err(|e| e.to_string())?;
    Ok(completions)
}
