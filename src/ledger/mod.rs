//! The double-entry ledger: accounts, transfers and their entries. Knows
//! nothing of HTTP or of idempotency records; callers hand it a connection
//! inside their transaction.

pub mod events;
pub mod holds;
pub mod money;
pub mod plan;
pub mod repo;
pub mod reversals;

use uuid::Uuid;

pub use money::{AccountId, AmountMinor, Currency, Description};
pub use repo::{Account, Entry, LockMode, PostingKind, PostingOutcome, PostingRequest, Transfer};

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("account {0} does not exist")]
    AccountNotFound(String),
    #[error("transfer currency {transfer} does not match account {account} ({account_currency})")]
    CurrencyMismatch {
        transfer: String,
        account: String,
        account_currency: String,
    },
    /// A posting would take a balance past what a 64-bit integer holds.
    #[error("the balance of account {0} would be out of range")]
    BalanceOutOfRange(String),
    /// Some request's (principal, key) already has a transfer, found only
    /// when writing: nothing was written, and the caller must roll back and
    /// post again looking the keys up first (`KeyLookup::First`).
    #[error("a key of the batch already has its transfer")]
    KeyAlreadyUsed,
    /// The posting statement wrote something other than what was planned
    /// under the accounts' locks; the caller must roll back.
    #[error("posting statement disagreed with its plan: {0}")]
    PlanMismatch(#[from] PlanMismatch),
    /// A hold this transaction locked as pending was not (an invariant
    /// broken: its row lock keeps others from changing it).
    #[error("hold {0} is no longer pending")]
    HoldNotPending(Uuid),
    #[error("database error")]
    Database(#[from] sqlx::Error),
}

/// How a written batch differed from its plan.
#[derive(Debug, thiserror::Error)]
pub enum PlanMismatch {
    #[error("{written} of {planned} transfers written")]
    TransfersWritten { written: usize, planned: usize },
    #[error("{moved} accounts moved, {planned} planned")]
    AccountsMoved { moved: usize, planned: usize },
    #[error("transfer {0} written without its entries")]
    MissingEntries(Uuid),
    #[error("transfer {0} has entries out of order")]
    EntryOrder(Uuid),
    #[error("{written} of {planned} events written")]
    EventsWritten { written: usize, planned: usize },
    /// A value read back from the database that its constraints should
    /// have kept valid.
    #[error("{0}")]
    StoredValue(String),
}
