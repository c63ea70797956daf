//! The HTTP API: routes, extractors, error mapping and the middleware stack.

pub mod accounts;
pub mod batch;
pub mod caches;
pub mod docs;
pub mod error;
pub mod extract;
pub mod health;
pub mod operations;
pub mod rate_limit;
pub mod transfers;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderName, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, SecondsFormat, Utc};
use sqlx::PgPool;
use tower::ServiceBuilder;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::sensitive_headers::SetSensitiveRequestHeadersLayer;
use tower_http::trace::TraceLayer;

use crate::config::{HttpConfig, RateLimitConfig};
use crate::idempotency::Policy;
use error::ApiError;

/// Everything a handler needs, cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    /// Where idempotency claims run: commits without waiting for the WAL
    /// flush (see `db::claim_pool` for why that is safe).
    pub claim_pool: PgPool,
    pub config: Arc<AppConfig>,
    /// The `currencies` table, read at start-up: it only changes by migration.
    pub currencies: Arc<HashSet<String>>,
    /// The admin token's hash and the last scheduled reconciliation.
    pub operations: Arc<operations::Operations>,
    /// `None` when rate limiting is off.
    pub rate_limiter: Option<Arc<rate_limit::PrincipalRateLimiter>>,
    /// Token and account lookups kept in memory (see `caches`).
    pub caches: Arc<caches::Caches>,
    /// Transfers waiting for their batch (see `batch`).
    pub postings: Arc<batch::PostingQueues<transfers::TransferOperation>>,
}

#[derive(Debug, Clone)]
pub struct AppConfig {
    pub idempotency: Policy,
    pub http: HttpConfig,
}

impl AppState {
    pub async fn new(pool: PgPool, config: AppConfig) -> Result<Self, sqlx::Error> {
        // Before anything can count: events recorded earlier would be lost.
        crate::telemetry::recorder();
        let currencies = crate::ledger::repo::supported_currencies(&pool).await?;
        Ok(Self {
            claim_pool: crate::db::claim_pool(&pool),
            pool,
            caches: Arc::new(caches::Caches::new(config.idempotency.ttl)),
            config: Arc::new(config),
            currencies: Arc::new(currencies.into_iter().collect()),
            operations: Arc::default(),
            rate_limiter: rate_limit::PrincipalRateLimiter::new(RateLimitConfig::default())
                .map(Arc::new),
            postings: Arc::default(),
        })
    }

    /// The admin token and the scheduled reconciliation's result cell.
    pub fn with_operations(mut self, operations: operations::Operations) -> Self {
        self.operations = Arc::new(operations);
        self
    }

    /// Replaces the default per-principal rate limits.
    pub fn with_rate_limit(mut self, config: RateLimitConfig) -> Self {
        self.rate_limiter = rate_limit::PrincipalRateLimiter::new(config).map(Arc::new);
        self
    }
}

const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The router with its middleware. Tests mount exactly this.
pub fn app(state: AppState) -> Router {
    let http = state.config.http.clone();
    Router::new()
        .route("/transfers", post(transfers::create))
        .route("/transfers/{transfer_id}", get(transfers::get))
        .route("/accounts/{account_id}", get(accounts::get))
        .route("/accounts/{account_id}/entries", get(accounts::entries))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/openapi.yaml", get(docs::openapi))
        .route("/docs", get(docs::page))
        .route("/docs/{asset}", get(docs::asset))
        .route("/metrics", get(operations::metrics))
        .route("/admin/reconciliation", get(operations::reconciliation))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(
            http.body_limit_bytes as usize,
        ))
        .layer(middleware::from_fn_with_state(
            http.request_timeout,
            request_timeout,
        ))
        .layer(
            ServiceBuilder::new()
                .layer(SetSensitiveRequestHeadersLayer::new([
                    header::AUTHORIZATION,
                ]))
                .layer(SetRequestIdLayer::new(X_REQUEST_ID, MakeRequestUuid))
                .layer(
                    TraceLayer::new_for_http()
                        .make_span_with(make_request_span)
                        .on_response(log_response),
                )
                .layer(PropagateRequestIdLayer::new(X_REQUEST_ID))
                .layer(middleware::from_fn(operations::track)),
        )
        .with_state(state)
}

fn make_request_span(request: &Request) -> tracing::Span {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str);
    let request_id = request
        .headers()
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-");
    tracing::info_span!(
        "request",
        method = %request.method(),
        route,
        request_id,
        principal_id = tracing::field::Empty,
        idempotency_outcome = tracing::field::Empty,
        transfer_id = tracing::field::Empty,
    )
}

fn log_response(response: &Response, latency: Duration, _span: &tracing::Span) {
    let problem = response
        .extensions()
        .get::<error::ProblemSlug>()
        .map(|p| p.0);
    let status = response.status().as_u16();
    let latency_ms = latency.as_secs_f64() * 1000.0;
    if response.status().is_server_error() {
        tracing::warn!(status, problem, latency_ms, "response");
    } else {
        tracing::info!(status, problem, latency_ms, "response");
    }
}

/// Bounds how long a client waits. The transfer task of a timed-out
/// request keeps running and completes its key, so the retry replays it.
async fn request_timeout(State(limit): State<Duration>, request: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::ServiceUnavailable.into_response(),
    }
}

async fn not_found() -> ApiError {
    ApiError::NotFound
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

/// Timestamps in responses: RFC 3339, UTC, microseconds (PostgreSQL's
/// precision), so a row always renders to the same text.
pub fn timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets in-flight
/// requests finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app(state))
        .with_graceful_shutdown(shutdown)
        .await
}
