//! `GET /idempotency-keys/{key}`: what became of one of the caller's keys;
//! `POST /idempotency-keys/{key}/cancel`: cancel the intent of one.

use axum::Json;
use axum::extract::State;
use serde::Serialize;
use uuid::Uuid;

use super::AppState;
use super::error::ApiError;
use super::extract::{PathParam, Principal, RequestIdHeader};
use crate::idempotency::IdempotencyKey;
use crate::transfers::intent::ROUTE;
use crate::transfers::keys::{Cancellation, KeyState};
use crate::transfers::render::timestamp;

/// Every field is always present (null where it does not apply), so a
/// client reads one shape whatever the state.
#[derive(Serialize)]
pub struct KeyView {
    pub idempotency_key: String,
    /// `in_flight`, `completed`, `failed`, `expired` or `cancelled`.
    pub state: &'static str,
    /// For `completed`: `stored` while the exact response is kept (until
    /// `expires_at`), `rebuilt` once only its outcome is.
    pub answer: Option<&'static str>,
    pub retry_after_seconds: Option<u64>,
    pub response_status: Option<u16>,
    pub transfer_id: Option<Uuid>,
    pub transfer_url: Option<String>,
    pub completed_at: Option<String>,
    pub cancelled_at: Option<String>,
    pub expires_at: Option<String>,
    /// Until when the key is remembered: no request with it executes again.
    pub retained_until: Option<String>,
}

impl KeyView {
    fn new(key: &IdempotencyKey, state: KeyState) -> Self {
        let mut view = Self {
            idempotency_key: key.as_str().to_owned(),
            state: "",
            answer: None,
            retry_after_seconds: None,
            response_status: None,
            transfer_id: None,
            transfer_url: None,
            completed_at: None,
            cancelled_at: None,
            expires_at: None,
            retained_until: None,
        };
        let transfer = match state {
            KeyState::InFlight { retry_after_secs } => {
                view.state = "in_flight";
                view.retry_after_seconds = Some(retry_after_secs);
                None
            }
            KeyState::Completed {
                response_status,
                transfer_id,
                completed_at,
                expires_at,
                retained_until,
                compacted,
            } => {
                view.state = "completed";
                view.answer = Some(if compacted { "rebuilt" } else { "stored" });
                view.response_status = Some(response_status);
                view.completed_at = Some(timestamp(completed_at));
                view.expires_at = Some(timestamp(expires_at));
                view.retained_until = Some(timestamp(retained_until));
                transfer_id
            }
            KeyState::Failed => {
                view.state = "failed";
                None
            }
            KeyState::Expired { transfer_id } => {
                view.state = "expired";
                transfer_id
            }
            KeyState::Cancelled {
                cancelled_at,
                retained_until,
            } => {
                view.state = "cancelled";
                view.cancelled_at = Some(timestamp(cancelled_at));
                view.retained_until = Some(timestamp(retained_until));
                None
            }
        };
        view.transfer_id = transfer;
        view.transfer_url = transfer.map(|id| format!("{ROUTE}/{id}"));
        view
    }
}

/// The key in the path takes the header's forms: bare (`abc-123`) or the
/// quoted string (`"abc-123"`, percent-encoded in a URL). A key that is not
/// the caller's, or was never used, is the same 404.
#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn get(
    State(state): State<AppState>,
    principal: Principal,
    PathParam(raw): PathParam,
) -> Result<Json<KeyView>, ApiError> {
    let key = IdempotencyKey::parse(raw.as_bytes())?;
    let found = state.transfers.key_state(principal.id, &key).await?;
    let key_state = found.ok_or(ApiError::NotFound)?;
    Ok(Json(KeyView::new(&key, key_state)))
}

/// Cancels the intent of one of the caller's keys (both spellings, as for
/// the lookup). Answered 200 with the key's `cancelled` state, again on
/// every repetition; 409 `request-in-flight` while a request holds the key;
/// 409 `intent-completed` when it completed (with its transfer's link).
/// Keys are per principal: cancelling a key never touches another
/// principal's key of the same name.
#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn cancel(
    State(state): State<AppState>,
    principal: Principal,
    RequestIdHeader(request_id): RequestIdHeader,
    PathParam(raw): PathParam,
) -> Result<Json<KeyView>, ApiError> {
    let key = IdempotencyKey::parse(raw.as_bytes())?;
    match state
        .transfers
        .cancel(principal.id, &key, request_id.as_deref())
        .await?
    {
        Cancellation::Cancelled {
            cancelled_at,
            retained_until,
        } => Ok(Json(KeyView::new(
            &key,
            KeyState::Cancelled {
                cancelled_at,
                retained_until,
            },
        ))),
        Cancellation::InFlight { retry_after_secs } => {
            Err(ApiError::RequestInFlight { retry_after_secs })
        }
        Cancellation::Completed { transfer_id } => Err(ApiError::IntentCompleted { transfer_id }),
    }
}
