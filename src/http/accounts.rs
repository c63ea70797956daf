//! `GET /accounts/{account_id}` and its statement of entries.

use axum::Json;
use axum::extract::{Query, State};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::AppState;
use super::error::ApiError;
use super::extract::{PathParam, Principal};
use crate::ledger::{self, Account, AccountId};

#[derive(Serialize)]
pub struct AccountView {
    pub account_id: String,
    pub currency: String,
    /// Posted: the sum of the account's entries.
    pub balance_minor: i64,
    /// Reserved by the account's pending transfers (holds).
    pub held_minor: i64,
    /// What the account may still spend: `balance_minor - held_minor`.
    pub available_minor: i64,
}

#[derive(Serialize)]
pub struct EntryView {
    pub entry_id: i64,
    pub transfer_id: Uuid,
    pub direction: &'static str,
    /// Signed: negative for a debit, positive for a credit.
    pub amount_minor: i64,
    pub currency: String,
    pub balance_after_minor: i64,
    pub created_at: String,
}

#[derive(Serialize)]
pub struct EntriesPage {
    pub entries: Vec<EntryView>,
    /// Pass as `cursor` to get the next (older) page; null on the last page.
    pub next_cursor: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntriesQuery {
    pub limit: Option<String>,
    pub cursor: Option<String>,
}

/// The account, if it exists and belongs to the caller. Anything else is the
/// same 404, so ids of other principals cannot be probed (BOLA).
async fn owned_account(
    state: &AppState,
    principal: Principal,
    account_id: &str,
) -> Result<Account, ApiError> {
    let id = AccountId::parse(account_id).map_err(|_| ApiError::NotFound)?;
    ledger::repo::get_account(&state.pool, id.as_str())
        .await?
        .filter(|a| a.principal_id == Some(principal.id))
        .ok_or(ApiError::NotFound)
}

#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn get(
    State(state): State<AppState>,
    principal: Principal,
    PathParam(account_id): PathParam,
) -> Result<Json<AccountView>, ApiError> {
    let account = owned_account(&state, principal, &account_id).await?;
    Ok(Json(AccountView {
        available_minor: account.available_minor(),
        account_id: account.id,
        currency: account.currency,
        balance_minor: account.balance_minor,
        held_minor: account.held_minor,
    }))
}

#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn entries(
    State(state): State<AppState>,
    principal: Principal,
    PathParam(account_id): PathParam,
    query: Result<Query<EntriesQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<EntriesPage>, ApiError> {
    let Query(query) = query.map_err(|_| ApiError::unexpected_query("limit and cursor"))?;
    let limit = super::paging::limit(query.limit.as_deref())?;
    let before = match query.cursor.as_deref() {
        None => None,
        Some(raw) => Some(decode_cursor(raw).ok_or_else(|| {
            ApiError::invalid_query(
                "cursor",
                "cursor must be a next_cursor value from a previous page",
            )
        })?),
    };
    let account = owned_account(&state, principal, &account_id).await?;
    // One extra row tells whether another page exists without a count.
    let mut rows = ledger::repo::list_entries(&state.pool, &account.id, before, limit + 1).await?;
    let has_more = super::paging::has_more(&mut rows, limit);
    let next_cursor = has_more
        .then(|| rows.last().map(|e| encode_cursor(e.id)))
        .flatten();
    Ok(Json(EntriesPage {
        entries: rows
            .into_iter()
            .map(|e| EntryView {
                entry_id: e.id,
                transfer_id: e.transfer_id,
                direction: if e.amount_minor < 0 {
                    "debit"
                } else {
                    "credit"
                },
                amount_minor: e.amount_minor,
                currency: e.currency,
                balance_after_minor: e.balance_after_minor,
                created_at: super::timestamp(e.created_at),
            })
            .collect(),
        next_cursor,
    }))
}

/// Cursors are opaque to clients: `e` and the last entry id seen. The prefix
/// leaves room to change the scheme without misreading old cursors.
fn encode_cursor(entry_id: i64) -> String {
    format!("e{entry_id}")
}

/// Digits a cursor may carry. Entry ids are identities that never reach
/// 10^18, and a bound in digits is a syntax `openapi.yaml` can state
/// exactly (`^e[1-9][0-9]{0,17}$`), unlike the range of an i64.
const CURSOR_DIGITS_MAX: usize = 18;

/// Only the exact spelling `encode_cursor` produces: `e+5` or `e05` would
/// parse as numbers, but no page ever issued them.
fn decode_cursor(raw: &str) -> Option<i64> {
    let digits = raw.strip_prefix('e')?;
    if digits.starts_with('0')
        || digits.len() > CURSOR_DIGITS_MAX
        || !digits.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    digits.parse::<i64>().ok().filter(|id| *id > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_reject_garbage() {
        assert_eq!(decode_cursor(&encode_cursor(42)), Some(42));
        let longest = "9".repeat(CURSOR_DIGITS_MAX);
        assert!(decode_cursor(&format!("e{longest}")).is_some());
        for bad in [
            "",
            "42",
            "e",
            "e-1",
            "e0",
            "eabc",
            "e99999999999999999999",
            "e1000000000000000000",
            "e+5",
            "e05",
            " e5",
        ] {
            assert_eq!(decode_cursor(bad), None, "{bad}");
        }
    }
}
