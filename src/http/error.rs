//! One error type for the HTTP API, rendered as RFC 9457 problem details.
//! Each kind has a stable `type` URI; 5xx bodies never carry internal text
//! (the cause is logged instead).

use std::borrow::Cow;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use crate::db;
use crate::idempotency::KeyError;
use crate::problem::Problem;
pub use crate::problem::{PROBLEM_CONTENT_TYPE, PROBLEM_TYPE_BASE};
pub use crate::transfers::intent::ValidationKind;
use crate::transfers::{
    IN_FLIGHT_RETRY_AFTER_SECS, Rejection, RetryReason, TransferError, posting::RETRY_AFTER_SECS,
};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or invalid bearer token")]
    Unauthorized,
    #[error("{0}")]
    IdempotencyKey(KeyError),
    #[error("request bodies must be application/json")]
    UnsupportedMediaType,
    #[error("the request body is larger than the server accepts")]
    PayloadTooLarge,
    /// The body is not JSON of the expected shape; `param` names the field
    /// at fault when the parser could tell.
    #[error("{detail}")]
    MalformedRequest {
        detail: String,
        param: Option<String>,
    },
    #[error("{detail}")]
    Validation {
        kind: ValidationKind,
        param: &'static str,
        detail: String,
    },
    /// A query parameter is wrong (`param`), or one is not accepted.
    #[error("{detail}")]
    InvalidQuery {
        param: Option<&'static str>,
        detail: String,
    },
    /// `after` on `GET /events` is not a cursor the feed handed out.
    #[error(
        "after must be a next_after, or an event's cursor, from an earlier answer of GET /events"
    )]
    InvalidEventCursor,
    /// A webhook endpoint's `url` or `event_types` is not acceptable.
    #[error("{detail}")]
    InvalidWebhookEndpoint { param: &'static str, detail: String },
    #[error(
        "a principal may register at most {} webhook endpoints",
        crate::webhooks::ENDPOINTS_MAX
    )]
    TooManyWebhookEndpoints,
    /// The caller already registered this URL: the existing endpoint.
    #[error("this URL is already registered as webhook endpoint {existing}")]
    WebhookEndpointExists { existing: uuid::Uuid },
    #[error("{detail}")]
    InvalidRedelivery { detail: String },
    #[error("not found")]
    NotFound,
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("this idempotency key was already used for a different request")]
    IdempotencyKeyReused,
    #[error("a request with this idempotency key is still being processed")]
    RequestInFlight { retry_after_secs: u64 },
    #[error("the source account balance cannot cover this transfer")]
    InsufficientFunds,
    /// Names the request that cancelled the intent, so every refusal is
    /// the same document.
    #[error("the intent of this idempotency key was cancelled")]
    IntentCancelled { request_id: Option<String> },
    /// The key's intent completed, so it cannot be cancelled.
    #[error("the intent of this idempotency key already completed")]
    IntentCompleted { transfer_id: Option<uuid::Uuid> },
    #[error("too many requests")]
    RateLimited { retry_after_secs: u64 },
    #[error("the service is temporarily unavailable")]
    ServiceUnavailable,
    /// The transfer was not posted for a reason the client can wait out.
    #[error("{0}")]
    NotPostedNow(RetryReason),
    /// Refused before any key was claimed, for a reason that will not
    /// change (the transfer is not pending).
    #[error("{0:?}")]
    Rejected(Rejection),
    #[error("internal error")]
    Internal,
}

impl ApiError {
    pub fn invalid_query(param: &'static str, detail: impl Into<String>) -> Self {
        Self::InvalidQuery {
            param: Some(param),
            detail: detail.into(),
        }
    }

    /// A query string that does not parse: some parameter is not accepted.
    pub fn unexpected_query(accepted: &str) -> Self {
        Self::InvalidQuery {
            param: None,
            detail: format!("the accepted query parameters are {accepted}"),
        }
    }

