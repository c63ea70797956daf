//! The events table: the transactional outbox of the ledger. Events are
//! written by the statements that change the ledger (`repo`, `holds`), in
//! the same transaction; this module reads them as a feed, a page at a time
//! after a cursor, and purges them past their retention.
//!
//! The feed's order is (txid, position), and a page holds only events of
//! transactions older than every transaction still running
//! (`pg_snapshot_xmin`): an event that commits later belongs to a newer
//! transaction, so it sorts after any cursor already handed out. Ordering by
//! position alone would not do: a transaction that took a smaller position
//! may commit after a reader has passed a larger one, and that event would
//! be skipped for ever. ADR-011.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgExecutor, PgPool};
use uuid::Uuid;

use crate::principal::PrincipalId;

/// What happened. A closed set, the table's CHECK says the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    /// A transfer moved money: an immediate transfer, a batch's leg or an
    /// operator's deposit.
    TransferPosted,
    /// A reversal moved money back: the reversal's own transfer (it names
    /// the original in `reverses`).
    TransferReversed,
    /// A pending transfer reserved its amount.
    HoldCreated,
    /// A pending transfer was posted, in full or in part: money moved.
    HoldPosted,
    /// A pending transfer was voided: its reservation released.
    HoldVoided,
    /// A pending transfer passed its expiry: its reservation released.
    HoldExpired,
    /// A webhook endpoint failed past its retry window and was disabled:
    /// not a ledger change, so it names no account and has no sequence.
    WebhookEndpointDisabled,
}

impl EventType {
    pub const ALL: [EventType; 7] = [
        EventType::TransferPosted,
        EventType::TransferReversed,
        EventType::HoldCreated,
        EventType::HoldPosted,
        EventType::HoldVoided,
        EventType::HoldExpired,
        EventType::WebhookEndpointDisabled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::TransferPosted => "transfer.posted",
            Self::TransferReversed => "transfer.reversed",
            Self::HoldCreated => "hold.created",
            Self::HoldPosted => "hold.posted",
            Self::HoldVoided => "hold.voided",
            Self::HoldExpired => "hold.expired",
            Self::WebhookEndpointDisabled => "webhook_endpoint.disabled",
        }
    }
}

impl fmt::Display for EventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A place in the feed: after the event of transaction `txid` at
/// `position`. Opaque to clients: `x`, then both numbers as 16 hex digits
/// each. Both fit in an i64 (a position is a bigint; a txid carries a 32-bit
/// epoch that would take billions of years of transactions to reach 2^31).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cursor {
    pub txid: i64,
    pub position: i64,
}

impl Cursor {
    /// Before every event.
    pub const START: Cursor = Cursor {
        txid: 0,
        position: 0,
    };

    pub fn encode(self) -> String {
        format!("x{:016x}{:016x}", self.txid, self.position)
    }

    /// Only the exact spelling [`Cursor::encode`] produces: lowercase hex,
    /// both halves within an i64.
    pub fn decode(raw: &str) -> Option<Cursor> {
        let hex = raw.strip_prefix('x')?;
        if hex.len() != 32 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        let (txid, position) = hex.split_at(16);
        Some(Cursor {
            txid: i64::from_str_radix(txid, 16).ok()?,
            position: i64::from_str_radix(position, 16).ok()?,
        })
    }
}

/// One event, as stored.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Event {
    pub id: Uuid,
    pub position: i64,
    pub txid: i64,
    #[sqlx(rename = "type")]
    pub event_type: String,
    pub resource_id: Uuid,
    pub resource: sqlx::types::JsonValue,
    pub occurred_at: DateTime<Utc>,
    /// The accounts a ledger event moved (or reserved on); none for a
    /// notice about a webhook endpoint.
    pub from_account: Option<String>,
    pub to_account: Option<String>,
    pub from_principal: Option<PrincipalId>,
    pub to_principal: Option<PrincipalId>,
    pub from_seq: Option<i64>,
    pub to_seq: Option<i64>,
}

