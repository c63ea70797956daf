//! RFC 9457 problem documents, the body of every error answer.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A problem document as the server writes it. `type_uri` is the relative
/// reference `/problems/{slug}`; branch on [`Problem::problem_type`], not
/// on `title` or `detail`, which are for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    #[serde(rename = "type")]
    pub type_uri: String,
    #[serde(default)]
    pub title: String,
    pub status: u16,
    #[serde(default)]
    pub detail: String,
    /// The JSON field, query parameter or header at fault, when one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param: Option<String>,
    /// The `x-request-id` of the request that got this answer: quote it
    /// when asking what happened. A refusal replayed under a key keeps the
    /// id of the request that first got it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

impl Problem {
    /// The last segment of `type`: `insufficient-funds` for
    /// `/problems/insufficient-funds`.
    pub fn slug(&self) -> &str {
        self.type_uri
            .rsplit('/')
            .next()
            .unwrap_or(self.type_uri.as_str())
    }

    pub fn problem_type(&self) -> ProblemType {
        ProblemType::from_slug(self.slug())
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.status, self.slug())?;
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        if let Some(param) = &self.param {
            write!(f, " (param {param})")?;
        }
        if let Some(id) = &self.request_id {
            write!(f, " [request {id}]")?;
        }
        Ok(())
    }
}

macro_rules! problem_types {
    ($($(#[$doc:meta])* $variant:ident = $slug:literal,)*) => {
        /// Every problem type the server documents (docs/problems.md), by
        /// its slug. A slug this client does not know is `Other`.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub enum ProblemType {
            $($(#[$doc])* $variant,)*
            Other(String),
        }

        impl ProblemType {
            pub fn from_slug(slug: &str) -> Self {
                match slug {
                    $($slug => Self::$variant,)*
                    other => Self::Other(other.to_owned()),
                }
            }

            pub fn slug(&self) -> &str {
                match self {
                    $(Self::$variant => $slug,)*
                    Self::Other(slug) => slug,
                }
            }
        }
    };
}

problem_types! {
    /// 401: missing, malformed or unknown bearer token.
    Unauthorized = "unauthorized",
    /// 400: `POST /transfers` without a key (this client always sends one).
    MissingIdempotencyKey = "missing-idempotency-key",
    /// 400: a key the server does not accept.
    InvalidIdempotencyKey = "invalid-idempotency-key",
    /// 415: the body is not `Content-Type: application/json`.
    UnsupportedMediaType = "unsupported-media-type",
    /// 413: the body is larger than the server accepts.
    PayloadTooLarge = "payload-too-large",
    /// 400: not JSON, unknown or duplicated fields, a value of the wrong type.
    MalformedRequest = "malformed-request",
    /// 422: `amount_minor` not between 1 and 10^14.
    InvalidAmount = "invalid-amount",
    /// 422: not a currency the ledger holds.
    UnsupportedCurrency = "unsupported-currency",
    /// 422: an account holds another currency.
    CurrencyMismatch = "currency-mismatch",
    /// 422: `from` and `to` are the same account.
    SameAccount = "same-account",
    /// 422: an account id that is not `acc_` and 1 to 40 letters or digits.
    InvalidAccountId = "invalid-account-id",
    /// 422: the `to` account does not exist.
    UnknownDestination = "unknown-destination",
    /// 422: a description over 140 characters or with control characters.
    InvalidDescription = "invalid-description",
    /// 422: `mode` is not `immediate` or `pending` (or a batch's transfer
    /// is pending).
    InvalidMode = "invalid-mode",
    /// 422: `expires_in_seconds` out of 1 to 30 days, or without `mode:
    /// pending`.
    InvalidExpiry = "invalid-expiry",
    /// 422: a batch with no transfers or more than 100.
    InvalidBatch = "invalid-batch",
    /// 409: a post or void of a transfer that is no longer pending; stored.
    TransferNotPending = "transfer-not-pending",
    /// 409: a reversal of a transfer that was never posted.
    TransferNotPosted = "transfer-not-posted",
    /// 422: reversals beyond what the transfer moved; stored.
    ReversalExceedsTransfer = "reversal-exceeds-transfer",
    /// 400: a bad query parameter on a listing.
    InvalidQuery = "invalid-query",
    /// 400: `after` on `GET /events` is not a cursor the server handed out.
    InvalidEventCursor = "invalid-event-cursor",
    /// 422: a webhook endpoint's URL or event types are not accepted.
    InvalidWebhookEndpoint = "invalid-webhook-endpoint",
    /// 422: the principal has as many webhook endpoints as allowed.
    TooManyWebhookEndpoints = "too-many-webhook-endpoints",
    /// 409: the principal already registered this URL; `detail` links it.
    WebhookEndpointExists = "webhook-endpoint-exists",
    /// 422: a redelivery request names nothing that can be sent again.
    InvalidRedelivery = "invalid-redelivery",
    /// 404: no such resource, or another principal's.
    NotFound = "not-found",
    /// 405: the path exists, the method does not.
    MethodNotAllowed = "method-not-allowed",
    /// 422: the key was used for a different request. A new intent needs a
    /// new key.
    IdempotencyKeyReused = "idempotency-key-reused",
    /// 409: another request with the key is still running; retry after
    /// `Retry-After`.
    RequestInFlight = "request-in-flight",
    /// 409: the key's intent was cancelled; nothing with it executes.
    IntentCancelled = "intent-cancelled",
    /// 409: a cancellation came after the intent completed; its answer
    /// stands.
    IntentCompleted = "intent-completed",
    /// 422: the source balance cannot cover the amount; stored and replayed
    /// like a success.
    InsufficientFunds = "insufficient-funds",
    /// 429: too many requests; retry after `Retry-After`.
    RateLimited = "rate-limited",
    /// 503: retry with the same key after `Retry-After`.
    ServiceUnavailable = "service-unavailable",
    /// 500: nothing was committed for the attempt; retry with the same key.
    InternalError = "internal-error",
}

impl fmt::Display for ProblemType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.slug())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_problem_document_and_its_slug() {
        let problem: Problem = serde_json::from_str(
            r#"{"type":"/problems/invalid-amount","title":"Invalid amount","status":422,"detail":"amount_minor must be positive","param":"amount_minor","request_id":"r-1"}"#,
        )
        .unwrap();
        assert_eq!(problem.slug(), "invalid-amount");
        assert_eq!(problem.problem_type(), ProblemType::InvalidAmount);
        assert_eq!(problem.param.as_deref(), Some("amount_minor"));
        assert_eq!(problem.request_id.as_deref(), Some("r-1"));
    }

    #[test]
    fn an_unknown_slug_is_kept() {
        let kind = ProblemType::from_slug("brand-new");
        assert_eq!(kind, ProblemType::Other("brand-new".to_owned()));
        assert_eq!(kind.slug(), "brand-new");
    }

    /// The server's catalogue of problem types is docs/problems.md; a slug
    /// added there and not here would reach callers as `Other`.
    #[test]
    fn every_documented_slug_has_its_own_variant() {
        let catalogue = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/problems.md"
        ))
        .unwrap();
        let slugs: Vec<&str> = catalogue
            .lines()
            .filter_map(|line| line.strip_prefix("| `"))
            .filter_map(|rest| rest.split('`').next())
            .collect();
        assert!(slugs.len() >= 20, "the table was found: {slugs:?}");
        for slug in slugs {
            let kind = ProblemType::from_slug(slug);
            assert!(!matches!(kind, ProblemType::Other(_)), "{slug}");
            assert_eq!(kind.slug(), slug);
        }
    }
}
