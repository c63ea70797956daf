//! Which queued posting may run next: the bookkeeping of the posting
//! layer, without I/O, so its rules are tested without a database.
//!
//! Rules:
//! - A job touches two accounts. It runs only when no running work holds
//!   either of them, so a transfer waits only behind work on its own
//!   accounts, never behind a stuck account it does not touch.
//! - Jobs are taken in arrival order, and jobs on the same account join
//!   the same batch (it posts them in that order: a hot account's queue
//!   drains a batch at a time). A job that cannot run blocks its accounts
//!   for the rest of that pass, so a later job never overtakes an earlier
//!   one on a shared account (no starvation).
//! - At most `batches_running_max` batches run at once, each of at most
//!   `batch_transfers_max` jobs; lock waiters (jobs whose rows another
//!   transaction holds) are counted apart, at most `lock_waiters_max`.
//! - Admission is counted per account from before the claim until the job
//!   ends, and refused past `admitted_per_account_max` (or
//!   `admitted_max` in all), so a refused request never holds a key.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

/// The bounds of the posting layer. Each is a named default in
/// `transfers::posting` with its reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub batch_transfers_max: usize,
    pub batches_running_max: usize,
    pub lock_waiters_max: usize,
    pub admitted_per_account_max: usize,
    pub admitted_max: usize,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// One of its accounts already has `admitted_per_account_max` transfers
    /// queued or running on this instance.
    AccountQueueFull,
    /// The instance holds `admitted_max` transfers.
    QueueFull,
    /// The instance is shutting down.
    Closed,
}

/// Work that has started: the accounts it holds until it is released.
#[derive(Debug)]
pub struct Started<J> {
    pub jobs: Vec<J>,
    pub accounts: Vec<String>,
}

pub struct Scheduler<J> {
    limits: Limits,
    /// A std Mutex, not a tokio one: nothing awaits while it is held.
    state: Mutex<State<J>>,
    admissions: Arc<Mutex<Admissions>>,
}

struct State<J> {
    pending: BTreeMap<u64, (Pair, J)>,
    next_seq: u64,
    /// Accounts held by running work, with how many holders (a batch hands
    /// its deferred jobs' accounts to a lock waiter before it releases).
    held: HashMap<String, usize>,
    batches_running: usize,
    waiters_running: usize,
}

#[derive(Debug, Default)]
struct Admissions {
    per_account: HashMap<String, usize>,
    total: usize,
    closed: bool,
}

type Pair = [String; 2];

/// A request's place in the posting layer, from before its claim until its
/// job ends. Dropping it frees the place.
#[derive(Debug)]
pub struct Admission {
    accounts: Pair,
    admissions: Arc<Mutex<Admissions>>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        let mut admissions = lock(&self.admissions);
        admissions.total = admissions.total.saturating_sub(1);
        for account in &self.accounts {
            if let Some(count) = admissions.per_account.get_mut(account) {
                *count -= 1;
                if *count == 0 {
                    admissions.per_account.remove(account);
                }
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding it cannot leave the counts half-written: every
    // update under the lock is a few integer operations.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl<J> Scheduler<J> {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            state: Mutex::new(State {
                pending: BTreeMap::new(),
                next_seq: 0,
                held: HashMap::new(),
                batches_running: 0,
                waiters_running: 0,
            }),
            admissions: Arc::default(),
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    pub fn admit(&self, from: &str, to: &str) -> Result<Admission, Refusal> {
        let mut admissions = lock(&self.admissions);
        if admissions.closed {
            return Err(Refusal::Closed);
        }
        if admissions.total >= self.limits.admitted_max {
            return Err(Refusal::QueueFull);
        }
        let full = |account: &str| {
            admissions.per_account.get(account).copied().unwrap_or(0)
                >= self.limits.admitted_per_account_max
        };
        if full(from) || full(to) {
            return Err(Refusal::AccountQueueFull);
        }
        admissions.total += 1;
        for account in [from, to] {
            *admissions
                .per_account
                .entry(account.to_owned())
                .or_default() += 1;
        }
        Ok(Admission {
            accounts: [from.to_owned(), to.to_owned()],
            admissions: Arc::clone(&self.admissions),
        })
    }

    /// From now on every admission is refused.
    pub fn close(&self) {
        lock(&self.admissions).closed = true;
    }

