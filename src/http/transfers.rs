//! `POST /transfers` and `GET /transfers/{transfer_id}`: extract, call the
//! transfers service, map its answer to a response.

use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use uuid::Uuid;

use super::AppState;
use super::error::ApiError;
use super::extract::{PathParam, Principal, StrictJson};
use crate::idempotency::{IdempotencyKey, StoredResponse};
use crate::ledger;
use crate::transfers::TransferAnswer;
use crate::transfers::intent::TransferBody;
use crate::transfers::render::render_transfer;

pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Records its fields on the request's span (`principal_id` from the
/// extractor, `idempotency_outcome` and `transfer_id` from the service), so
/// the one line logged per request carries them all.
pub async fn create(
    State(state): State<AppState>,
    principal: Principal,
    key: IdempotencyKey,
    StrictJson(body): StrictJson<TransferBody>,
) -> Result<Response, ApiError> {
    let answer = state.transfers.create(principal.id, key, &body).await?;
    #[cfg(feature = "failpoints")]
    fail::fail_point!("transfer::before_response");
    Ok(answer_response(answer))
}

/// A stored answer as sent: its status, its stored headers and its exact
/// bytes, plus `Idempotent-Replayed: true` on a replay.
pub fn answer_response(answer: TransferAnswer) -> Response {
    let TransferAnswer { response, replayed } = answer;
    let StoredResponse {
        status,
        headers,
        body,
    } = response;
    let mut response = (status, body).into_response();
    let sent = response.headers_mut();
    for (name, value) in headers {
        sent.insert(name, value);
    }
    if replayed {
        sent.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn get(
    State(state): State<AppState>,
    principal: Principal,
    PathParam(transfer_id): PathParam,
) -> Result<Response, ApiError> {
    let pool = &state.transfers.pool;
    let id = Uuid::parse_str(&transfer_id).map_err(|_| ApiError::NotFound)?;
    let transfer = ledger::repo::get_transfer(pool, id)
        .await?
        .ok_or(ApiError::NotFound)?;
    let accounts = ledger::repo::get_accounts(
        pool,
        &[transfer.from_account.as_str(), transfer.to_account.as_str()],
    )
    .await?;
    if !accounts
        .iter()
        .any(|a| a.principal_id == Some(principal.id))
    {
        return Err(ApiError::NotFound);
    }
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        render_transfer(&transfer),
    )
        .into_response())
}