    /// The field, query parameter or header at fault.
    fn param(&self) -> Option<Cow<'static, str>> {
        match self {
            Self::Validation { param, .. } => Some(Cow::Borrowed(param)),
            Self::InvalidQuery { param, .. } => param.map(Cow::Borrowed),
            Self::InvalidEventCursor => Some(Cow::Borrowed("after")),
            Self::InvalidWebhookEndpoint { param, .. } => Some(Cow::Borrowed(param)),
            Self::WebhookEndpointExists { .. } => Some(Cow::Borrowed("url")),
            Self::MalformedRequest { param, .. } => param.clone().map(Cow::Owned),
            Self::IdempotencyKey(_) | Self::IdempotencyKeyReused => {
                Some(Cow::Borrowed("Idempotency-Key"))
            }
            Self::UnsupportedMediaType => Some(Cow::Borrowed("Content-Type")),
            Self::Unauthorized => Some(Cow::Borrowed("Authorization")),
            Self::InsufficientFunds => Some(Cow::Borrowed("amount_minor")),
            Self::Rejected(rejection) => rejection.problem().param,
            _ => None,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::IdempotencyKey(_)
            | Self::MalformedRequest { .. }
            | Self::InvalidQuery { .. }
            | Self::InvalidEventCursor => StatusCode::BAD_REQUEST,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Validation { .. }
            | Self::IdempotencyKeyReused
            | Self::InsufficientFunds
            | Self::InvalidWebhookEndpoint { .. }
            | Self::TooManyWebhookEndpoints
            | Self::InvalidRedelivery { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::WebhookEndpointExists { .. } => StatusCode::CONFLICT,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::RequestInFlight { .. }
            | Self::IntentCancelled { .. }
            | Self::IntentCompleted { .. } => StatusCode::CONFLICT,
            Self::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::ServiceUnavailable | Self::NotPostedNow(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Rejected(rejection) => rejection.problem().status,
            Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable last segment of the problem `type` URI.
    pub fn slug(&self) -> &'static str {
        match self {
            Self::Unauthorized => "unauthorized",
            Self::IdempotencyKey(KeyError::Missing) => "missing-idempotency-key",
            Self::IdempotencyKey(_) => "invalid-idempotency-key",
            Self::UnsupportedMediaType => "unsupported-media-type",
            Self::PayloadTooLarge => "payload-too-large",
            Self::MalformedRequest { .. } => "malformed-request",
            Self::Validation { kind, .. } => kind.slug(),
            Self::InvalidQuery { .. } => "invalid-query",
            Self::InvalidEventCursor => "invalid-event-cursor",
            Self::InvalidWebhookEndpoint { .. } => "invalid-webhook-endpoint",
            Self::TooManyWebhookEndpoints => "too-many-webhook-endpoints",
            Self::WebhookEndpointExists { .. } => "webhook-endpoint-exists",
            Self::InvalidRedelivery { .. } => "invalid-redelivery",
            Self::NotFound => "not-found",
            Self::MethodNotAllowed => "method-not-allowed",
            Self::IdempotencyKeyReused => "idempotency-key-reused",
            Self::RequestInFlight { .. } => "request-in-flight",
            Self::IntentCancelled { .. } => "intent-cancelled",
            Self::IntentCompleted { .. } => "intent-completed",
            Self::InsufficientFunds => "insufficient-funds",
            Self::RateLimited { .. } => "rate-limited",
            Self::ServiceUnavailable | Self::NotPostedNow(_) => "service-unavailable",
            Self::Rejected(rejection) => rejection.problem().slug,
            Self::Internal => "internal-error",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Self::Unauthorized => "Unauthorized",
            Self::IdempotencyKey(KeyError::Missing) => "Missing Idempotency-Key",
            Self::IdempotencyKey(_) => "Invalid Idempotency-Key",
            Self::UnsupportedMediaType => "Unsupported media type",
            Self::PayloadTooLarge => "Payload too large",
            Self::MalformedRequest { .. } => "Malformed request",
            Self::Validation { kind, .. } => kind.title(),
            Self::InvalidQuery { .. } => "Invalid query parameter",
            Self::InvalidEventCursor => "Invalid event cursor",
            Self::InvalidWebhookEndpoint { .. } => "Invalid webhook endpoint",
            Self::TooManyWebhookEndpoints => "Too many webhook endpoints",
            Self::WebhookEndpointExists { .. } => "Webhook endpoint already registered",
            Self::InvalidRedelivery { .. } => "Invalid redelivery",
            Self::NotFound => "Not found",
            Self::MethodNotAllowed => "Method not allowed",
            Self::IdempotencyKeyReused => "Idempotency key reused",
            Self::RequestInFlight { .. } => "Request in flight",
            Self::IntentCancelled { .. } => "Intent cancelled",
            Self::IntentCompleted { .. } => "Intent already completed",
            Self::InsufficientFunds => "Insufficient funds",
            Self::RateLimited { .. } => "Too many requests",
            Self::ServiceUnavailable | Self::NotPostedNow(_) => "Service unavailable",
            Self::Rejected(rejection) => rejection.problem().title,
            Self::Internal => "Internal server error",
        }
    }

    fn detail(&self) -> String {
        match self {
            Self::Unauthorized => {
                "send a valid token as `Authorization: Bearer <token>`".to_owned()
            }
            Self::IdempotencyKey(KeyError::Missing) => format!(
                "{self}; send one unique key per transfer intent, e.g. a UUID, and the same key on every retry"
            ),
            Self::RequestInFlight { .. } => {
                format!("{self}; retry later with the same key and body to get its result")
            }
            Self::IntentCancelled { .. } => format!(
                "{self}: no request with this key executes within its retention; use a new key for a new transfer"
            ),
            Self::IntentCompleted {
                transfer_id: Some(id),
            } => format!(
                "{self} and moved money: /transfers/{id}; a completed transfer is undone by a reversal, not a cancellation"
            ),
            Self::IntentCompleted { transfer_id: None } => {
                format!("{self}; its stored answer stands")
            }
            Self::WebhookEndpointExists { existing } => {
                format!("{self}: /webhook-endpoints/{existing}")
            }
            Self::IdempotencyKeyReused => Rejection::KeyReused.problem().detail,
            Self::InsufficientFunds => Rejection::InsufficientFunds.problem().detail,
            Self::Rejected(rejection) => rejection.problem().detail,
            Self::ServiceUnavailable | Self::NotPostedNow(_) => {
                format!("{self}; retry with the same idempotency key, it is safe")
            }
            Self::Internal => format!(
                "{self}; nothing was committed for this attempt, retry with the same idempotency key"
            ),
            other => other.to_string(),
        }
    }

    fn retry_after_secs(&self) -> Option<u64> {
        match self {
            Self::RequestInFlight { retry_after_secs } | Self::RateLimited { retry_after_secs } => {
                Some(*retry_after_secs)
            }
            Self::ServiceUnavailable | Self::NotPostedNow(_) => Some(RETRY_AFTER_SECS),
            _ => None,
        }
    }

    /// This error as a problem document.
    pub fn problem(&self) -> Problem {
        let request_id = match self {
            Self::IntentCancelled { request_id } => request_id.clone(),
            _ => None,
        };
        Problem {
            param: self.param(),
            request_id,
            ..Problem::new(self.slug(), self.title(), self.status(), self.detail())
        }
    }

    /// The problem document's exact bytes.
    pub fn body(&self) -> Bytes {
        self.problem().body()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status(),
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(PROBLEM_CONTENT_TYPE),
            )],
            self.body(),
        )
            .into_response();
        let headers = response.headers_mut();
        if let Some(secs) = self.retry_after_secs() {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if matches!(self, Self::Unauthorized) {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"nexo-transfers\""),
            );
        }
        // Lets the logging middleware record the problem type without
        // parsing the body.
        response.extensions_mut().insert(ProblemSlug(self.slug()));
        // A cancellation written before request ids were kept: its refusal
        // must be the same bytes on every retry, so none is added.
        if matches!(self, Self::IntentCancelled { request_id: None }) {
            response.extensions_mut().insert(ExactBody);
        }
        response
    }
}

