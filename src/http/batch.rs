//! Transfers are posted in batches, several in one transaction, and the
//! transfers that debit one account one batch at a time.
//!
//! Every transfer from an account must hold that account's row lock from
//! its check to its commit, and a commit waits for the WAL flush (about
//! 3 ms on the benchmark machine's disk): one account can then post only a
//! few hundred transfers a second, and with many clients the waiters pile up
//! on the row lock inside PostgreSQL, each holding a pooled connection. And
//! on a small machine every round trip costs CPU that the database needs:
//! a transfer alone costs a `BEGIN`, a `COMMIT` and a flush of its own.
//!
//! So the service queues transfers itself, in `POSTING_SHARDS` queues chosen
//! by the source account (all transfers from one account share a queue).
//! While a batch of a queue runs, later transfers wait in memory; the next
//! batch takes all of them (up to `BATCH_TRANSFERS_MAX`) into one
//! transaction that locks every account involved in id order, posts every
//! transfer in arrival order in one statement, completes every claim (each
//! fenced by its own token) in another, then commits once: five round trips
//! and one flush whatever the batch's size. Each transfer stays
//! individually idempotent (its own key, its own stored answer), is durable
//! before its answer (the reply is sent after the commit), and is refused
//! alone when it would overdraw (the check runs under the lock, after the
//! transfers before it in the batch). If anything in a batch fails (a lost
//! fence, a database error), the batch is rolled back whole and its
//! transfers run again one by one through the ordinary path, which handles
//! each failure on its own. A transfer that finds its queue idle is posted
//! alone at once.

use std::collections::{HashMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};

use sqlx::PgPool;
use tokio::sync::oneshot;

use crate::idempotency::{self, Claim, Completion, ExecuteError, Operation, OperationError, store};
use crate::ledger::{self, LedgerError, PostingOutcome, PostingRequest};

/// The most transfers one transaction posts. Bounds how long a batch holds
/// its locks, the size of its statements' arrays and how long its first
/// transfer waits for its answer.
pub const BATCH_TRANSFERS_MAX: usize = 32;

/// How many batches may run at once. Fewer shards make larger batches at a
/// given concurrency, so fewer statements per transfer; on the benchmark
/// machine's two cores, four beat eight by a third at 32 and 64 clients
/// (1,842 and 2,457 against 1,391 and 1,953 new transfers/s) and two lost
/// at 64 (docs/adr/ADR-006-performance.md). Four transactions in flight
/// still join their flushes in group commit.
pub const POSTING_SHARDS: u64 = 4;

/// An operation that moves money between accounts, which a batch posts
/// together with others.
pub trait Posting: Operation {
    /// The movement this operation asks for.
    fn request(&self) -> PostingRequest<'_>;

    /// The answer to store for the movement's outcome.
    fn completion(
        &self,
        outcome: Result<PostingOutcome, LedgerError>,
    ) -> Result<Completion, OperationError>;
}

type Reply = Result<Completion, ExecuteError>;

struct Job<P> {
    claim: Claim,
    operation: P,
    reply: oneshot::Sender<Reply>,
}

/// The queued work per shard of source accounts. A shard has an entry
/// exactly while a task is posting its batches.
pub struct PostingQueues<P> {
    /// A std Mutex, not a tokio one: nothing awaits while it is held.
    queues: Mutex<HashMap<u64, VecDeque<Job<P>>>>,
}

/// The queue of a source account: the same for all its transfers, so they
/// are never in two transactions at once.
fn shard_of(account: &str) -> u64 {
    let mut hasher = DefaultHasher::new();
    account.hash(&mut hasher);
    hasher.finish() % POSTING_SHARDS
}

impl<P> Default for PostingQueues<P> {
    fn default() -> Self {
        Self {
            queues: Mutex::new(HashMap::new()),
        }
    }
}

impl<P: Posting> PostingQueues<P> {
    /// Posts the claimed operation, batched with the transfers waiting in
    /// its source account's queue. The work runs in a task of its own: if
    /// the caller goes away, it still finishes and completes the key.
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
        let shard = shard_of(account);
        if self.enqueue(shard, job) {
            tokio::spawn(Arc::clone(self).drain(pool.clone(), shard));
        }
        answer.await
    }

    /// Queues the job; true when its queue was idle and the caller must
    /// start draining it.
    fn enqueue(&self, shard: u64, job: Job<P>) -> bool {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        match queues.get_mut(&shard) {
            Some(queue) => {
                queue.push_back(job);
                false
            }
            None => {
                queues.insert(shard, VecDeque::from([job]));
                true
            }
        }
    }

    /// Takes the next batch, or removes the shard's entry when nothing is
    /// left (under the lock, so no job can be queued without a drainer).
    fn next_batch(&self, shard: u64) -> Vec<Job<P>> {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        let Some(queue) = queues.get_mut(&shard) else {
            return Vec::new();
        };
        let take = queue.len().min(BATCH_TRANSFERS_MAX);
        let batch: Vec<Job<P>> = queue.drain(..take).collect();
        if batch.is_empty() {
            queues.remove(&shard);
        }
        batch
    }

    async fn drain(self: Arc<Self>, pool: PgPool, shard: u64) {
        loop {
            let batch = self.next_batch(shard);
            if batch.is_empty() {
                return;
            }
            // Each batch in a task of its own: a panic in one drops only its
            // jobs' replies (their callers mark those keys FAILED), and this
            // queue keeps draining instead of being left with no drainer.
            let pool = pool.clone();
            if let Err(e) = tokio::spawn(async move { run_batch(&pool, batch).await }).await {
                tracing::error!(error = %e, "a posting batch did not finish");
            }
        }
    }
}

async fn run_batch<P: Posting>(pool: &PgPool, mut batch: Vec<Job<P>>) {
    if batch.len() > 1 {
        match post_together(pool, &batch).await {
            Ok(completions) => {
                for (job, completion) in batch.into_iter().zip(completions) {
                    job.operation.committed();
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
/// two batches, or a batch and a single transfer, cannot deadlock), post
/// every transfer in one statement, complete every claim in another, then
/// commit once.
async fn post_together<P: Posting>(
    pool: &PgPool,
    batch: &[Job<P>],
) -> Result<Vec<Completion>, String> {
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    let requests: Vec<PostingRequest<'_>> =
        batch.iter().map(|job| job.operation.request()).collect();
    let mut accounts: Vec<&str> = requests.iter().flat_map(|r| [r.from, r.to]).collect();
    accounts.sort_unstable();
    accounts.dedup();
    let mut locked = ledger::repo::lock_accounts(&mut tx, &accounts)
        .await
        .map_err(|e| e.to_string())?;
    let outcomes = ledger::repo::post_locked(&mut tx, &requests, &mut locked)
        .await
        .map_err(|e| e.to_string())?;
    let completions = batch
        .iter()
        .zip(outcomes)
        .map(|(job, outcome)| job.operation.completion(Ok(outcome)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    // Every claim is completed in the same transaction as its posting, in
    // one statement, each fenced by its own token.
    let fenced: Vec<_> = batch
        .iter()
        .zip(&completions)
        .map(|(job, c)| (&job.claim, &c.response, c.transfer_id))
        .collect();
    let completed = store::complete_all(&mut tx, &fenced)
        .await
        .map_err(|e| e.to_string())?;
    if completed != batch.len() {
        // Dropping the transaction rolls back every posting in it.
        return Err(format!(
            "{} of {} claims were taken over",
            batch.len() - completed,
            batch.len()
        ));
    }
    tx.commit().await.map_err(|e| e.to_string())?;
    Ok(completions)
}
