//! What the load generator saw: each request's answer, kept for the
//! report and for the checks on the database.

use uuid::Uuid;

use crate::scenario::Intent;

/// What one request got back.
#[derive(Debug, Clone)]
pub enum Answer {
    Created { transfer_id: Uuid, replayed: bool },
    Problem { status: u16, slug: String },
    Other { status: u16 },
    Transport(String),
}

impl Answer {
    pub fn label(&self) -> String {
        match self {
            Answer::Created {
                replayed: false, ..
            } => "201".to_owned(),
            Answer::Created { replayed: true, .. } => "201 replayed".to_owned(),
            Answer::Problem { status, slug } => format!("{status} {slug}"),
            Answer::Other { status } => status.to_string(),
            Answer::Transport(_) => "transport error".to_owned(),
        }
    }

    pub fn is_error(&self) -> bool {
        match self {
            Answer::Problem { status, .. } | Answer::Other { status } => *status >= 500,
            Answer::Transport(_) => true,
            Answer::Created { .. } => false,
        }
    }
}

/// One request's intent and answer, kept for the checks.
#[derive(Debug, Clone)]
pub struct Observation {
    pub intent: Intent,
    /// Sent with a body that differs from what the key was first used for.
    pub conflict: bool,
    pub answer: Answer,
}