impl Event {
    pub fn cursor(&self) -> Cursor {
        Cursor {
            txid: self.txid,
            position: self.position,
        }
    }

    /// The accounts of the event `principal` owns, with this event's
    /// sequence number on each (an account the event did not move has
    /// none). Another principal's account's numbers are not shown: they
    /// would tell how busy that account is.
    pub fn sequences_of(&self, principal: PrincipalId) -> Vec<(&str, i64)> {
        let from = (self.from_principal == Some(principal))
            .then_some(self.from_account.as_deref())
            .flatten()
            .zip(self.from_seq);
        let to = (self.to_principal == Some(principal))
            .then_some(self.to_account.as_deref())
            .flatten()
            .zip(self.to_seq);
        from.into_iter().chain(to).collect()
    }
}

/// The events `principal` may see after `after`, oldest first, at most
/// `limit`, among those no running transaction can still precede.
///
/// Each of the two index scans (events from the principal's accounts, and
/// to them) reads at most `limit` entries past the cursor; their union is
/// cut to `limit` again, and only those rows are read from the table.
pub async fn page<'e>(
    executor: impl PgExecutor<'e>,
    principal: PrincipalId,
    after: Cursor,
    limit: i64,
) -> Result<Vec<Event>, sqlx::Error> {
    sqlx::query_as(
        "WITH horizon AS MATERIALIZED (
             SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin
         ), page AS (
             SELECT txid, position FROM (
                 (SELECT e.txid, e.position FROM events e
                  WHERE e.from_principal = $1
                    AND (e.txid, e.position) > ($2::int8::text::xid8, $3)
                    AND e.txid < (SELECT xmin FROM horizon)
                  ORDER BY e.txid, e.position
                  LIMIT $4)
                 UNION
                 (SELECT e.txid, e.position FROM events e
                  WHERE e.to_principal = $1
                    AND (e.txid, e.position) > ($2::int8::text::xid8, $3)
                    AND e.txid < (SELECT xmin FROM horizon)
                  ORDER BY e.txid, e.position
                  LIMIT $4)
             ) both_sides
             ORDER BY txid, position
             LIMIT $4
         )
         SELECT e.id, e.position, e.txid::text::int8 AS txid, e.type, e.resource_id, e.resource,
                e.occurred_at, e.from_account, e.to_account, e.from_principal, e.to_principal,
                e.from_seq, e.to_seq
         FROM page p
         JOIN events e ON e.position = p.position
         ORDER BY p.txid, p.position",
    )
    .bind(principal)
    .bind(after.txid)
    .bind(after.position)
    .bind(limit)
    .fetch_all(executor)
    .await
}

/// What one purge of events did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventsPurged {
    pub deleted: u64,
    /// The oldest event kept, if any: the outbox's age.
    pub oldest: Option<DateTime<Utc>>,
}

