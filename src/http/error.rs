//! One error type for the HTTP API, rendered as RFC 9457 problem details.
//! Each kind has a stable `type` URI; 5xx bodies never carry internal text
//! (the cause is logged instead).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use problem_details::ProblemDetails;

use crate::idempotency::{KeyError, StoredResponse};

/// Problem types are URIs under this base; `docs/problems.md` describes each.
pub const PROBLEM_TYPE_BASE: &str = "https://nexo-transfers.example/problems/";

pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// Client-supplied text echoed in a problem `detail` (a serde message naming
/// an unknown field, say) is cut to this many characters.
const DETAIL_CHARS_MAX: usize = 300;

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
    #[error("{0}")]
    MalformedRequest(String),
    #[error("{detail}")]
    Validation {
        kind: ValidationKind,
        detail: String,
    },
    #[error("{0}")]
    InvalidQuery(String),
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
    #[error("too many requests")]
    RateLimited { retry_after_secs: u64 },
    #[error("the service is temporarily unavailable")]
    ServiceUnavailable,
    #[error("internal error")]
    Internal,
}

/// Validation failures that leave the idempotency key untouched, so a
/// corrected request may reuse it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValidationKind {
    InvalidAmount,
    UnsupportedCurrency,
    CurrencyMismatch,
    SameAccount,
    InvalidAccountId,
    UnknownDestination,
    InvalidDescription,
}

impl ValidationKind {
    fn slug(self) -> &'static str {
        match self {
            Self::InvalidAmount => "invalid-amount",
            Self::UnsupportedCurrency => "unsupported-currency",
            Self::CurrencyMismatch => "currency-mismatch",
            Self::SameAccount => "same-account",
            Self::InvalidAccountId => "invalid-account-id",
            Self::UnknownDestination => "unknown-destination",
            Self::InvalidDescription => "invalid-description",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Self::InvalidAmount => "Invalid amount",
            Self::UnsupportedCurrency => "Unsupported currency",
            Self::CurrencyMismatch => "Currency does not match the accounts",
            Self::SameAccount => "Source and destination are the same account",
            Self::InvalidAccountId => "Invalid account id",
            Self::UnknownDestination => "Unknown destination account",
            Self::InvalidDescription => "Invalid description",
        }
    }
}

impl ApiError {
    pub fn validation(kind: ValidationKind, detail: impl Into<String>) -> Self {
        Self::Validation {
            kind,
            detail: detail.into(),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::IdempotencyKey(_) | Self::MalformedRequest(_) | Self::InvalidQuery(_) => {
                StatusCode::BAD_REQUEST
            }
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Validation { .. } | Self::IdempotencyKeyReused | Self::InsufficientFunds => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::RequestInFlight { .. } => StatusCode::CONFLICT,
            Self::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::ServiceUnavailable => StatusCode::SERVICE_UNAVAILABLE,
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
            Self::MalformedRequest(_) => "malformed-request",
            Self::Validation { kind, .. } => kind.slug(),
            Self::InvalidQuery(_) => "invalid-query",
            Self::NotFound => "not-found",
            Self::MethodNotAllowed => "method-not-allowed",
            Self::IdempotencyKeyReused => "idempotency-key-reused",
            Self::RequestInFlight { .. } => "request-in-flight",
            Self::InsufficientFunds => "insufficient-funds",
            Self::RateLimited { .. } => "rate-limited",
            Self::ServiceUnavailable => "service-unavailable",
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
            Self::MalformedRequest(_) => "Malformed request",
            Self::Validation { kind, .. } => kind.title(),
            Self::InvalidQuery(_) => "Invalid query parameter",
            Self::NotFound => "Not found",
            Self::MethodNotAllowed => "Method not allowed",
            Self::IdempotencyKeyReused => "Idempotency key reused",
            Self::RequestInFlight { .. } => "Request in flight",
            Self::InsufficientFunds => "Insufficient funds",
            Self::RateLimited { .. } => "Too many requests",
            Self::ServiceUnavailable => "Service unavailable",
            Self::Internal => "Internal server error",
        }
    }

