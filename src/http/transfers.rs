//! `POST /transfers`, `GET /transfers` and `GET /transfers/{transfer_id}`:
//! extract, call the transfers service (or read the ledger), map the answer
//! to a response.

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::error::ApiError;
use super::extract::{PathParam, Principal, RequestIdHeader, StrictJson, StrictJsonOrEmpty};
use super::{AppState, paging};
use crate::idempotency::{IdempotencyKey, StoredResponse};
use crate::ledger;
use crate::ledger::holds::{Hold, HoldStatus};
use crate::transfers::TransferAnswer;
use crate::transfers::intent::TransferBody;
use crate::transfers::lifecycle::{BatchBody, PostBody, ReverseBody, VoidBody};
use crate::transfers::render::{self, HoldTransferView, TransferView};

pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Records its fields on the request's span (`principal_id` from the
/// extractor, `idempotency_outcome` and `transfer_id` from the service), so
/// the one line logged per request carries them all.
pub async fn create(
    State(state): State<AppState>,
    principal: Principal,
    key: IdempotencyKey,
    RequestIdHeader(request_id): RequestIdHeader,
    StrictJson(body): StrictJson<TransferBody>,
) -> Result<Response, ApiError> {
    let answer = state
        .transfers
        .create(principal.id, key, &body, request_id)
        .await?;
    #[cfg(feature = "failpoints")]
    fail::fail_point!("transfer::before_response");
    Ok(answer_response(answer))
}

/// `POST /transfers/{transfer_id}/post`: posts a pending transfer.
pub async fn post_pending(
    State(state): State<AppState>,
    principal: Principal,
    key: IdempotencyKey,
    PathParam(transfer_id): PathParam,
    RequestIdHeader(request_id): RequestIdHeader,
    StrictJsonOrEmpty(body): StrictJsonOrEmpty<PostBody>,
) -> Result<Response, ApiError> {
    let answer = state
        .transfers
        .post_hold(principal.id, key, &transfer_id, &body, request_id)
        .await?;
    Ok(answer_response(answer))
}

/// `POST /transfers/{transfer_id}/void`: releases a pending transfer.
pub async fn void_pending(
    State(state): State<AppState>,
    principal: Principal,
    key: IdempotencyKey,
    PathParam(transfer_id): PathParam,
    RequestIdHeader(request_id): RequestIdHeader,
    StrictJsonOrEmpty(VoidBody {}): StrictJsonOrEmpty<VoidBody>,
) -> Result<Response, ApiError> {
    let answer = state
        .transfers
        .void_hold(principal.id, key, &transfer_id, request_id)
        .await?;
    Ok(answer_response(answer))
}

/// `POST /transfers/{transfer_id}/reverse`: gives a posted transfer back.
pub async fn reverse(
    State(state): State<AppState>,
    principal: Principal,
    key: IdempotencyKey,
    PathParam(transfer_id): PathParam,
    RequestIdHeader(request_id): RequestIdHeader,
    StrictJsonOrEmpty(body): StrictJsonOrEmpty<ReverseBody>,
) -> Result<Response, ApiError> {
    let answer = state
        .transfers
        .reverse_transfer(principal.id, key, &transfer_id, &body, request_id)
        .await?;
    Ok(answer_response(answer))
}

/// `POST /transfer-batches`: transfers that all post or none does.
pub async fn create_batch(
    State(state): State<AppState>,
    principal: Principal,
    key: IdempotencyKey,
    RequestIdHeader(request_id): RequestIdHeader,
    StrictJson(body): StrictJson<BatchBody>,
) -> Result<Response, ApiError> {
    let answer = state
        .transfers
        .create_batch(principal.id, key, &body, request_id)
        .await?;
    Ok(answer_response(answer))
}

/// `GET /transfer-batches/{batch_id}`: the batch its maker asked for, the
/// same bytes its 201 had (legs never change).
#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn get_batch(
    State(state): State<AppState>,
    principal: Principal,
    PathParam(batch_id): PathParam,
) -> Result<Response, ApiError> {
    let id = Uuid::parse_str(&batch_id).map_err(|_| ApiError::NotFound)?;
    let mut conn = state.transfers.pool.acquire().await?;
    let (batch, legs) = ledger::reversals::get_batch(&mut conn, id)
        .await?
        .filter(|(batch, _)| batch.principal_id == principal.id)
        .ok_or(ApiError::NotFound)?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        render::render_batch(&batch, &legs),
    )
        .into_response())
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
        response.extensions_mut().insert(super::error::ExactBody);
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
    let transfer = ledger::repo::get_transfer(pool, id).await?;
    // A transfer that began as a hold is shown with its hold, whatever its
    // status; the hold's row exists from the start.
    let hold = ledger::holds::get(pool, id).await?;
    let (from, to) = match (&hold, &transfer) {
        (Some(h), _) => (h.from_account.as_str(), h.to_account.as_str()),
        (None, Some(t)) => (t.from_account.as_str(), t.to_account.as_str()),
        (None, None) => return Err(ApiError::NotFound),
    };
    let accounts = ledger::repo::get_accounts(pool, &[from, to]).await?;
    if !accounts
        .iter()
        .any(|a| a.principal_id == Some(principal.id))
    {
        return Err(ApiError::NotFound);
    }
    let body = match &hold {
        Some(hold) => render::render_hold_current(hold, transfer.as_ref()),
        None => transfer
            .as_ref()
            .map(render::render_current)
            .unwrap_or_default(),
    };
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransfersQuery {
    pub limit: Option<String>,
    pub cursor: Option<String>,
    pub account: Option<String>,
    pub created_after: Option<String>,
    pub created_before: Option<String>,
    pub idempotency_key: Option<String>,
}