/// The problem type of an error response, for logs and metrics.
#[derive(Debug, Clone, Copy)]
pub struct ProblemSlug(pub &'static str);

/// Marks a response whose body goes out exactly as it is: a stored answer
/// replayed, or a refusal that must repeat byte for byte. Nothing (the
/// request id of this request, say) is added to it.
#[derive(Debug, Clone, Copy)]
pub struct ExactBody;

impl From<KeyError> for ApiError {
    fn from(e: KeyError) -> Self {
        Self::IdempotencyKey(e)
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        if matches!(e, sqlx::Error::PoolTimedOut) {
            crate::telemetry::pool_acquire_timeout();
        }
        if db::classify(&e).is_retryable() {
            tracing::warn!(error = %e, "database unavailable");
            Self::ServiceUnavailable
        } else {
            tracing::error!(error = %e, "database error");
            Self::Internal
        }
    }
}

impl From<TransferError> for ApiError {
    fn from(e: TransferError) -> Self {
        match e {
            TransferError::Invalid(invalid) => Self::Validation {
                kind: invalid.kind,
                param: invalid.param,
                detail: invalid.detail,
            },
            TransferError::SourceNotFound | TransferError::NotFound => Self::NotFound,
            TransferError::Refused(rejection) => Self::Rejected(rejection),
            TransferError::KeyReused => Self::IdempotencyKeyReused,
            TransferError::InFlight => Self::RequestInFlight {
                retry_after_secs: IN_FLIGHT_RETRY_AFTER_SECS,
            },
            TransferError::Cancelled { request_id } => Self::IntentCancelled { request_id },
            TransferError::Retryable(reason) => Self::NotPostedNow(reason),
            TransferError::Internal => Self::Internal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_bodies_carry_type_title_status_and_detail() {
        let body = ApiError::InsufficientFunds.body();
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        assert_eq!(value["type"], "/problems/insufficient-funds");
        assert_eq!(value["param"], "amount_minor");
        assert_eq!(value["status"], 422);
        assert_eq!(value["title"], "Insufficient funds");
        assert!(value["detail"].as_str().is_some_and(|d| !d.is_empty()));
    }
}
