//! The HTTP API: routes, extractors, error mapping and the middleware stack.

pub mod accounts;
pub mod docs;
pub mod error;
pub mod events;
pub mod extract;
pub mod health;
pub mod keys;
pub mod operations;
pub mod paging;
pub mod problems;
pub mod rate_limit;
pub mod transfers;
pub mod webhooks;

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderName, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use sqlx::PgPool;
use tokio::sync::watch;
use tower::ServiceBuilder;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::sensitive_headers::SetSensitiveRequestHeadersLayer;
use tower_http::trace::TraceLayer;

use crate::caches::Caches;
use crate::config::{HttpConfig, PostingConfig, RateLimitConfig};
use crate::feed::Feed;
use crate::idempotency::Policy;
use crate::transfers::Transfers;
use crate::transfers::posting::Settings;
use error::{ApiError, PROBLEM_CONTENT_TYPE};

/// Everything a handler needs, cheap to clone.
#[derive(Clone)]
pub struct AppState {
    /// The main pool, for reads (the transfers service shares it).
    pub pool: PgPool,
    pub config: Arc<AppConfig>,
    /// The admin token's hash and the last scheduled reconciliation.
    pub operations: Arc<operations::Operations>,
    /// `None` when rate limiting is off.
    pub rate_limiter: Option<Arc<rate_limit::PrincipalRateLimiter>>,
    /// Token and account lookups kept in memory (shared with `transfers`).
    pub caches: Arc<Caches>,
    /// Creating transfers: checks, keys, the posting queues.
    pub transfers: Arc<Transfers>,
    /// The pull feed of events.
    pub feed: Arc<Feed>,
    /// Set once the server is shutting down, so long polls end at once
    /// instead of holding the graceful shutdown for their whole wait.
    pub closing: Arc<watch::Sender<bool>>,
}

#[derive(Debug, Clone)]
pub struct AppConfig {
    pub idempotency: Policy,
    pub http: HttpConfig,
    pub posting: PostingConfig,
}

impl AppState {
    pub async fn new(pool: PgPool, config: AppConfig) -> Result<Self, sqlx::Error> {
        // Before anything can count: events recorded earlier would be lost.
        crate::telemetry::recorder();
        let settings = Settings::for_pool(pool.options().get_max_connections(), &config.posting);
        let transfers = Transfers::new(
            pool.clone(),
            config.idempotency,
            settings,
            config.posting.require_sync_standby,
        )
        .await?;
        let (closing, closing_seen) = watch::channel(false);
        Ok(Self {
            feed: Arc::new(Feed::new(pool.clone(), closing_seen)),
            closing: Arc::new(closing),
            pool,
            caches: Arc::clone(&transfers.caches),
            transfers,
            config: Arc::new(config),
            operations: Arc::default(),
            rate_limiter: rate_limit::PrincipalRateLimiter::new(RateLimitConfig::default())
                .map(Arc::new),
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
        .route("/transfers", post(transfers::create).get(transfers::list))
        .route("/transfers/{transfer_id}", get(transfers::get))
        .route(
            "/transfers/{transfer_id}/post",
            post(transfers::post_pending),
        )
        .route(
            "/transfers/{transfer_id}/void",
            post(transfers::void_pending),
        )
        .route("/transfers/{transfer_id}/reverse", post(transfers::reverse))
        .route("/transfer-batches", post(transfers::create_batch))
        .route("/transfer-batches/{batch_id}", get(transfers::get_batch))
        .route("/idempotency-keys/{key}", get(keys::get))
        .route("/idempotency-keys/{key}/cancel", post(keys::cancel))
        .route("/accounts/{account_id}", get(accounts::get))
        .route("/accounts/{account_id}/entries", get(accounts::entries))
        .route("/events", get(events::list))
        .route(
            "/webhook-endpoints",
            post(webhooks::create).get(webhooks::list),
        )
        .route(
            "/webhook-endpoints/{endpoint_id}",
            get(webhooks::get).delete(webhooks::delete),
        )
        .route(
            "/webhook-endpoints/{endpoint_id}/rotate-secret",
            post(webhooks::rotate_secret),
        )
        .route(
            "/webhook-endpoints/{endpoint_id}/enable",
            post(webhooks::enable),
        )
        .route(
            "/webhook-endpoints/{endpoint_id}/redeliver",
            post(webhooks::redeliver),
        )
        .route(
            "/webhook-endpoints/{endpoint_id}/attempts",
            get(webhooks::attempts),
        )
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/openapi.yaml", get(docs::openapi))
        .route("/", get(docs::root))
        .route("/docs", get(docs::page))
        .route("/docs/{asset}", get(docs::asset))
        .route("/problems", get(problems::index))
        .route("/problems/{slug}", get(problems::page))
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
                .layer(middleware::from_fn(drop_unacceptable_request_id))
                .layer(SetRequestIdLayer::new(X_REQUEST_ID, MakeRequestUuid))
                .layer(
                    TraceLayer::new_for_http()
                        .make_span_with(make_request_span)
                        .on_response(log_response)
                        // A 5xx is logged once, with its cause, where it
                        // happens; not again here at ERROR.
                        .on_failure(()),
                )
                .layer(PropagateRequestIdLayer::new(X_REQUEST_ID))
                .layer(middleware::from_fn(problem_request_id))
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
    // One access line per request, at INFO whatever the status: a failure's
    // cause is logged once, at WARN or ERROR, where it is known (a database
    // error, a posting bound, a timeout), not a second time here.
    tracing::info!(status, problem, latency_ms, "response");
}

/// A client's `x-request-id` that is too long or not visible ASCII is
/// dropped, so `SetRequestIdLayer` generates one: the id goes into logs,
/// problem documents and key records.
async fn drop_unacceptable_request_id(mut request: Request, next: Next) -> Response {
    let mut values = request.headers().get_all(&X_REQUEST_ID).iter();
    let keep = match (values.next(), values.next()) {
        (None, _) => true,
        (Some(value), None) => crate::problem::acceptable_request_id(value.as_bytes()),
        (Some(_), Some(_)) => false,
    };
    if !keep {
        request.headers_mut().remove(&X_REQUEST_ID);
    }
    next.run(request).await
}

/// The largest problem document `problem_request_id` rewrites; ours are
/// under 1 KiB.
pub const PROBLEM_BODY_BYTES_MAX: usize = 16 * 1024;

/// Every problem document carries the `x-request-id` of its request, so a
/// client can quote it and an operator find the request's log line: added
/// here, once for every error path (handlers, extractors, fallbacks, the
/// rate limiter, the request timeout), unless the document already has one.
async fn problem_request_id(request: Request, next: Next) -> Response {
    let request_id = request
        .headers()
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let response = next.run(request).await;
    let is_problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes() == PROBLEM_CONTENT_TYPE.as_bytes())
        && response.extensions().get::<error::ExactBody>().is_none();
    let Some(request_id) = request_id.filter(|_| is_problem) else {
        return response;
    };
    let (mut parts, body) = response.into_parts();
    match axum::body::to_bytes(body, PROBLEM_BODY_BYTES_MAX).await {
        Ok(bytes) => {
            parts.headers.remove(header::CONTENT_LENGTH);
            Response::from_parts(
                parts,
                axum::body::Body::from(crate::problem::with_request_id(bytes, &request_id)),
            )
        }
        Err(e) => {
            tracing::error!(error = %e, "a problem document could not be read");
            ApiError::Internal.into_response()
        }
    }
}

/// Bounds how long a client waits. The transfer task of a timed-out
/// request keeps running and completes its key, so the retry replays it.
/// A long poll of the event feed waits as long as it asked first (at most
/// `feed::WAIT_MAX`), and then has the same bound as any request.
async fn request_timeout(State(limit): State<Duration>, request: Request, next: Next) -> Response {
    let long_poll = request
        .extensions()
        .get::<MatchedPath>()
        .is_some_and(|route| route.as_str() == events::ROUTE);
    let limit = if long_poll {
        limit + crate::feed::WAIT_MAX
    } else {
        limit
    };
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            tracing::warn!(
                limit_ms = limit.as_millis(),
                "request timed out (NEXO_REQUEST_TIMEOUT)"
            );
            ApiError::ServiceUnavailable.into_response()
        }
    }
}