    fn detail(&self) -> String {
        let detail = match self {
            Self::Unauthorized => {
                "send a valid token as `Authorization: Bearer <token>`".to_owned()
            }
            Self::IdempotencyKey(KeyError::Missing) => format!(
                "{self}; send one unique key per transfer intent, e.g. a UUID, and the same key on every retry"
            ),
            Self::RequestInFlight { .. } => {
                format!("{self}; retry later with the same key and body to get its result")
            }
            Self::IdempotencyKeyReused => format!(
                "{self}; use a new key for a new transfer, or resend the original body to get the original result"
            ),
            Self::ServiceUnavailable => {
                format!("{self}; retry with the same idempotency key, it is safe")
            }
            Self::Internal => format!(
                "{self}; nothing was committed for this attempt, retry with the same idempotency key"
            ),
            other => other.to_string(),
        };
        truncate_chars(&detail, DETAIL_CHARS_MAX)
    }

    fn retry_after_secs(&self) -> Option<u64> {
        match self {
            Self::RequestInFlight { retry_after_secs } | Self::RateLimited { retry_after_secs } => {
                Some(*retry_after_secs)
            }
            Self::ServiceUnavailable => Some(1),
            _ => None,
        }
    }

    /// The problem document's exact bytes. Also what is stored for a
    /// business rejection, so its replay is byte-identical.
    pub fn body(&self) -> Bytes {
        let problem = ProblemDetails::new()
            .with_type(problem_type_uri(self.slug()))
            .with_title(self.title())
            .with_status(self.status())
            .with_detail(self.detail());
        // Serialising a struct of strings and a status code cannot fail; an
        // empty body would still carry the status.
        Bytes::from(serde_json::to_vec(&problem).unwrap_or_default())
    }

    /// This error as a response to store under an idempotency key.
    pub fn to_stored(&self) -> StoredResponse {
        StoredResponse {
            status: self.status().as_u16(),
            headers: vec![(
                header::CONTENT_TYPE.as_str().to_owned(),
                PROBLEM_CONTENT_TYPE.to_owned(),
            )],
            body: self.body(),
        }
    }
}

fn problem_type_uri(slug: &str) -> axum::http::Uri {
    format!("{PROBLEM_TYPE_BASE}{slug}")
        .parse()
        .unwrap_or_else(|_| axum::http::Uri::from_static("about:blank"))
}

fn truncate_chars(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
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
        response
    }
}

/// The problem type of an error response, for logs and metrics.
#[derive(Debug, Clone, Copy)]
pub struct ProblemSlug(pub &'static str);

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
        if is_unavailable(&e) {
            tracing::warn!(error = %e, "database unavailable");
            Self::ServiceUnavailable
        } else {
            tracing::error!(error = %e, "database error");
            Self::Internal
        }
    }
}

/// Errors that mean "the database is away or shedding load", which a
/// client should retry: pool exhaustion, a dropped connection, a server
/// shutting down or not yet accepting connections, and serialization
/// failures that outlived the internal retries.
pub fn is_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            code.starts_with("08")
                || code.starts_with("53")
                || matches!(
                    code.as_ref(),
                    "57P01" | "57P02" | "57P03" | "40001" | "40P01"
                )
        }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_bodies_carry_type_title_status_and_detail() {
        let body = ApiError::InsufficientFunds.body();
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        assert_eq!(
            value["type"],
            "https://nexo-transfers.example/problems/insufficient-funds"
        );
        assert_eq!(value["status"], 422);
        assert_eq!(value["title"], "Insufficient funds");
        assert!(value["detail"].as_str().is_some_and(|d| !d.is_empty()));
    }

    #[test]
    fn long_details_are_cut() {
        let long = ApiError::MalformedRequest("x".repeat(1000));
        let value: serde_json::Value = serde_json::from_slice(&long.body()).unwrap_or_default();
        let detail = value["detail"].as_str().unwrap_or_default();
        assert_eq!(detail.chars().count(), DETAIL_CHARS_MAX + 1);
    }
}
