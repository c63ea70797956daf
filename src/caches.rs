//! Bounded in-process caches that spare database round trips: which
//! principal a token belongs to, the owner and currency of an account, and
//! the stored answers of intents completed lately (so a replay touches no
//! database at all). Both are lookups whose answers (almost) never change; each
//! entry still expires so that a change made in the database is picked up
//! within a known time. Only positive answers are cached: a token or an
//! account created a moment ago is found at once, and requests with made-up
//! tokens or ids cannot fill the caches.

use std::time::{Duration, Instant};

use quick_cache::sync::Cache;

use crate::auth;
use crate::idempotency::{Fingerprint, StoredResponse};
use crate::ledger::Account;
use crate::principal::PrincipalId;

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

/// Completed answers remembered at once: about 1 KiB each (body, headers,
/// key), so at most about 10 MiB.
pub const REPLAY_CACHE_ENTRIES_MAX: usize = 10_000;

/// How long a completed answer is replayed from memory. A completed record
/// never changes until it expires, so the only staleness is past its expiry:
/// the entry lives at most a tenth of the record's TTL (see `Caches::new`),
/// and what it replays then is still the answer the key got, while the
/// transfers' permanent unique key keeps a later retry from moving money.
pub const REPLAY_CACHE_TTL: Duration = Duration::from_secs(60);

/// The owner and currency of an account: the facts checked before a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountFacts {
    pub principal_id: Option<PrincipalId>,
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
    principals: Cache<[u8; 32], (PrincipalId, Instant)>,
    accounts: Cache<String, (AccountFacts, Instant)>,
    /// By scope and key; the fingerprint must match to replay.
    replays: Cache<(PrincipalId, String), (Completed, Instant)>,
    replay_ttl: Duration,
}

#[derive(Clone)]
struct Completed {
    fingerprint: Fingerprint,
    response: StoredResponse,
}

impl Caches {
    /// `record_ttl` is how long idempotency records live.
    pub fn new(record_ttl: Duration) -> Self {
        Self {
            principals: Cache::new(PRINCIPAL_CACHE_ENTRIES_MAX),
            accounts: Cache::new(ACCOUNT_CACHE_ENTRIES_MAX),
            replays: Cache::new(REPLAY_CACHE_ENTRIES_MAX),
            replay_ttl: REPLAY_CACHE_TTL.min(record_ttl / 10),
        }
    }

    /// The stored answer of a completed intent, when it was seen lately
    /// with this same fingerprint. A different fingerprint is not answered
    /// here: the database decides (422, or a new intent after expiry).
    pub fn replay(
        &self,
        scope: PrincipalId,
        key: &str,
        fingerprint: &Fingerprint,
    ) -> Option<StoredResponse> {
        fresh(self.replays.get(&(scope, key.to_owned())), self.replay_ttl)
            .filter(|c| &c.fingerprint == fingerprint)
            .map(|c| c.response)
    }

    /// Remembers a completed answer: only ever one that the database holds
    /// as `COMPLETED` (just committed, or read back for a replay).
    pub fn remember_completed(
        &self,
        scope: PrincipalId,
        key: &str,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
    ) {
        let completed = Completed {
            fingerprint: *fingerprint,
            response: response.clone(),
        };
        self.replays
            .insert((scope, key.to_owned()), (completed, Instant::now()));
    }

    pub fn principal(&self, token: &str) -> Option<PrincipalId> {
        fresh(
            self.principals.get(&auth::token_sha256(token)),
            PRINCIPAL_CACHE_TTL,
        )
    }

    pub fn remember_principal(&self, token: &str, id: PrincipalId) {
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
    use uuid::Uuid;

    fn new_principal() -> PrincipalId {
        PrincipalId(Uuid::now_v7())
    }

    fn account(id: &str) -> Account {
        Account {
            id: id.to_owned(),
            principal_id: Some(new_principal()),
            currency: "USD".to_owned(),
            balance_minor: 5,
            held_minor: 0,
            allow_negative: false,
            event_seq: 0,
        }
    }

    fn caches() -> Caches {
        Caches::new(Duration::from_secs(24 * 3600))
    }

    #[test]
    fn a_remembered_principal_is_found_by_its_token_only() {
        let caches = caches();
        let principal = new_principal();
        caches.remember_principal("tok_a", principal);
        assert_eq!(caches.principal("tok_a"), Some(principal));
        assert_eq!(caches.principal("tok_b"), None);
    }

    #[test]
    fn a_remembered_account_keeps_its_owner_and_currency() {
        let caches = caches();
        let a = account("acc_1");
        caches.remember_account(&a);
        assert_eq!(caches.account("acc_1"), Some(AccountFacts::from(&a)));
        assert_eq!(caches.account("acc_2"), None);
    }

    #[test]
    fn a_completed_answer_replays_only_for_its_scope_key_and_fingerprint() {
        let caches = caches();
        let (scope, other_scope) = (new_principal(), new_principal());
        let fingerprint = Fingerprint::compute("POST", "/transfers", b"{}");
        let other = Fingerprint::compute("POST", "/transfers", b"{\"a\":1}");
        let response = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: vec![(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            )],
            body: bytes::Bytes::from_static(b"{}"),
        };
        caches.remember_completed(scope, "k1", &fingerprint, &response);
        assert_eq!(caches.replay(scope, "k1", &fingerprint), Some(response));
        assert_eq!(caches.replay(scope, "k1", &other), None);
        assert_eq!(caches.replay(scope, "k2", &fingerprint), None);
        assert_eq!(caches.replay(other_scope, "k1", &fingerprint), None);
    }

    #[test]
    fn replays_expire_well_before_short_lived_records() {
        assert_eq!(
            Caches::new(Duration::from_secs(20)).replay_ttl,
            Duration::from_secs(2)
        );
        assert_eq!(caches().replay_ttl, REPLAY_CACHE_TTL);
    }

    #[test]
    fn entries_older_than_their_ttl_are_not_used() {
        let at = Instant::now();
        assert_eq!(fresh(Some((1, at)), Duration::from_secs(60)), Some(1));
        assert_eq!(fresh(Some((1, at)), Duration::ZERO), None);
    }
}
