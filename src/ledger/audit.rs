//! Reconciliation: the ledger's invariants checked on its rows, for tests,
//! the load generator and operators alike.

use serde::Serialize;
use sqlx::PgExecutor;

/// How many rows break each invariant; all zero on a consistent ledger.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Reconciliation {
    /// Transfers without exactly one debit of their amount on the source
    /// and one credit of it on the destination.
    pub transfers_not_double_entry: i64,
    /// Accounts whose balance differs from the sum of their entries.
    pub balances_drifted: i64,
    /// Currencies whose balances do not sum to zero.
    pub currencies_unbalanced: i64,
    /// Customer accounts below zero.
    pub customer_balances_negative: i64,
}

impl Reconciliation {
    pub fn is_consistent(&self) -> bool {
        *self == Self::default()
    }
}

/// Reads the whole ledger once: linear in transfers and entries, so meant
/// for tests, benchmarks and operators, never for a request path.
pub async fn reconcile<'e>(executor: impl PgExecutor<'e>) -> Result<Reconciliation, sqlx::Error> {
    sqlx::query_as(
        "SELECT
           (SELECT count(*) FROM transfers t
            WHERE (SELECT count(*) FROM ledger_entries e WHERE e.transfer_id = t.id) <> 2
               OR NOT EXISTS (SELECT 1 FROM ledger_entries e WHERE e.transfer_id = t.id
                              AND e.account_id = t.from_account AND e.amount_minor = -t.amount_minor)
               OR NOT EXISTS (SELECT 1 FROM ledger_entries e WHERE e.transfer_id = t.id
                              AND e.account_id = t.to_account AND e.amount_minor = t.amount_minor))
             AS transfers_not_double_entry,
           (SELECT count(*) FROM accounts a
            WHERE a.balance_minor <> COALESCE((SELECT sum(amount_minor) FROM ledger_entries e
                                               WHERE e.account_id = a.id), 0))
             AS balances_drifted,
           (SELECT count(*) FROM (SELECT currency FROM accounts GROUP BY currency
                                  HAVING sum(balance_minor) <> 0) c)
             AS currencies_unbalanced,
           (SELECT count(*) FROM accounts WHERE balance_minor < 0 AND NOT allow_negative)
             AS customer_balances_negative",
    )
    .fetch_one(executor)
    .await
}
