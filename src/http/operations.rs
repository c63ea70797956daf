//! Operator endpoints: `GET /metrics` for Prometheus, `GET
//! /admin/reconciliation` for the last scheduled reconciliation, and the
//! middleware that meters every request.
//!
//! The reconciliation report is admin-only, not principal-scoped: it covers
//! the whole ledger (funding accounts, every principal's keys), and a
//! discrepancy in one principal's rows is the operator's problem, not
//! something a customer can act on. Principals already see their own
//! balances and entries through `/accounts`.

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::extract::{FromRequestParts, MatchedPath, Request, State};
use axum::http::{HeaderValue, header, request::Parts};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::error::ApiError;
use super::extract::bearer;
use crate::auth;
use crate::reconcile::{LastRun, LastRunCell};
use crate::telemetry;

/// Shortest admin token accepted: long enough that guessing it online is
/// hopeless (generated principal tokens are 68 characters).
pub const ADMIN_TOKEN_LEN_MIN: usize = 32;

/// The operator side of the state: who is an admin, and where the scheduled
/// reconciliation leaves its result.
#[derive(Debug, Default)]
pub struct Operations {
    /// SHA-256 of `NEXO_ADMIN_TOKEN`; the token itself is not kept. `None`
    /// turns the admin endpoints off (they answer 404).
    admin_token_sha256: Option<[u8; 32]>,
    pub reconciliation: Arc<LastRunCell>,
}

impl Operations {
    /// Checks the admin token's shape once, at start-up, and keeps its hash.
    pub fn new(
        admin_token: Option<&str>,
        reconciliation: Arc<LastRunCell>,
    ) -> Result<Self, String> {
        let admin_token_sha256 = match admin_token {
            None => None,
            Some(token) => {
                let valid = auth::bearer_token(&format!("Bearer {token}")) == Some(token);
                if !valid || token.len() < ADMIN_TOKEN_LEN_MIN {
                    return Err(format!(
                        "NEXO_ADMIN_TOKEN must be {ADMIN_TOKEN_LEN_MIN} to {} visible ASCII characters",
                        auth::TOKEN_LEN_MAX
                    ));
                }
                Some(auth::token_sha256(token))
            }
        };
        Ok(Self {
            admin_token_sha256,
            reconciliation,
        })
    }
}

/// Proof that the request carried the admin token.
pub struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        // Credentials first, as on every authenticated route: a request
        // without a bearer token is a 401 whether or not admin access is on.
        let token = bearer(parts)?;
        let Some(expected) = state.operations.admin_token_sha256 else {
            return Err(ApiError::NotFound);
        };
        // Digests are compared, not tokens: the caller cannot steer a
        // digest byte by byte, so the comparison's timing tells nothing.
        if auth::token_sha256(token) == expected {
            Ok(Admin)
        } else {
            Err(ApiError::Unauthorized)
        }
    }
}

/// The last scheduled reconciliation, as `reconcile --json` prints a report.
pub async fn reconciliation(State(state): State<AppState>, _: Admin) -> Json<LastRun> {
    Json(state.operations.reconciliation.get())
}

/// The Prometheus text exposition of every metric in this process.
pub async fn metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let recorder = telemetry::recorder().ok_or(ApiError::ServiceUnavailable)?;
    telemetry::sample_pool(&state.pool);
    telemetry::sample_claims_queued(state.transfers.claims.queued());
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        recorder.render(),
    )
        .into_response())
}

/// Counts every request and times it, by route template (never the raw
/// path, which holds ids) and status.
pub async fn track(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(request).await;
    telemetry::http_request(
        &method,
        &route,
        response.status().as_u16(),
        started.elapsed(),
    );
    response
}