async fn not_found() -> ApiError {
    ApiError::NotFound
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

pub use crate::transfers::render::timestamp;

/// Serves `app` on `listener` until `shutdown` resolves. Then it stops
/// accepting, lets in-flight requests finish while the posting queues
/// drain, and returns within the shutdown timeout (plus
/// [`SHUTDOWN_MARGIN`]) whatever is still running: by then every claim
/// this instance made is completed or FAILED (see `Postings::shut_down`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let deadline = state.config.posting.shutdown_timeout;
    let transfers = Arc::clone(&state.transfers);
    let closing = Arc::clone(&state.closing);
    let (signalled, on_signal) = tokio::sync::oneshot::channel::<()>();
    let server = axum::serve(listener, app(state)).with_graceful_shutdown(async move {
        shutdown.await;
        closing.send_replace(true);
        let _ = signalled.send(());
    });
    let mut server = std::pin::pin!(server.into_future());
    let mut on_signal = on_signal;
    let ended_first = tokio::select! {
        served = &mut server => Some(served),
        _ = &mut on_signal => None,
    };
    let started = tokio::time::Instant::now();
    // With no connection open, the server ends in the same poll that
    // delivers the signal: the postings still need their shutdown then.
    let http_drained = match ended_first {
        Some(served) if on_signal.try_recv().is_err() => return served,
        Some(served) => Ok(served),
        // First the requests in flight finish (their postings with them);
        // then the postings of clients that hung up; then whatever is left
        // is failed and released, and the last answers get a moment to
        // leave.
        None => tokio::time::timeout(deadline, &mut server).await,
    };
    transfers
        .shut_down(deadline.saturating_sub(started.elapsed()))
        .await;
    match http_drained {
        Ok(served) => served,
        Err(_) => match tokio::time::timeout(SHUTDOWN_MARGIN, &mut server).await {
            Ok(served) => served,
            Err(_) => {
                tracing::warn!("connections still open at the shutdown deadline, closing them");
                Ok(())
            }
        },
    }
}

/// How long past the shutdown timeout the server waits for open
/// connections to take their last answers.
pub const SHUTDOWN_MARGIN: Duration = Duration::from_secs(1);
