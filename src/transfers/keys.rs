//! What became of an idempotency key: the lookup a client uses when it lost
//! track of an intent and no longer has (or no longer wants to send) the
//! exact request. Reads only; never claims, takes over or completes a key.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::intent::ROUTE;
use super::{IN_FLIGHT_RETRY_AFTER_SECS, RetryReason, TransferError, Transfers};
use crate::idempotency::store::CancelOutcome;
use crate::idempotency::{IdempotencyKey, KeyStatus, store};
use crate::ledger;
use crate::principal::PrincipalId;

/// A key's state, as the lookup answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyState {
    /// A request holds the key now; ask again (or retry) after this long.
    InFlight { retry_after_secs: u64 },
    /// Its answer is kept: a retry of the same request replays it, byte for
    /// byte from the stored copy until `expires_at`, then rebuilt from the
    /// compact record until `retained_until`.
    Completed {
        response_status: u16,
        transfer_id: Option<Uuid>,
        completed_at: DateTime<Utc>,
        expires_at: DateTime<Utc>,
        retained_until: DateTime<Utc>,
        compacted: bool,
    },
    /// Released after a technical failure, or abandoned by a process that
    /// died: the same request executes again, once.
    Failed,
    /// Its record is past its retention (or was a failed claim past its
    /// TTL); the transfer it moved, if any, stays (a retry of the same
    /// request is answered with it).
    Expired { transfer_id: Option<Uuid> },
    /// The intent was cancelled by its key: every request with it is
    /// refused until `retained_until`.
    Cancelled {
        cancelled_at: DateTime<Utc>,
        retained_until: DateTime<Utc>,
    },
}

/// What cancelling an intent by its key answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cancellation {
    /// Nothing will execute under the key (a tombstone, durable and, with a
    /// synchronous standby, replicated).
    Cancelled {
        cancelled_at: DateTime<Utc>,
        retained_until: DateTime<Utc>,
    },
    /// A request holds the key; ask again after this long.
    InFlight { retry_after_secs: u64 },
    /// The intent completed; its transfer, if it moved money.
    Completed { transfer_id: Option<Uuid> },
}

impl Transfers {
    /// The state of `key` in `principal`'s scope; `None` when the key was
    /// never seen (or belongs to someone else: scopes never mix).
    pub async fn key_state(
        &self,
        principal: PrincipalId,
        key: &IdempotencyKey,
    ) -> Result<Option<KeyState>, TransferError> {
        let record = store::record(&self.pool, principal, key).await?;
        let state = match record {
            Some(r) if !r.forgotten => match r.status {
                KeyStatus::InProgress if r.lease_live => {
                    let left = (r.locked_until - Utc::now()).num_seconds();
                    KeyState::InFlight {
                        retry_after_secs: u64::try_from(left)
                            .unwrap_or(0)
                            .max(IN_FLIGHT_RETRY_AFTER_SECS),
                    }
                }
                KeyStatus::InProgress | KeyStatus::Failed => KeyState::Failed,
                KeyStatus::Cancelled => KeyState::Cancelled {
                    cancelled_at: r.updated_at,
                    retained_until: r.retain_until,
                },
                KeyStatus::Completed => {
                    // A completed record is an answer: like a replay, it is
                    // given only once a synchronous standby has it.
                    self.replication
                        .confirm(self.postings.settings().replication_timeout)
                        .await
                        .map_err(|_| TransferError::Retryable(RetryReason::NotReplicated))?;
                    KeyState::Completed {
                        response_status: r
                            .response_status
                            .and_then(|s| u16::try_from(s).ok())
                            .unwrap_or(500),
                        transfer_id: r.transfer_id,
                        completed_at: r.updated_at,
                        expires_at: r.expires_at,
                        retained_until: r.retain_until,
                        compacted: r.compacted,
                    }
                }
            },
            expired => {
                let transfer =
                    ledger::repo::get_transfer_by_key(&self.pool, principal, key.as_str()).await?;
                match (expired, transfer) {
                    (None, None) => return Ok(None),
                    (_, transfer) => KeyState::Expired {
                        transfer_id: transfer.map(|t| t.id),
                    },
                }
            }
        };
        Ok(Some(state))
    }

    /// Cancels the intent of `key`: from now on no request with it executes,
    /// unless it is in flight (it may still complete) or has completed (its
    /// answer stands; money that moved is undone by a reversal). Cancelling
    /// twice answers the same.
    pub async fn cancel(
        &self,
        principal: PrincipalId,
        key: &IdempotencyKey,
        request_id: Option<&str>,
    ) -> Result<Cancellation, TransferError> {
        let transfer = ledger::repo::get_transfer_by_key(&self.pool, principal, key.as_str())
            .await?
            .map(|t| t.id);
        let outcome = store::cancel(
            &self.pool,
            self.policy,
            principal,
            key,
            ROUTE,
            transfer,
            request_id,
        )
        .await?;
        Ok(match outcome {
            CancelOutcome::Cancelled {
                cancelled_at,
                retain_until,
            } => {
                // The promise that the intent never executes holds only once
                // a synchronous standby has the tombstone.
                self.replication
                    .confirm(self.postings.settings().replication_timeout)
                    .await
                    .map_err(|_| TransferError::Retryable(RetryReason::NotReplicated))?;
                Cancellation::Cancelled {
                    cancelled_at,
                    retained_until: retain_until,
                }
            }
            CancelOutcome::InFlight { locked_until } => Cancellation::InFlight {
                retry_after_secs: u64::try_from((locked_until - Utc::now()).num_seconds())
                    .unwrap_or(0)
                    .max(IN_FLIGHT_RETRY_AFTER_SECS),
            },
            CancelOutcome::Completed { transfer_id } => Cancellation::Completed { transfer_id },
            CancelOutcome::TransferExists { transfer_id } => Cancellation::Completed {
                transfer_id: Some(transfer_id),
            },
        })
    }
}