    /// Queues a job on its two accounts; returns its place, by which it
    /// can be withdrawn.
    pub fn enqueue(&self, from: &str, to: &str, job: J) -> u64 {
        let mut state = lock(&self.state);
        let seq = state.next_seq;
        state.next_seq += 1;
        state
            .pending
            .insert(seq, ([from.to_owned(), to.to_owned()], job));
        seq
    }

    /// Takes a job back that has not started (its wait ran out).
    pub fn withdraw(&self, seq: u64) -> Option<J> {
        lock(&self.state).pending.remove(&seq).map(|(_, job)| job)
    }

    /// Takes every job that has not started (shutdown).
    pub fn withdraw_all(&self) -> Vec<J> {
        let pending = std::mem::take(&mut lock(&self.state).pending);
        pending.into_values().map(|(_, job)| job).collect()
    }

    /// The next batch, when a batch may start and some queued job's
    /// accounts are free: its jobs in arrival order, their accounts held.
    pub fn start_batch(&self) -> Option<Started<J>> {
        let mut state = lock(&self.state);
        if state.batches_running >= self.limits.batches_running_max {
            return None;
        }
        let mut taken = Vec::new();
        let mut blocked: HashSet<&str> = HashSet::new();
        for (seq, (accounts, _)) in &state.pending {
            if taken.len() == self.limits.batch_transfers_max {
                break;
            }
            let free = accounts
                .iter()
                .all(|a| !state.held.contains_key(a) && !blocked.contains(a.as_str()));
            if free {
                taken.push(*seq);
            } else {
                // Later jobs on these accounts must not overtake it.
                blocked.extend(accounts.iter().map(String::as_str));
            }
        }
        if taken.is_empty() {
            return None;
        }
        let mut jobs = Vec::with_capacity(taken.len());
        let mut accounts = Vec::with_capacity(taken.len() * 2);
        for seq in taken {
            if let Some((pair, job)) = state.pending.remove(&seq) {
                accounts.extend(pair);
                jobs.push(job);
            }
        }
        accounts.sort_unstable();
        accounts.dedup();
        hold(&mut state.held, &accounts);
        state.batches_running += 1;
        Some(Started { jobs, accounts })
    }

    /// Hands accounts a running batch holds to a lock waiter, if one more
    /// may run; the batch still releases its own hold.
    pub fn start_waiter(&self, accounts: &[String]) -> bool {
        let mut state = lock(&self.state);
        if state.waiters_running >= self.limits.lock_waiters_max {
            return false;
        }
        hold(&mut state.held, accounts);
        state.waiters_running += 1;
        true
    }

    pub fn finish_batch(&self, accounts: &[String]) {
        let mut state = lock(&self.state);
        release(&mut state.held, accounts);
        state.batches_running = state.batches_running.saturating_sub(1);
    }

    pub fn finish_waiter(&self, accounts: &[String]) {
        let mut state = lock(&self.state);
        release(&mut state.held, accounts);
        state.waiters_running = state.waiters_running.saturating_sub(1);
    }

    /// Nothing queued, nothing running.
    pub fn is_idle(&self) -> bool {
        let state = lock(&self.state);
        state.pending.is_empty() && state.batches_running == 0 && state.waiters_running == 0
    }

    /// Jobs queued, for the metrics.
    pub fn queued(&self) -> usize {
        lock(&self.state).pending.len()
    }
}

fn hold(held: &mut HashMap<String, usize>, accounts: &[String]) {
    for account in accounts {
        *held.entry(account.clone()).or_default() += 1;
    }
}

