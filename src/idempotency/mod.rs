//! Idempotency keys: parse the key, fingerprint the request, claim the key
//! insert-first, complete it fenced inside the caller's transaction, or
//! release it. Knows nothing of the ledger or of HTTP routing: what a key
//! protects is whatever the caller completes it with.

pub mod claims;
mod fingerprint;
mod key;
pub mod store;

pub use fingerprint::Fingerprint;
pub use key::{HEADER_NAME, IDEMPOTENCY_KEY_LEN_MAX, IdempotencyKey, KeyError};
pub use store::{
    Answer, Claim, ClaimOutcome, Completing, KeyStatus, Outcome, Policy, StoredResponse,
};
