#![doc = include_str!("../README.md")]

mod client;
mod error;
mod intent;
mod key;
mod model;
mod problem;
mod retry;

pub use client::{
    Attempt, AttemptResult, Client, ClientBuilder, DEFAULT_ATTEMPT_TIMEOUT, GiveUpReason, NextStep,
    Readiness,
};
pub use error::{Error, ProblemResponse, TransportError, TransportErrorKind};
pub use intent::{Operation, TransferIntent, TransferOutcome};
pub use key::{IdempotencyKey, InvalidKey, KEY_LEN_MAX};
pub use model::{
    Account, Direction, EntriesPage, Entry, Health, Hold, KeyAnswer, KeyState, KeyStatus,
    PageQuery, Receipt, Transfer, TransferMode, TransferQuery, TransferRequest, TransferStatus,
    TransfersPage,
};
pub use problem::{Problem, ProblemType};
pub use retry::{RetryPolicy, is_retryable, parse_retry_after};

/// The reqwest this crate is built on, for [`ClientBuilder::http_client`].
pub use reqwest;
