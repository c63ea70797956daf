//! Extractors that turn every rejection into our problem+json errors.

use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::{header, request::Parts};
use bytes::Bytes;
use serde::de::DeserializeOwned;

use super::AppState;
use super::error::ApiError;
use crate::auth;
use crate::idempotency::IdempotencyKey;
use crate::principal::PrincipalId;

/// The authenticated caller, from `Authorization: Bearer <token>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Principal {
    pub id: PrincipalId,
}

impl FromRequestParts<AppState> for Principal {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = bearer(parts)?;
        // From memory when this token was seen lately: spares a query per request.
        let id = match state.caches.principal(token) {
            Some(id) => id,
            None => {
                let id = auth::principal_for_token(&state.pool, token)
                    .await?
                    .ok_or(ApiError::Unauthorized)?;
                state.caches.remember_principal(token, id);
                id
            }
        };
        tracing::Span::current().record("principal_id", tracing::field::display(id));
        if let Some(limiter) = &state.rate_limiter {
            limiter.check(id.as_uuid())?;
        }
        parts.extensions.insert(Principal { id });
        Ok(Principal { id })
    }
}

/// The token of the one `Authorization: Bearer` header; none, several or a
/// malformed one is a 401.
pub fn bearer(parts: &Parts) -> Result<&str, ApiError> {
    let mut values = parts.headers.get_all(header::AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(ApiError::Unauthorized);
    };
    value
        .to_str()
        .ok()
        .and_then(auth::bearer_token)
        .ok_or(ApiError::Unauthorized)
}

impl FromRequestParts<AppState> for IdempotencyKey {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &AppState) -> Result<Self, ApiError> {
        Ok(IdempotencyKey::from_headers(&parts.headers)?)
    }
}

/// The single path parameter of a route, as text. A segment that is not
/// valid UTF-8 once percent-decoded names no resource: it is our 404
/// problem, not axum's plain-text 400.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathParam(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathParam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(value)| PathParam(value))
            .map_err(|_| ApiError::NotFound)
    }
}

/// A JSON body parsed strictly into `T`: `application/json` only (415
/// otherwise), within the body limit (413), and any syntax error, unknown
/// field, duplicated field or wrong type is a 400 naming the problem.
pub struct StrictJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for StrictJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        if !is_json_content_type(req.headers()) {
            return Err(ApiError::UnsupportedMediaType);
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge
            } else {
                ApiError::MalformedRequest("the request body could not be read".to_owned())
            }
        })?;
        serde_json::from_slice(&bytes)
            .map(StrictJson)
            .map_err(|e| ApiError::MalformedRequest(json_error_detail(&e)))
    }
}

fn json_error_detail(e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    match e.classify() {
        Category::Eof => "the JSON body ends too early".to_owned(),
        Category::Syntax => format!("the body is not valid JSON: {e}"),
        Category::Data => format!("the body does not match the expected fields: {e}"),
        Category::Io => "the request body could not be read".to_owned(),
    }
}

/// `application/json`, with or without parameters such as `charset=utf-8`.
fn is_json_content_type(headers: &axum::http::HeaderMap) -> bool {
    let mut values = headers.get_all(header::CONTENT_TYPE).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return false;
    };
    let Ok(value) = value.to_str() else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("application/json")
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderMap, HeaderValue};

    fn with_content_type(values: &[&'static str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(header::CONTENT_TYPE, HeaderValue::from_static(v));
        }
        headers
    }

    #[test]
    fn json_content_types_are_recognised_with_parameters() {
        assert!(is_json_content_type(&with_content_type(&[
            "application/json"
        ])));
        assert!(is_json_content_type(&with_content_type(&[
            "Application/JSON; charset=utf-8"
        ])));
    }

    #[test]
    fn other_or_repeated_content_types_are_refused() {
        assert!(!is_json_content_type(&with_content_type(&[])));
        assert!(!is_json_content_type(&with_content_type(&["text/plain"])));
        assert!(!is_json_content_type(&with_content_type(&[
            "application/x-www-form-urlencoded"
        ])));
        assert!(!is_json_content_type(&with_content_type(&[
            "application/json",
            "text/plain"
        ])));
    }
}