fn release(held: &mut HashMap<String, usize>, accounts: &[String]) {
    for account in accounts {
        if let Some(count) = held.get_mut(account) {
            *count -= 1;
            if *count == 0 {
                held.remove(account);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        batch_transfers_max: 3,
        batches_running_max: 2,
        lock_waiters_max: 1,
        admitted_per_account_max: 2,
        admitted_max: 5,
    };

    fn jobs(started: Option<Started<&'static str>>) -> Vec<&'static str> {
        started.map(|s| s.jobs).unwrap_or_default()
    }

    #[test]
    fn a_job_waits_only_behind_work_on_its_own_accounts() {
        let s = Scheduler::new(LIMITS);
        s.enqueue("acc_x", "acc_y", "x1");
        let stuck = s.start_batch();
        assert_eq!(jobs(stuck), ["x1"]);
        s.enqueue("acc_x", "acc_b", "x2");
        s.enqueue("acc_a", "acc_b", "a1");
        s.enqueue("acc_c", "acc_d", "c1");
        // x2 waits for acc_x; a1 shares acc_b with x2, which came first.
        assert_eq!(jobs(s.start_batch()), ["c1"]);
    }

    #[test]
    fn a_batch_takes_free_jobs_in_arrival_order_up_to_its_size() {
        let s = Scheduler::new(LIMITS);
        for (from, job) in [
            ("acc_1", "j1"),
            ("acc_2", "j2"),
            ("acc_3", "j3"),
            ("acc_4", "j4"),
        ] {
            s.enqueue(from, "acc_to", job);
        }
        // All share acc_to: they join one batch, in order, up to its size;
        // the last waits for that batch to release acc_to.
        let first = s.start_batch();
        assert_eq!(
            first.as_ref().map(|b| b.jobs.clone()),
            Some(vec!["j1", "j2", "j3"])
        );
        assert!(s.start_batch().is_none());
        let Some(first) = first else { return };
        s.finish_batch(&first.accounts);
        assert_eq!(jobs(s.start_batch()), ["j4"]);

        let s = Scheduler::new(LIMITS);
        for (from, to, job) in [
            ("acc_1", "acc_2", "j1"),
            ("acc_3", "acc_4", "j2"),
            ("acc_5", "acc_6", "j3"),
            ("acc_7", "acc_8", "j4"),
        ] {
            s.enqueue(from, to, job);
        }
        assert_eq!(jobs(s.start_batch()), ["j1", "j2", "j3"]);
        assert_eq!(jobs(s.start_batch()), ["j4"]);
    }

    #[test]
    fn no_more_batches_run_than_the_limit() {
        let s = Scheduler::new(LIMITS);
        for (from, job) in [("acc_1", "j1"), ("acc_2", "j2"), ("acc_3", "j3")] {
            s.enqueue(from, &format!("{from}_to"), job);
            assert!(s.start_batch().is_some() || job == "j3");
        }
        assert!(s.start_batch().is_none(), "two batches run already");
        assert!(!s.is_idle());
    }

    #[test]
    fn a_withdrawn_job_never_starts() {
        let s = Scheduler::new(LIMITS);
        let seq = s.enqueue("acc_1", "acc_2", "j1");
        assert_eq!(s.withdraw(seq), Some("j1"));
        assert_eq!(s.withdraw(seq), None);
        assert!(s.start_batch().is_none());
        assert!(s.is_idle());
    }

    #[test]
    fn admission_is_bounded_per_account_and_in_all_and_freed_on_drop() {
        let s: Scheduler<()> = Scheduler::new(LIMITS);
        let a1 = s.admit("acc_hot", "acc_1");
        let a2 = s.admit("acc_2", "acc_hot");
        assert!(a1.is_ok() && a2.is_ok());
        assert_eq!(
            s.admit("acc_hot", "acc_3").err(),
            Some(Refusal::AccountQueueFull)
        );
        let others: Vec<_> = (0..3)
            .map(|i| s.admit(&format!("acc_o{i}"), &format!("acc_p{i}")))
            .collect();
        assert!(others.iter().all(Result::is_ok));
        assert_eq!(s.admit("acc_q", "acc_r").err(), Some(Refusal::QueueFull));
        drop(a1);
        drop(others);
        assert!(s.admit("acc_hot", "acc_3").is_ok());
        s.close();
        assert_eq!(s.admit("acc_s", "acc_t").err(), Some(Refusal::Closed));
    }

    #[test]
    fn lock_waiters_are_bounded_and_keep_their_accounts_held() {
        let s = Scheduler::new(LIMITS);
        s.enqueue("acc_x", "acc_y", "x1");
        let Some(batch) = s.start_batch() else {
            panic!("the first job starts");
        };
        let waited = vec!["acc_x".to_owned()];
        assert!(s.start_waiter(&waited));
        assert!(!s.start_waiter(&waited), "one waiter at most");
        s.finish_batch(&batch.accounts);
        s.enqueue("acc_x", "acc_z", "x2");
        s.enqueue("acc_y", "acc_z2", "y1");
        assert_eq!(
            jobs(s.start_batch()),
            ["y1"],
            "acc_x is still held by the waiter"
        );
        s.finish_waiter(&waited);
        assert_eq!(jobs(s.start_batch()), ["x2"]);
    }
}
