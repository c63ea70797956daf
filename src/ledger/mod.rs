//! The double-entry ledger: accounts, transfers and their entries. Knows
//! nothing of HTTP or of idempotency records; callers hand it a connection
//! inside their transaction.

pub mod money;
pub mod repo;

pub use money::{AccountId, AmountMinor, Currency, Description};
pub use repo::{Account, Entry, PostingOutcome, PostingRequest, Transfer};

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
    /// A batch posting wrote something other than what was planned under
    /// the accounts' locks; the caller must roll back.
    #[error("posting statement disagreed with its plan: {0}")]
    PlanMismatch(String),
    #[error("database error")]
    Database(#[from] sqlx::Error),
}
