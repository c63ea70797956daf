//! `GET /events`: the events of the caller's accounts after a cursor, oldest
//! first, with a long poll (`wait`). Guarantees and cursor semantics:
//! docs/events.md.

use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::AppState;
use super::error::ApiError;
use super::extract::Principal;
use crate::feed::{self, EventView, FeedError};
use crate::ledger::events::Cursor;

/// The route, which the request timeout stretches by the longest wait.
pub const ROUTE: &str = "/events";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    pub after: Option<String>,
    pub limit: Option<String>,
    pub wait: Option<String>,
}

#[derive(Serialize)]
pub struct EventsPage<'a> {
    pub events: Vec<EventView<'a>>,
    /// Send as `after` to get what follows; the `after` that was sent when
    /// nothing new was found.
    pub next_after: String,
}

#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn list(
    State(state): State<AppState>,
    principal: Principal,
    query: Result<Query<EventsQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|_| ApiError::unexpected_query("after, limit and wait"))?;
    let after = match query.after.as_deref() {
        None => Cursor::START,
        Some(raw) => Cursor::decode(raw).ok_or(ApiError::InvalidEventCursor)?,
    };
    let limit = bounded(
        "limit",
        query.limit.as_deref(),
        feed::PAGE_SIZE_DEFAULT,
        1..=feed::PAGE_SIZE_MAX,
    )?;
    let wait_secs = i64::try_from(feed::WAIT_MAX.as_secs()).unwrap_or(i64::MAX);
    let wait = bounded("wait", query.wait.as_deref(), 0, 0..=wait_secs)?;
    let page = state
        .feed
        .read(
            principal.id,
            after,
            limit,
            Duration::from_secs(wait.unsigned_abs()),
        )
        .await
        .map_err(|e| match e {
            FeedError::TooManyWaiters => ApiError::ServiceUnavailable,
            FeedError::Database(e) => ApiError::from(e),
        })?;
    let body = EventsPage {
        events: page
            .events
            .iter()
            .map(|e| feed::view(e, principal.id))
            .collect(),
        next_after: page.next_after.encode(),
    };
    // Serialized here, while the page's rows are borrowed.
    let bytes = serde_json::to_vec(&body).map_err(|e| {
        tracing::error!(error = %e, "a page of events could not be serialized");
        ApiError::Internal
    })?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        bytes,
    )
        .into_response())
}

/// An integer query parameter within `range`, `default` when absent.
fn bounded(
    param: &'static str,
    raw: Option<&str>,
    default: i64,
    range: std::ops::RangeInclusive<i64>,
) -> Result<i64, ApiError> {
    let Some(raw) = raw else {
        return Ok(default);
    };
    raw.parse::<i64>()
        .ok()
        .filter(|n| range.contains(n))
        .ok_or_else(|| {
            ApiError::invalid_query(
                param,
                format!(
                    "{param} must be an integer from {} to {}",
                    range.start(),
                    range.end()
                ),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_and_waits_are_integers_within_their_bounds() {
        let limit = |raw| bounded("limit", raw, 100, 1..=1_000).ok();
        assert_eq!(limit(None), Some(100));
        assert_eq!(limit(Some("1")), Some(1));
        assert_eq!(limit(Some("1000")), Some(1_000));
        for bad in ["0", "1001", "-5", "ten", "1.0", "", " 5"] {
            assert_eq!(limit(Some(bad)), None, "{bad}");
        }
    }
}