/// Deletes events older than `retention`, oldest position first, in
/// statements of at most `batch_rows`, until it meets one within the
/// retention. Deleting a prefix of positions keeps every account's
/// remaining sequence numbers gap-free (an account's events take positions
/// in the order of its numbers, under its row lock). Each statement also
/// records the newest time it deleted (`events_purged`), so the
/// reconciliation knows from when on every change must still have its
/// event.
///
/// It also stops at the first event of transaction `keep_from_txid` or
/// later: the caller's consumers (webhook endpoints) have not passed those
/// yet, and everything deleted is then older than all of them.
#[tracing::instrument(skip(pool))]
pub async fn purge(
    pool: &PgPool,
    retention: Duration,
    batch_rows: i64,
    keep_from_txid: Option<i64>,
) -> Result<EventsPurged, sqlx::Error> {
    let batch_rows = batch_rows.max(1);
    let mut deleted = 0u64;
    loop {
        let (seen, gone): (i64, i64) = sqlx::query_as(
            "WITH oldest AS (
                 SELECT position, occurred_at, txid FROM events ORDER BY position LIMIT $2
             ), stop AS (
                 SELECT min(position) AS position FROM oldest
                 WHERE occurred_at >= now() - make_interval(secs => $1)
                    OR txid >= $3::int8::text::xid8
             ), gone AS (
                 DELETE FROM events e USING oldest o
                 WHERE e.position = o.position
                   AND ((SELECT position FROM stop) IS NULL OR o.position < (SELECT position FROM stop))
                 RETURNING e.occurred_at
             ), noted AS (
                 UPDATE events_purged SET through = GREATEST(through, (SELECT max(occurred_at) FROM gone))
                 WHERE EXISTS (SELECT 1 FROM gone)
             )
             SELECT (SELECT count(*) FROM oldest), (SELECT count(*) FROM gone)",
        )
        .bind(retention.as_secs_f64())
        .bind(batch_rows)
        .bind(keep_from_txid)
        .fetch_one(pool)
        .await?;
        deleted += u64::try_from(gone).unwrap_or(0);
        if gone < seen || seen < batch_rows {
            break;
        }
    }
    let oldest = sqlx::query_scalar("SELECT occurred_at FROM events ORDER BY position LIMIT 1")
        .fetch_optional(pool)
        .await?;
    Ok(EventsPurged { deleted, oldest })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_in_their_order() {
        let cursors = [
            Cursor::START,
            Cursor {
                txid: 7,
                position: 1_000,
            },
            Cursor {
                txid: 8,
                position: 2,
            },
            Cursor {
                txid: i64::MAX,
                position: i64::MAX,
            },
        ];
        for cursor in cursors {
            let text = cursor.encode();
            assert_eq!(text.len(), 33);
            assert_eq!(Cursor::decode(&text), Some(cursor));
        }
        let texts: Vec<String> = cursors.iter().map(|c| c.encode()).collect();
        assert!(texts.is_sorted(), "the text sorts as the cursor: {texts:?}");
    }

    #[test]
    fn cursors_the_server_never_issued_are_refused() {
        let good = Cursor {
            txid: 7,
            position: 9,
        }
        .encode();
        for bad in [
            String::new(),
            "x".to_owned(),
            good[1..].to_owned(),
            good.to_uppercase(),
            format!("{good}0"),
            good[..32].to_owned(),
            format!("y{}", &good[1..]),
            format!("x8{}", &good[2..]),
            format!("x{}8{}", &good[1..17], &good[18..]),
            format!("x{}", "g".repeat(32)),
            format!(" {good}"),
        ] {
            assert_eq!(Cursor::decode(&bad), None, "{bad}");
        }
    }

    #[test]
    fn a_principal_sees_only_the_sequences_of_its_own_accounts() {
        let (mine, theirs) = (PrincipalId(Uuid::now_v7()), PrincipalId(Uuid::now_v7()));
        let event = |from_principal, to_principal, to_seq| Event {
            id: Uuid::now_v7(),
            position: 1,
            txid: 1,
            event_type: "transfer.posted".to_owned(),
            resource_id: Uuid::now_v7(),
            resource: serde_json::json!({}),
            occurred_at: Utc::now(),
            from_account: Some("acc_a".to_owned()),
            to_account: Some("acc_b".to_owned()),
            from_principal,
            to_principal,
            from_seq: Some(3),
            to_seq,
        };
        assert_eq!(
            event(Some(mine), Some(theirs), Some(9)).sequences_of(mine),
            [("acc_a", 3)]
        );
        assert_eq!(
            event(Some(theirs), Some(mine), Some(9)).sequences_of(mine),
            [("acc_b", 9)]
        );
        assert_eq!(
            event(Some(mine), Some(mine), Some(9)).sequences_of(mine),
            [("acc_a", 3), ("acc_b", 9)]
        );
        assert_eq!(
            event(Some(theirs), Some(mine), None).sequences_of(mine),
            [],
            "a hold's creation does not move its destination"
        );
        let notice = Event {
            event_type: "webhook_endpoint.disabled".to_owned(),
            from_account: None,
            to_account: None,
            from_seq: None,
            ..event(Some(mine), None, None)
        };
        assert_eq!(notice.sequences_of(mine), [], "it moved no account");
    }
}
