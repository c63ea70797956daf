//! What each scenario sends: the intents (key, principal and body) a worker
//! issues next.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use nexo_transfers::ledger::money::AMOUNT_MINOR_MAX;

use crate::Scenario;
use crate::fixture::Fixture;

/// Amounts are drawn from 1 to this many minor units: small against the
/// opening balances, so only the deliberate overdrafts are refused.
const AMOUNT_MINOR_DRAWN_MAX: i64 = 1_000;

/// How many of its own recent intents a `mixed` worker may retry or reuse.
const RECENT_INTENTS_MAX: usize = 64;

/// The account every `hot` transfer and every `hold` debits.
pub const HOT_ACCOUNT: u32 = 1;

/// One transfer intent: who sends it, under which key, with which body.
#[derive(Debug, Clone)]
pub struct Intent {
    pub principal: usize,
    pub key: Arc<str>,
    pub from: u32,
    pub to: u32,
    pub amount: i64,
    pub action: Action,
}

/// Which request an intent is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `POST /transfers`, posted at once.
    Transfer,
    /// `POST /transfers` with `mode: pending`.
    Hold,
    /// `POST /transfers/{id}/post` of the hold `id`, in full.
    PostHold(uuid::Uuid),
}

/// What a worker sends next.
#[derive(Debug, Clone)]
pub enum Step {
    /// One request.
    Send(Intent),
    /// The same intent twice at once.
    Twice(Intent),
    /// An earlier key with a different body: must be refused, and must not
    /// change what the key executed.
    Conflict(Intent),
    /// A hold, then (once it is made) its post under a key of its own.
    HoldThenPost(Intent),
}

/// What all workers of a run share.
pub struct Plan {
    pub scenario: Scenario,
    pub fixture: Fixture,
    /// Accounts 1..=accounts are drawn from.
    pub accounts: u32,
    pub storm_fanout: u32,
    /// Distinguishes this run's keys from earlier runs' on the same database.
    pub run_id: String,
    /// The completed intents `replay` sends again.
    pub replay_set: Vec<Intent>,
    next_storm: AtomicU64,
}

impl Plan {
    pub fn new(scenario: Scenario, fixture: Fixture, accounts: u32, storm_fanout: u32) -> Self {
        Self {
            scenario,
            fixture,
            accounts,
            storm_fanout,
            run_id: format!("{:08x}", rand::rng().random::<u32>()),
            replay_set: Vec::new(),
            next_storm: AtomicU64::new(0),
        }
    }

    /// A random transfer between two distinct accounts, debiting `from`
    /// (or a random account when `None`), under a fresh key.
    pub fn fresh(&self, rng: &mut impl Rng, from: Option<u32>, key: String) -> Intent {
        let from = from.unwrap_or_else(|| rng.random_range(1..=self.accounts));
        // Any other account: draw from one fewer and skip `from`.
        let mut to = rng.random_range(1..self.accounts);
        if to >= from {
            to += 1;
        }
        Intent {
            principal: self.fixture.owner_of(from),
            key: key.into(),
            from,
            to,
            amount: rng.random_range(1..=AMOUNT_MINOR_DRAWN_MAX),
            action: Action::Transfer,
        }
    }
}

impl Intent {
    /// The post of the hold this intent made, as `hold`, under a key
    /// derived from the hold's.
    pub fn post_of(&self, hold: uuid::Uuid) -> Self {
        Self {
            key: format!("{}-post", self.key).into(),
            action: Action::PostHold(hold),
            ..self.clone()
        }
    }
}

/// One worker's generator: its random source, its key counter and, for
/// `mixed`, its recent intents.
pub struct Worker {
    pub id: u32,
    rng: SmallRng,
    sent: u64,
    recent: VecDeque<Intent>,
}

impl Worker {
    pub fn new(id: u32) -> Self {
        Self {
            id,
            rng: SmallRng::from_rng(&mut rand::rng()),
            sent: 0,
            recent: VecDeque::with_capacity(RECENT_INTENTS_MAX),
        }
    }

    fn key(&mut self, plan: &Plan) -> String {
        self.sent += 1;
        format!("ld-{}-{}-{}", plan.run_id, self.id, self.sent)
    }

    pub fn next(&mut self, plan: &Plan) -> Step {
        match plan.scenario {
            Scenario::New => {
                let key = self.key(plan);
                Step::Send(plan.fresh(&mut self.rng, None, key))
            }
            Scenario::Hot => {
                let key = self.key(plan);
                Step::Send(plan.fresh(&mut self.rng, Some(HOT_ACCOUNT), key))
            }
            Scenario::Hold => {
                let key = self.key(plan);
                Step::HoldThenPost(Intent {
                    action: Action::Hold,
                    ..plan.fresh(&mut self.rng, Some(HOT_ACCOUNT), key)
                })
            }
            Scenario::Replay => {
                let i = self.rng.random_range(0..plan.replay_set.len());
                Step::Send(plan.replay_set[i].clone())
            }
            Scenario::Storm => {
                // Consecutive requests, whichever workers send them, share
                // a key, so up to `storm_fanout` of them are in flight at once.
                let n =
                    plan.next_storm.fetch_add(1, Ordering::Relaxed) / u64::from(plan.storm_fanout);
                // The intent is a function of its number: every sender of
                // one key sends the same body.
                let mut rng = SmallRng::seed_from_u64(n);
                Step::Send(plan.fresh(&mut rng, None, format!("storm-{}-{n}", plan.run_id)))
            }
            Scenario::Mixed => self.mixed(plan),
        }
    }

    /// 80% new intents, 10% retries of a recent one, 5% concurrent
    /// duplicates, 3% a recent key reused with another amount, 2% overdrafts.
    fn mixed(&mut self, plan: &Plan) -> Step {
        let roll = self.rng.random_range(0..100);
        let recent = (!self.recent.is_empty())
            .then(|| self.recent[self.rng.random_range(0..self.recent.len())].clone());
        match (roll, recent) {
            (80..90, Some(intent)) => Step::Send(intent),
            (90..95, _) => {
                let key = self.key(plan);
                let intent = plan.fresh(&mut self.rng, None, key);
                self.remember(intent.clone());
                Step::Twice(intent)
            }
            (95..98, Some(intent)) => Step::Conflict(Intent {
                amount: intent.amount % AMOUNT_MINOR_DRAWN_MAX + 1,
                ..intent
            }),
            (98.., _) => {
                let key = self.key(plan);
                let intent = Intent {
                    amount: AMOUNT_MINOR_MAX,
                    ..plan.fresh(&mut self.rng, None, key)
                };
                self.remember(intent.clone());
                Step::Send(intent)
            }
            _ => {
                let key = self.key(plan);
                let intent = plan.fresh(&mut self.rng, None, key);
                self.remember(intent.clone());
                Step::Send(intent)
            }
        }
    }

    fn remember(&mut self, intent: Intent) {
        if self.recent.len() == RECENT_INTENTS_MAX {
            self.recent.pop_front();
        }
        self.recent.push_back(intent);
    }
}
