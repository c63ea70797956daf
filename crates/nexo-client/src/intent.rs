//! A transfer intent: one request and the one key that names it.

use bytes::Bytes;
use serde::Serialize;
use uuid::Uuid;

use crate::client::Attempt;
use crate::key::IdempotencyKey;
use crate::model::{Transfer, TransferRequest};

/// What an intent asks the server to do: every one of them changes the
/// ledger, so every one is sent under an idempotency key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Operation {
    /// `POST /transfers`: a transfer, or a hold (`TransferRequest::pending`).
    Transfer(TransferRequest),
    /// `POST /transfers/{id}/post`: posts a hold, in full or (with an
    /// amount) in part, releasing the rest.
    PostHold {
        transfer_id: Uuid,
        amount_minor: Option<i64>,
    },
    /// `POST /transfers/{id}/void`: releases a hold; nothing moves.
    VoidHold { transfer_id: Uuid },
    /// `POST /transfers/{id}/reverse`: gives back (part of) a posted
    /// transfer, asked by its destination's owner.
    Reverse {
        transfer_id: Uuid,
        amount_minor: Option<i64>,
    },
}

/// The body of a post or a reversal: the amount, when one is named.
#[derive(Serialize)]
struct AmountBody {
    #[serde(skip_serializing_if = "Option::is_none")]
    amount_minor: Option<i64>,
}

impl Operation {
    /// How attempts name the route.
    pub(crate) fn route(&self) -> &'static str {
        match self {
            Self::Transfer(_) => "POST /transfers",
            Self::PostHold { .. } => "POST /transfers/{transfer_id}/post",
            Self::VoidHold { .. } => "POST /transfers/{transfer_id}/void",
            Self::Reverse { .. } => "POST /transfers/{transfer_id}/reverse",
        }
    }

    /// The path's segments after the base URL.
    pub(crate) fn segments(&self) -> Vec<String> {
        let on = |id: &Uuid, action: &str| {
            vec!["transfers".to_owned(), id.to_string(), action.to_owned()]
        };
        match self {
            Self::Transfer(_) => vec!["transfers".to_owned()],
            Self::PostHold { transfer_id, .. } => on(transfer_id, "post"),
            Self::VoidHold { transfer_id } => on(transfer_id, "void"),
            Self::Reverse { transfer_id, .. } => on(transfer_id, "reverse"),
        }
    }
}

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
///
/// The same holds for the steps of a hold's life and for reversals: each
/// is an intent of its own ([`TransferIntent::post_hold`],
/// [`TransferIntent::void_hold`], [`TransferIntent::reverse`]) under its
/// own key, so a retried capture captures once.
#[derive(Debug, Clone)]
pub struct TransferIntent {
    key: IdempotencyKey,
    operation: Operation,
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
        Self::resume_operation(key, Operation::Transfer(request))
    }

    /// Posts the hold `transfer_id`: all of it, or `amount_minor` of it
    /// (the rest is released). A new key.
    pub fn post_hold(transfer_id: Uuid, amount_minor: Option<i64>) -> Self {
        Self::resume_operation(
            IdempotencyKey::generate(),
            Operation::PostHold {
                transfer_id,
                amount_minor,
            },
        )
    }

    /// Voids the hold `transfer_id`. A new key.
    pub fn void_hold(transfer_id: Uuid) -> Self {
        Self::resume_operation(
            IdempotencyKey::generate(),
            Operation::VoidHold { transfer_id },
        )
    }

    /// Reverses the posted transfer `transfer_id`: all of what is left of
    /// it, or `amount_minor`. A new key.
    pub fn reverse(transfer_id: Uuid, amount_minor: Option<i64>) -> Self {
        Self::resume_operation(
            IdempotencyKey::generate(),
            Operation::Reverse {
                transfer_id,
                amount_minor,
            },
        )
    }

    /// Any operation sent before under `key`, as [`TransferIntent::resume`].
    pub fn resume_operation(key: IdempotencyKey, operation: Operation) -> Self {
        let body = Bytes::from(body_of(&operation));
        Self {
            key,
            operation,
            body,
        }
    }

    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    pub fn operation(&self) -> &Operation {
        &self.operation
    }

    /// The transfer request, for an intent made by [`TransferIntent::new`]
    /// or [`TransferIntent::resume`].
    pub fn request(&self) -> Option<&TransferRequest> {
        match &self.operation {
            Operation::Transfer(request) => Some(request),
            _ => None,
        }
    }

    /// The exact bytes every attempt sends.
    pub fn body(&self) -> &Bytes {
        &self.body
    }
}

#[expect(
    clippy::expect_used,
    reason = "structs of strings and integers always serialise to JSON"
)]
fn body_of(operation: &Operation) -> Vec<u8> {
    match operation {
        Operation::Transfer(request) => serde_json::to_vec(request),
        Operation::PostHold { amount_minor, .. } | Operation::Reverse { amount_minor, .. } => {
            serde_json::to_vec(&AmountBody {
                amount_minor: *amount_minor,
            })
        }
        Operation::VoidHold { .. } => Ok(b"{}".to_vec()),
    }
    .expect("a request body serialises")
}

/// The transfer an intent made (or posted, voided, reversed), as the
/// answer that settled it said.
#[derive(Debug, Clone)]
pub struct TransferOutcome {
    pub key: IdempotencyKey,
    /// For a post or a void, the hold as it now stands; for a reversal,
    /// the reversal itself.
    pub transfer: Transfer,
    /// 201 for a transfer, a hold or a reversal; 200 for a post or a void.
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

    #[test]
    fn a_hold_s_steps_have_their_own_keys_and_bodies() {
        let id = Uuid::nil();
        let (post, partial, void, reverse) = (
            TransferIntent::post_hold(id, None),
            TransferIntent::post_hold(id, Some(40)),
            TransferIntent::void_hold(id),
            TransferIntent::reverse(id, Some(5)),
        );
        assert_ne!(post.key(), partial.key());
        assert_eq!(post.body().as_ref(), b"{}");
        assert_eq!(partial.body().as_ref(), br#"{"amount_minor":40}"#);
        assert_eq!(void.body().as_ref(), b"{}");
        assert_eq!(reverse.body().as_ref(), br#"{"amount_minor":5}"#);
        assert_eq!(
            partial.operation().segments(),
            ["transfers", "00000000-0000-0000-0000-000000000000", "post"]
        );
        assert_eq!(void.request(), None);
    }
}
