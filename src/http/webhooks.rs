//! `/webhook-endpoints`: the caller's webhook endpoints, their attempts,
//! secret rotation, re-enabling and redelivery. Delivery itself is the
//! worker's (`webhooks::worker`); guarantees: docs/events.md.

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use uuid::Uuid;

use super::AppState;
use super::error::ApiError;
use super::extract::{PathParam, Principal, StrictJson};
use crate::ledger::events::Cursor;
use crate::webhooks::store::{self, AttemptView, EndpointView, attempt_view, endpoint_view};
use crate::webhooks::{self, WebhookError};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateEndpoint {
    pub url: String,
    #[serde(default)]
    pub event_types: Vec<String>,
}

/// Each field is `None` only when absent: an explicit `null` is a value,
/// and refused like any other that is not a string.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Redeliver {
    #[serde(default, deserialize_with = "present")]
    pub event_id: Option<serde_json::Value>,
    #[serde(default, deserialize_with = "present")]
    pub after: Option<serde_json::Value>,
}

fn present<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(deserializer).map(Some)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttemptsQuery {
    pub limit: Option<String>,
}

impl From<WebhookError> for ApiError {
    fn from(e: WebhookError) -> Self {
        match e {
            WebhookError::InvalidUrl(detail) => Self::InvalidWebhookEndpoint {
                param: "url",
                detail,
            },
            WebhookError::InvalidEventTypes(detail) => Self::InvalidWebhookEndpoint {
                param: "event_types",
                detail,
            },
            WebhookError::TooManyEndpoints => Self::TooManyWebhookEndpoints,
            WebhookError::DuplicateUrl { existing } => Self::WebhookEndpointExists { existing },
            WebhookError::InvalidRedelivery(detail) => Self::InvalidRedelivery { detail },
            WebhookError::NotFound => Self::NotFound,
            WebhookError::Database(e) => Self::from(e),
        }
    }
}

/// An id in the path; anything else names no endpoint.
fn endpoint_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| ApiError::NotFound)
}

#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn create(
    State(state): State<AppState>,
    principal: Principal,
    StrictJson(body): StrictJson<CreateEndpoint>,
) -> Result<Response, ApiError> {
    let url = webhooks::parse_url(&body.url)?;
    let types = webhooks::parse_event_types(&body.event_types)?;
    let (endpoint, secret) = store::create(&state.pool, principal.id, &url, &types).await?;
    let view = EndpointView {
        secret: Some(secret),
        ..endpoint_view(endpoint)
    };
    Ok((StatusCode::CREATED, Json(view)).into_response())
}

#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn list(
    State(state): State<AppState>,
    principal: Principal,
) -> Result<Response, ApiError> {
    let endpoints = store::list(&state.pool, principal.id).await?;
    let views: Vec<EndpointView> = endpoints.into_iter().map(endpoint_view).collect();
    Ok(Json(serde_json::json!({ "webhook_endpoints": views })).into_response())
}

#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn get(
    State(state): State<AppState>,
    principal: Principal,
    PathParam(id): PathParam,
) -> Result<Response, ApiError> {
    let (endpoint, last) = store::get(&state.pool, principal.id, endpoint_id(&id)?).await?;
    let view = EndpointView {
        last_attempt: Some(last.map(attempt_view)),
        ..endpoint_view(endpoint)
    };
    Ok(Json(view).into_response())
}

#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn delete(
    State(state): State<AppState>,
    principal: Principal,
    PathParam(id): PathParam,
) -> Result<Response, ApiError> {
    store::delete(&state.pool, principal.id, endpoint_id(&id)?).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn rotate_secret(
    State(state): State<AppState>,
    principal: Principal,
    PathParam(id): PathParam,
) -> Result<Response, ApiError> {
    let (endpoint, secret) =
        store::rotate_secret(&state.pool, principal.id, endpoint_id(&id)?).await?;
    let view = EndpointView {
        secret: Some(secret),
        ..endpoint_view(endpoint)
    };
    Ok(Json(view).into_response())
}

#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn enable(
    State(state): State<AppState>,
    principal: Principal,
    PathParam(id): PathParam,
) -> Result<Response, ApiError> {
    let endpoint = store::enable(&state.pool, principal.id, endpoint_id(&id)?).await?;
    Ok(Json(endpoint_view(endpoint)).into_response())
}

#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn redeliver(
    State(state): State<AppState>,
    principal: Principal,
    PathParam(id): PathParam,
    StrictJson(body): StrictJson<Redeliver>,
) -> Result<Response, ApiError> {
    let id = endpoint_id(&id)?;
    match (body.event_id, body.after) {
        (Some(event_id), None) => {
            let event_id = event_id
                .as_str()
                .and_then(|id| Uuid::parse_str(id).ok())
                .ok_or_else(|| ApiError::InvalidRedelivery {
                    detail: "event_id must be an event's id (a UUID)".to_owned(),
                })?;
            store::redeliver_event(&state.pool, principal.id, id, event_id).await?;
        }
        (None, Some(after)) => {
            let after = after
                .as_str()
                .and_then(Cursor::decode)
                .ok_or(ApiError::InvalidEventCursor)?;
            store::redeliver_after(&state.pool, principal.id, id, after).await?;
        }
        _ => {
            return Err(ApiError::InvalidRedelivery {
                detail: "send exactly one of event_id (one event) and after (a feed cursor: every event after it)"
                    .to_owned(),
            });
        }
    }
    Ok(StatusCode::ACCEPTED.into_response())
}

#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn attempts(
    State(state): State<AppState>,
    principal: Principal,
    PathParam(id): PathParam,
    query: Result<Query<AttemptsQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|_| ApiError::unexpected_query("limit"))?;
    let limit = match query.limit.as_deref() {
        None => webhooks::ATTEMPTS_PAGE_DEFAULT,
        Some(raw) => raw
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=webhooks::ATTEMPTS_PAGE_MAX).contains(n))
            .ok_or_else(|| {
                ApiError::invalid_query(
                    "limit",
                    format!(
                        "limit must be an integer from 1 to {}",
                        webhooks::ATTEMPTS_PAGE_MAX
                    ),
                )
            })?,
    };
    let found = store::attempts(&state.pool, principal.id, endpoint_id(&id)?, limit).await?;
    let views: Vec<AttemptView> = found.into_iter().map(attempt_view).collect();
    Ok(Json(serde_json::json!({ "attempts": views })).into_response())
}
