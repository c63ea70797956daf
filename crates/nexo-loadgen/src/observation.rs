//! What the load generator saw: each request's answer, kept for the
//! report and for the checks on the database.

use uuid::Uuid;

use crate::scenario::Intent;

/// What one request got back.
#[derive(Debug, Clone)]
pub enum Answer {
    /// A 2xx with its transfer: 201, or 200 for a hold's post.
    Created {
        status: u16,
        transfer_id: Uuid,
        replayed: bool,
    },
    Problem {
        status: u16,
        slug: String,
    },
    Other {
        status: u16,
    },
    Transport(String),
}

impl Answer {
    pub fn label(&self) -> String {
        match self {
            Answer::Created {
                status,
                replayed: false,
                ..
            } => status.to_string(),
            Answer::Created {
                status,
                replayed: true,
                ..
            } => format!("{status} replayed"),
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

impl Observation {
    /// What the intent's own request got (not a conflicting reuse).
    pub fn of(intent: Intent, answer: Answer) -> Self {
        Self {
            intent,
            conflict: false,
            answer,
        }
    }
}
