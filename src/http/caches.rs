//! Bounded in-process caches that spare a database round trip on every
//! request: which principal a token belongs to, and the owner and currency
//! of an account. Both are lookups whose answers (almost) never change; each
//! entry still expires so that a change made in the database is picked up
//! within a known time. Only positive answers are cached: a token or an
//! account created a moment ago is found at once, and requests with made-up
//! tokens or ids cannot fill the caches.

use std::time::{Duration, Instant};

use quick_cache::sync::Cache;
use uuid::Uuid;

use crate::auth;
use crate::ledger::Account;

/// Tokens remembered at once. An entry is about 64 bytes, so the cache stays
/// under a megabyte; far more than the active callers of one instance.
pub const PRINCIPAL_CACHE_ENTRIES_MAX: usize = 10_000;

/// How long a token keeps authenticating from memory: the longest a token
/// removed from the database (rotation, revocation) still works on an
/// instance. Short against that risk, long against the request rate, so the
/// hit rate under load stays near 100%.
pub const PRINCIPAL_CACHE_TTL: Duration = Duration::from_secs(10);

/// Accounts remembered at once (about 100 bytes each: a few MiB at most).
pub const ACCOUNT_CACHE_ENTRIES_MAX: usize = 50_000;

/// An account's owner and currency never change (no statement updates
/// them); the expiry only bounds how long an entry could outlive a future
/// operator action that did.
pub const ACCOUNT_CACHE_TTL: Duration = Duration::from_secs(60);

/// The owner and currency of an account: the facts checked before a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountFacts {
    pub principal_id: Option<Uuid>,
    pub currency: String,
}

impl From<&Account> for AccountFacts {
    fn from(a: &Account) -> Self {
        Self {
            principal_id: a.principal_id,
            currency: a.currency.clone(),
        }
    }
}

pub struct Caches {
    /// By the token's SHA-256, so no token is kept in memory.
    principals: Cache<[u8; 32], (Uuid, Instant)>,
    accounts: Cache<String, (AccountFacts, Instant)>,
}

impl Default for Caches {
    fn default() -> Self {
        Self {
            principals: Cache::new(PRINCIPAL_CACHE_ENTRIES_MAX),
            accounts: Cache::new(ACCOUNT_CACHE_ENTRIES_MAX),
        }
    }
}

impl Caches {
    pub fn principal(&self, token: &str) -> Option<Uuid> {
        fresh(
            self.principals.get(&auth::token_sha256(token)),
            PRINCIPAL_CACHE_TTL,
        )
    }

    pub fn remember_principal(&self, token: &str, id: Uuid) {
        self.principals
            .insert(auth::token_sha256(token), (id, Instant::now()));
    }

    pub fn account(&self, id: &str) -> Option<AccountFacts> {
        fresh(self.accounts.get(id), ACCOUNT_CACHE_TTL)
    }

    pub fn remember_account(&self, account: &Account) {
        self.accounts
            .insert(account.id.clone(), (account.into(), Instant::now()));
    }
}

fn fresh<T>(entry: Option<(T, Instant)>, ttl: Duration) -> Option<T> {
    entry.and_then(|(value, at)| (at.elapsed() < ttl).then_some(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(id: &str) -> Account {
        Account {
            id: id.to_owned(),
            principal_id: Some(Uuid::now_v7()),
            currency: "USD".to_owned(),
            balance_minor: 5,
            allow_negative: false,
        }
    }

    #[test]
    fn a_remembered_principal_is_found_by_its_token_only() {
        let caches = Caches::default();
        let id = Uuid::now_v7();
        caches.remember_principal("tok_a", id);
        assert_eq!(caches.principal("tok_a"), Some(id));
        assert_eq!(caches.principal("tok_b"), None);
    }

    #[test]
    fn a_remembered_account_keeps_its_owner_and_currency() {
        let caches = Caches::default();
        let a = account("acc_1");
        caches.remember_account(&a);
        assert_eq!(caches.account("acc_1"), Some(AccountFacts::from(&a)));
        assert_eq!(caches.account("acc_2"), None);
    }

    #[test]
    fn entries_older_than_their_ttl_are_not_used() {
        let at = Instant::now();
        assert_eq!(fresh(Some((1, at)), Duration::from_secs(60)), Some(1));
        assert_eq!(fresh(Some((1, at)), Duration::ZERO), None);
    }
}
