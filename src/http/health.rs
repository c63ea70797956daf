//! Liveness and readiness probes.

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};

use super::AppState;
use super::error::ApiError;

/// How long readiness waits for the database before calling it away.
pub const READINESS_DB_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// The process is up and serving.
pub async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// A writable primary answers: this instance can take traffic. A server
/// in recovery (a standby, or a primary demoted by a failover this
/// instance has not followed yet) is no primary.
pub async fn readyz(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let ping = sqlx::query_scalar::<_, bool>("SELECT pg_is_in_recovery()").fetch_one(&state.pool);
    match tokio::time::timeout(READINESS_DB_TIMEOUT, ping).await {
        Ok(Ok(false)) => Ok(Json(json!({"status": "ready"}))),
        Ok(Ok(true)) => {
            tracing::warn!("readiness check: the database is in recovery, not a primary");
            Err(ApiError::ServiceUnavailable)
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "readiness check failed");
            Err(ApiError::ServiceUnavailable)
        }
        Err(_) => {
            tracing::warn!("readiness check timed out");
            Err(ApiError::ServiceUnavailable)
        }
    }
}
