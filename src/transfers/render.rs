//! A transfer as clients see it: its JSON, deterministic for a given row,
//! so the same transfer always renders to the same bytes (a late retry
//! whose record was purged is answered with exactly what the first request
//! got).

use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;
use uuid::Uuid;

use super::intent::ROUTE;
use crate::idempotency::StoredResponse;
use crate::ledger::Transfer;

#[derive(Serialize)]
pub struct TransferView<'a> {
    pub transfer_id: Uuid,
    pub status: &'a str,
    pub from: &'a str,
    pub to: &'a str,
    pub amount_minor: i64,
    pub currency: &'a str,
    pub description: Option<&'a str>,
    pub created_at: String,
    pub receipt: ReceiptView<'a>,
}

#[derive(Serialize)]
pub struct ReceiptView<'a> {
    pub receipt_id: &'a str,
    pub debit_entry_id: i64,
    pub credit_entry_id: i64,
    pub issued_at: String,
}

/// Timestamps in responses: RFC 3339, UTC, microseconds (PostgreSQL's
/// precision), so a row always renders to the same text.
pub fn timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

pub fn render_transfer(transfer: &Transfer) -> Bytes {
    Bytes::from(serde_json::to_vec(&view(transfer)).unwrap_or_default())
}

/// The transfer's representation, for a response that holds several.
pub fn view(transfer: &Transfer) -> TransferView<'_> {
    let created_at = timestamp(transfer.created_at);
    TransferView {
        transfer_id: transfer.id,
        status: &transfer.status,
        from: &transfer.from_account,
        to: &transfer.to_account,
        amount_minor: transfer.amount_minor,
        currency: &transfer.currency,
        description: transfer.description.as_deref(),
        created_at: created_at.clone(),
        receipt: ReceiptView {
            receipt_id: &transfer.receipt_id,
            debit_entry_id: transfer.debit_entry_id,
            credit_entry_id: transfer.credit_entry_id,
            issued_at: created_at,
        },
    }
}

/// The 201 a posted transfer is answered with, and stored under its key.
pub fn created(transfer: &Transfer) -> StoredResponse {
    let location = HeaderValue::from_str(&format!("{ROUTE}/{}", transfer.id))
        .unwrap_or_else(|_| HeaderValue::from_static(ROUTE));
    StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (header::LOCATION, location),
        ],
        body: render_transfer(transfer),
    }
}