#[derive(Serialize)]
pub struct TransfersPage<'a> {
    pub transfers: Vec<ListedView<'a>>,
    /// Pass as `cursor` to get the next (older) page; null on the last page.
    pub next_cursor: Option<String>,
}

/// One item of `GET /transfers`, as `GET /transfers/{id}` shows it.
#[derive(Serialize)]
#[serde(untagged)]
pub enum ListedView<'a> {
    Transfer(TransferView<'a>),
    Hold(HoldTransferView<'a>),
}

/// What a page is merged from: a transfer, or a hold (in any status) with
/// the transfer that posted it.
enum Listed<'a> {
    Transfer(&'a ledger::repo::Transfer),
    Hold(&'a Hold, Option<&'a ledger::repo::Transfer>),
}

impl Listed<'_> {
    fn id(&self) -> Uuid {
        match self {
            Self::Transfer(t) => t.id,
            Self::Hold(h, _) => h.id,
        }
    }
}

/// `GET /transfers`: the transfers that debited or credited one of the
/// caller's accounts, holds in every status among them (each as
/// `GET /transfers/{id}` shows it), newest first, a keyset page at a time,
/// so pages stay stable while transfers are added.
#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn list(
    State(state): State<AppState>,
    principal: Principal,
    query: Result<Query<TransfersQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|_| {
        ApiError::unexpected_query(
            "limit, cursor, account, created_after, created_before and idempotency_key",
        )
    })?;
    let limit = paging::limit(query.limit.as_deref())?;
    let before_id = query
        .cursor
        .as_deref()
        .map(|raw| {
            decode_cursor(raw).ok_or_else(|| {
                ApiError::invalid_query(
                    "cursor",
                    "cursor must be a next_cursor value from a previous page",
                )
            })
        })
        .transpose()?;
    let created_after = query
        .created_after
        .as_deref()
        .map(|raw| instant("created_after", raw))
        .transpose()?;
    let created_before = query
        .created_before
        .as_deref()
        .map(|raw| instant("created_before", raw))
        .transpose()?;
    let key = query
        .idempotency_key
        .as_deref()
        .map(|raw| {
            IdempotencyKey::parse(raw.as_bytes()).map_err(|e| {
                ApiError::invalid_query("idempotency_key", format!("idempotency_key: {e}"))
            })
        })
        .transpose()?;
    let pool = &state.transfers.pool;
    let owned = ledger::repo::account_ids_of(pool, principal.id).await?;
    let accounts: Vec<&str> = match query.account.as_deref() {
        // Someone else's account is indistinguishable from no account.
        Some(account) if owned.iter().any(|a| a == account) => vec![account],
        Some(_) => return Err(ApiError::NotFound),
        None => owned.iter().map(String::as_str).collect(),
    };
    let filter = ledger::repo::TransferFilter {
        accounts,
        created_after,
        created_before,
        key: key.as_ref().map(|k| (principal.id, k.as_str())),
        before_id,
    };
    let transfers = ledger::repo::list_transfers(pool, &filter, limit + 1).await?;
    let holds = ledger::holds::list(pool, &filter, limit + 1).await?;
    let posted_ids: Vec<Uuid> = holds
        .iter()
        .filter(|h| h.status == HoldStatus::Posted)
        .map(|h| h.id)
        .collect();
    let posted = if posted_ids.is_empty() {
        Vec::new()
    } else {
        ledger::repo::get_transfers(pool, &posted_ids).await?
    };
    let mut rows: Vec<Listed<'_>> = transfers
        .iter()
        .map(Listed::Transfer)
        .chain(holds.iter().map(|h| {
            let transfer = posted.iter().find(|t| t.id == h.id);
            Listed::Hold(h, transfer)
        }))
        .collect();
    // Both halves are newest first by id; so is the page.
    rows.sort_unstable_by_key(|row| std::cmp::Reverse(row.id()));
    let more = paging::has_more(&mut rows, limit);
    let next_cursor = more
        .then(|| rows.last().map(|row| encode_cursor(row.id())))
        .flatten();
    let page = TransfersPage {
        transfers: rows
            .iter()
            .map(|row| match row {
                Listed::Transfer(t) => ListedView::Transfer(render::current_view(t)),
                Listed::Hold(h, t) => ListedView::Hold(render::hold_current_view(h, *t)),
            })
            .collect(),
        next_cursor,
    };
    Ok(Json(page).into_response())
}

/// A time filter: RFC 3339 with its offset.
fn instant(param: &'static str, raw: &str) -> Result<DateTime<Utc>, ApiError> {
    DateTime::parse_from_rfc3339(raw)
        .map(|at| at.with_timezone(&Utc))
        .map_err(|_| {
            ApiError::invalid_query(
                param,
                format!("{param} is an RFC 3339 time, e.g. 2026-11-30T12:00:00Z"),
            )
        })
}

/// Cursors are opaque to clients: `t` and the last transfer id seen, as
/// 32 hex digits. The prefix keeps them apart from entry cursors.
fn encode_cursor(id: Uuid) -> String {
    format!("t{}", id.simple())
}

/// Only the exact spelling `encode_cursor` produces.
fn decode_cursor(raw: &str) -> Option<Uuid> {
    let hex = raw.strip_prefix('t')?;
    if hex.len() != 32 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    Uuid::try_parse(hex).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_cursors_round_trip_and_reject_anything_else() {
        let id = Uuid::now_v7();
        assert_eq!(decode_cursor(&encode_cursor(id)), Some(id));
        for bad in [
            "",
            "t",
            "e42",
            "tXYZ",
            &format!("t{}", id.hyphenated()),
            &format!("t{}", id.simple()).to_uppercase(),
        ] {
            assert_eq!(decode_cursor(bad), None, "{bad}");
        }
    }
}
