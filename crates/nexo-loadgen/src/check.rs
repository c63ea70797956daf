//! The checks after a run, on the database itself: the ledger reconciles,
//! every intent executed at most once and exactly as its answers say, and a
//! replay run wrote nothing.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use nexo_transfers::reconcile::{self, Report};

use crate::Error;
use crate::observation::{Answer, Observation};
use crate::scenario::Plan;

/// Violations listed by name in the report; the rest are only counted.
const VIOLATION_EXAMPLES_MAX: usize = 10;

#[derive(Debug, Serialize)]
pub struct CheckReport {
    pub ledger: Report,
    pub keys_checked: usize,
    /// Keys with a transfer in the ledger.
    pub keys_executed: usize,
    pub violations: usize,
    pub violation_examples: Vec<String>,
    /// For `replay`: whether anything was written while replaying.
    pub writes_during_replay: Option<bool>,
}

impl CheckReport {
    pub fn passed(&self) -> bool {
        self.ledger.ok && self.violations == 0 && self.writes_during_replay != Some(true)
    }

    pub fn print(&self) {
        println!(
            "  ledger: {}; {} keys checked, {} executed, {} executed other than answered{}",
            if self.ledger.ok {
                "reconciles".to_owned()
            } else {
                format!("DOES NOT RECONCILE\n{}", self.ledger)
            },
            self.keys_checked,
            self.keys_executed,
            self.violations,
            match self.writes_during_replay {
                Some(true) => "; REPLAYS WROTE TO THE DATABASE",
                Some(false) => "; replays wrote nothing",
                None => "",
            }
        );
        for v in &self.violation_examples {
            println!("    {v}");
        }
    }
}

/// What changes when anything is written: row counts and the latest
/// update of an idempotency record.
#[derive(Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct WriteMarks {
    transfers: i64,
    entries: i64,
    keys: i64,
    last_key_update: Option<DateTime<Utc>>,
}

pub async fn write_marks(pool: &PgPool) -> Result<WriteMarks, Error> {
    Ok(sqlx::query_as(
        "SELECT (SELECT count(*) FROM transfers) AS transfers,
                (SELECT count(*) FROM ledger_entries) AS entries,
                (SELECT count(*) FROM idempotency_keys) AS keys,
                (SELECT max(updated_at) FROM idempotency_keys) AS last_key_update",
    )
    .fetch_one(pool)
    .await?)
}

/// Everything the client saw for one key.
#[derive(Default)]
struct KeyView {
    /// The amount of the key's own intent (not of a conflicting reuse).
    amount: Option<i64>,
    first_executions: u32,
    transfer_ids: HashSet<Uuid>,
    insufficient_funds: bool,
    conflict_accepted: bool,
}

#[derive(sqlx::FromRow)]
struct KeyRow {
    principal_id: Uuid,
    key: String,
    transfers: i64,
    ids: Vec<Uuid>,
    amount_minor: Option<i64>,
}

pub async fn check(
    pool: &PgPool,
    plan: &Plan,
    observations: &[Observation],
    before: Option<WriteMarks>,
) -> Result<CheckReport, Error> {
    let writes_during_replay = match before {
        Some(before) => Some(write_marks(pool).await? != before),
        None => None,
    };

    let mut views: HashMap<(Uuid, Arc<str>), KeyView> = HashMap::new();
    for o in observations {
        let principal = plan.fixture.principals[o.intent.principal].id;
        let view = views.entry((principal, o.intent.key.clone())).or_default();
        if !o.conflict {
            view.amount = Some(o.intent.amount);
        }
        match &o.answer {
            Answer::Created { .. } if o.conflict => view.conflict_accepted = true,
            Answer::Created {
                transfer_id,
                replayed,
                ..
            } => {
                view.transfer_ids.insert(*transfer_id);
                view.first_executions += u32::from(!replayed);
            }
            Answer::Problem { slug, .. } if slug == "insufficient-funds" && !o.conflict => {
                view.insufficient_funds = true;
            }
            _ => {}
        }
    }

    let (principals, keys): (Vec<Uuid>, Vec<String>) =
        views.keys().map(|(p, k)| (*p, k.to_string())).unzip();
    // A key made a transfer or (for `hold`) a hold: both are unique per
    // principal and key, and a key made one or the other.
    let rows: Vec<KeyRow> = sqlx::query_as(
        "SELECT k.principal_id, k.key, count(t.id) AS transfers,
                COALESCE(array_agg(t.id) FILTER (WHERE t.id IS NOT NULL), '{}') AS ids,
                max(t.amount_minor) AS amount_minor
         FROM unnest($1::uuid[], $2::text[]) AS k(principal_id, key)
         LEFT JOIN LATERAL (
             SELECT id, amount_minor FROM transfers
             WHERE principal_id = k.principal_id AND idempotency_key = k.key
             UNION ALL
             SELECT id, amount_minor FROM holds
             WHERE principal_id = k.principal_id AND idempotency_key = k.key
         ) t ON true
         GROUP BY k.principal_id, k.key",
    )
    .bind(&principals)
    .bind(&keys)
    .fetch_all(pool)
    .await?;

    let mut violations = Vec::new();
    let mut executed = 0;
    for row in &rows {
        let Some(view) = views.get(&(row.principal_id, Arc::from(row.key.as_str()))) else {
            continue;
        };
        let key = &row.key;
        executed += usize::from(row.transfers > 0);
        if row.transfers > 1 {
            violations.push(format!("{key}: executed {} times", row.transfers));
        }
        if view.first_executions > 1 {
            violations.push(format!(
                "{key}: answered as a first execution {} times",
                view.first_executions
            ));
        }
        if !view.transfer_ids.is_empty() {
            let in_ledger: HashSet<Uuid> = row.ids.iter().copied().collect();
            if view.transfer_ids != in_ledger {
                violations.push(format!(
                    "{key}: answered with transfers {:?}, the ledger holds {:?}",
                    view.transfer_ids, row.ids
                ));
            }
        }
        if view.insufficient_funds && (row.transfers > 0 || !view.transfer_ids.is_empty()) {
            violations.push(format!(
                "{key}: refused for insufficient funds, yet executed"
            ));
        }
        if view.conflict_accepted {
            violations.push(format!("{key}: a different body under it was accepted"));
        }
        if row.transfers > 0 && row.amount_minor != view.amount {
            violations.push(format!(
                "{key}: executed {:?}, asked {:?}",
                row.amount_minor, view.amount
            ));
        }
    }
    let violation_count = violations.len();
    violations.truncate(VIOLATION_EXAMPLES_MAX);
    Ok(CheckReport {
        ledger: reconcile::run_ledger_checks(pool).await?,
        keys_checked: rows.len(),
        keys_executed: executed,
        violations: violation_count,
        violation_examples: violations,
        writes_during_replay,
    })
}
