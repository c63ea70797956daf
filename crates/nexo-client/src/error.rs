//! What a call can end with other than its answer.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;

use crate::problem::{Problem, ProblemType};
use crate::retry;

/// Why a call did not return its answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The server answered with a problem document: a refusal, or (when the
    /// retries ran out, inside [`Error::GaveUp`]) a 409, 429 or 5xx.
    #[error("{0}")]
    Problem(Box<ProblemResponse>),
    /// An error status whose body is not a problem document, such as a
    /// proxy's error page.
    #[error("HTTP {status} without a problem document")]
    UnexpectedStatus { status: u16, body: Bytes },
    /// A success whose body is not what the route answers: a server that
    /// speaks another version of the API.
    #[error("HTTP {status} with a body this client cannot read: {source}")]
    Decode {
        status: u16,
        body: Bytes,
        #[source]
        source: serde_json::Error,
    },
    /// No whole answer: a timeout, no connection, or a connection that
    /// broke before the answer was read. For a transfer the server may or
    /// may not have executed it: send the intent again (same key) to learn
    /// which.
    #[error("{0}")]
    Transport(#[from] TransportError),
    /// The request could not be built (a base URL that cannot take a path,
    /// a token that is no header value); nothing was sent.
    #[error("cannot build the request: {0}")]
    Request(String),
    /// Every attempt the retry policy allowed got an answer that may change
    /// later; `last` is the last one. A transfer intent can be sent again,
    /// or resumed with its key. (A call of a single attempt returns that
    /// attempt's error itself.)
    #[error("gave up after {attempts} attempts in {:.1}s; the last: {last}", elapsed.as_secs_f64())]
    GaveUp {
        attempts: u32,
        elapsed: Duration,
        last: Box<Error>,
    },
}

impl Error {
    /// The problem document the server answered with, also when it was the
    /// last answer before giving up.
    pub fn problem(&self) -> Option<&ProblemResponse> {
        match self {
            Error::Problem(problem) => Some(problem),
            Error::GaveUp { last, .. } => last.problem(),
            _ => None,
        }
    }

    /// The type of [`Error::problem`].
    pub fn problem_type(&self) -> Option<ProblemType> {
        self.problem().map(|p| p.problem.problem_type())
    }

    /// The HTTP status, when there was an answer.
    pub fn status(&self) -> Option<u16> {
        match self {
            Error::Problem(problem) => Some(problem.status),
            Error::UnexpectedStatus { status, .. } | Error::Decode { status, .. } => Some(*status),
            Error::GaveUp { last, .. } => last.status(),
            Error::Transport(_) | Error::Request(_) => None,
        }
    }

    /// The exact bytes of the answer's body, when there was one.
    pub fn body(&self) -> Option<&Bytes> {
        match self {
            Error::Problem(problem) => Some(&problem.body),
            Error::UnexpectedStatus { body, .. } | Error::Decode { body, .. } => Some(body),
            Error::GaveUp { last, .. } => last.body(),
            Error::Transport(_) | Error::Request(_) => None,
        }
    }

    /// Whether sending the same request again may get another answer.
    /// Always false for [`Error::GaveUp`]: the policy already retried.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Problem(problem) => {
                retry::is_retryable(problem.status, Some(&problem.problem.problem_type()))
            }
            Error::UnexpectedStatus { status, .. } => retry::is_retryable(*status, None),
            Error::Transport(_) => true,
            Error::Decode { .. } | Error::Request(_) | Error::GaveUp { .. } => false,
        }
    }
}

/// An answer with a problem document.
#[derive(Debug, Clone)]
pub struct ProblemResponse {
    pub status: u16,
    pub problem: Problem,
    /// `Idempotent-Replayed: true`: a stored refusal (such as
    /// `insufficient-funds`) answered again to a retry of its request.
    pub replayed: bool,
    /// The server's `Retry-After`.
    pub retry_after: Option<Duration>,
    /// The body as received, byte for byte.
    pub body: Bytes,
}

impl fmt::Display for ProblemResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.problem)?;
        if self.replayed {
            f.write_str(" (replayed)")?;
        }
        Ok(())
    }
}

/// No whole answer arrived.
#[derive(Debug, thiserror::Error)]
#[error("{}", describe(.0))]
pub struct TransportError(#[source] pub(crate) reqwest::Error);

/// What kind of failure a [`TransportError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportErrorKind {
    /// The attempt timeout ran out.
    TimedOut,
    /// No connection could be made.
    Connect,
    /// The connection broke before the whole answer was read.
    ConnectionLost,
}

impl TransportError {
    pub fn kind(&self) -> TransportErrorKind {
        if self.0.is_timeout() {
            TransportErrorKind::TimedOut
        } else if self.0.is_connect() {
            TransportErrorKind::Connect
        } else {
            TransportErrorKind::ConnectionLost
        }
    }

    pub fn reqwest(&self) -> &reqwest::Error {
        &self.0
    }
}

/// The kind and the innermost cause: reqwest's own message names only the
/// URL, the cause says what the socket saw.
fn describe(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else {
        "connection lost before the answer"
    };
    let mut cause = None;
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        cause = Some(s.to_string());
        source = s.source();
    }
    match cause {
        Some(cause) => format!("{kind} ({cause})"),
        None => kind.to_owned(),
    }
}
