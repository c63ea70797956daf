//! A transfer intent: one request and the one key that names it.

use bytes::Bytes;

use crate::client::Attempt;
use crate::key::IdempotencyKey;
use crate::model::{Transfer, TransferRequest};

/// One transfer the caller means to make, and the idempotency key that
/// names it. The key is made with the intent and the body is serialised
/// once, when the intent is made; neither can be changed afterwards, so
/// every attempt of the intent, however often it is sent, carries the same
/// key and the same bytes, and the server executes it at most once.
///
/// A new intent is a new transfer: [`TransferIntent::new`] always makes a
/// new key, even for a request equal to an earlier one (two rent payments
/// of the same amount are two transfers). To learn what became of an
/// intent sent earlier (by a process that crashed, say), resume it with
/// its key and its original request.
#[derive(Debug, Clone)]
pub struct TransferIntent {
    key: IdempotencyKey,
    request: TransferRequest,
    body: Bytes,
}

impl TransferIntent {
    /// A new intent under a fresh key (a random UUID v4).
    pub fn new(request: TransferRequest) -> Self {
        Self::resume(IdempotencyKey::generate(), request)
    }

    /// An intent sent before under `key`. The request must be the original
    /// one: another body under the same key is refused with
    /// `idempotency-key-reused`, and nothing executes.
    pub fn resume(key: IdempotencyKey, request: TransferRequest) -> Self {
        let body = Bytes::from(body_of(&request));
        Self { key, request, body }
    }

    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    pub fn request(&self) -> &TransferRequest {
        &self.request
    }

    /// The exact bytes every attempt sends.
    pub fn body(&self) -> &Bytes {
        &self.body
    }
}

#[expect(
    clippy::expect_used,
    reason = "a struct of strings and an integer always serialises to JSON"
)]
fn body_of(request: &TransferRequest) -> Vec<u8> {
    serde_json::to_vec(request).expect("a transfer request serialises")
}

/// The transfer an intent made, as the answer that settled it said.
#[derive(Debug, Clone)]
pub struct TransferOutcome {
    pub key: IdempotencyKey,
    pub transfer: Transfer,
    /// 201.
    pub status: u16,
    /// `Idempotent-Replayed: true`: the stored answer of an earlier
    /// attempt (whose answer was lost, or which another process sent). The
    /// money moved once either way.
    pub replayed: bool,
    /// `Location`: the transfer's path.
    pub location: Option<String>,
    /// The body as received, byte for byte: a replay's bytes equal the
    /// original answer's.
    pub body: Bytes,
    /// Every attempt the call made; the last one got this answer.
    pub attempts: Vec<Attempt>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> TransferRequest {
        TransferRequest::new("acc_00001", "acc_00002", 100, "USD")
    }

    #[test]
    fn every_new_intent_gets_its_own_key() {
        let (first, second) = (
            TransferIntent::new(request()),
            TransferIntent::new(request()),
        );
        assert_ne!(first.key(), second.key());
        assert_eq!(first.body(), second.body());
    }

    #[test]
    fn a_resumed_intent_keeps_its_key_and_sends_the_same_bytes() {
        let original = TransferIntent::new(request());
        let resumed = TransferIntent::resume(original.key().clone(), request());
        assert_eq!(resumed.key(), original.key());
        assert_eq!(resumed.body(), original.body());
        let clone = original.clone();
        assert_eq!(clone.key(), original.key());
    }
}
