//! The client: one method per route, every call through one retry loop.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use reqwest::header::{CONTENT_TYPE, HeaderMap, LOCATION, RETRY_AFTER};
use reqwest::{Method, Url};
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::error::{Error, ProblemResponse, TransportError};
use crate::intent::{TransferIntent, TransferOutcome};
use crate::key::IdempotencyKey;
use crate::model::{
    Account, EntriesPage, Health, KeyState, PageQuery, Transfer, TransferQuery, TransfersPage,
};
use crate::problem::{Problem, ProblemType};
use crate::retry::{self, RetryPolicy};

/// How long one attempt may take by default: above the server's own
/// request timeout (10 s), so that a slow request ends with the server's
/// 503 and its `Retry-After` rather than with a client-side timeout.
pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(15);

const IDEMPOTENCY_KEY: &str = "idempotency-key";
const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

type Observer = Arc<dyn Fn(&Attempt) + Send + Sync>;

/// A client of one nexo-transfers server, acting as one principal (its
/// bearer token). Cloning is cheap and clones share connections.
///
/// Every call retries what may change on a retry (timeouts, connection
/// errors, 409 `request-in-flight`, 429, 5xx) under the client's
/// [`RetryPolicy`]; `/healthz` and `/readyz` are asked once, as probes
/// are. Transfers are sent as a [`TransferIntent`], which carries the
/// idempotency key that makes those retries safe.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    token: Option<Arc<str>>,
    policy: RetryPolicy,
    attempt_timeout: Duration,
    observer: Option<Observer>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the token: clients end up in logs.
        f.debug_struct("Client")
            .field("base", &self.base.as_str())
            .field("token", &self.token.as_ref().map(|_| "…"))
            .field("policy", &self.policy)
            .field("attempt_timeout", &self.attempt_timeout)
            .finish_non_exhaustive()
    }
}

/// Sets up a [`Client`].
pub struct ClientBuilder {
    base_url: String,
    token: Option<String>,
    policy: RetryPolicy,
    attempt_timeout: Duration,
    http: Option<reqwest::Client>,
    observer: Option<Observer>,
}

impl ClientBuilder {
    /// The bearer token of the principal the client acts as.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// How long one attempt may take, answer read included (default
    /// [`DEFAULT_ATTEMPT_TIMEOUT`]).
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// A reqwest client of the caller's (its pool, TLS, proxies); the
    /// attempt timeout is still applied to every request.
    pub fn http_client(mut self, http: reqwest::Client) -> Self {
        self.http = Some(http);
        self
    }

    /// Called after every attempt of every call, with what the attempt got
    /// and what the client does next: for a log line per attempt.
    pub fn on_attempt(mut self, observer: impl Fn(&Attempt) + Send + Sync + 'static) -> Self {
        self.observer = Some(Arc::new(observer));
        self
    }

    pub fn build(self) -> Result<Client, Error> {
        let base = Url::parse(&self.base_url)
            .map_err(|e| Error::Request(format!("base URL {:?}: {e}", self.base_url)))?;
        if base.cannot_be_a_base() || !matches!(base.scheme(), "http" | "https") {
            return Err(Error::Request(format!(
                "base URL {:?}: not an http(s) URL",
                self.base_url
            )));
        }
        let http = match self.http {
            Some(http) => http,
            None => reqwest::Client::builder()
                .build()
                .map_err(|e| Error::Request(format!("cannot build the HTTP client: {e}")))?,
        };
        Ok(Client {
            http,
            base,
            token: self.token.map(Arc::from),
            policy: self.policy,
            attempt_timeout: self.attempt_timeout,
            observer: self.observer,
        })
    }
}

impl Client {
    /// A client of the server at `base_url` (`http://127.0.0.1:8080`; a
    /// path prefix is kept).
    pub fn builder(base_url: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            base_url: base_url.into(),
            token: None,
            policy: RetryPolicy::default(),
            attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
            http: None,
            observer: None,
        }
    }

    /// The same client (connections, policy, observer) acting as another
    /// principal.
    pub fn with_token(&self, token: impl Into<String>) -> Client {
        Client {
            token: Some(Arc::from(token.into())),
            ..self.clone()
        }
    }

    /// The same client under another retry policy.
    pub fn with_retry_policy(&self, policy: RetryPolicy) -> Client {
        Client {
            policy,
            ..self.clone()
        }
    }

    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// `POST /transfers` (or, for a hold's post or void or a reversal, its
    /// route): sends the intent under its key until the answer
    /// is final or the retry policy runs out. The money moves at most once
    /// however many attempts are made; `replayed` says whether the answer
    /// is the stored one of an earlier attempt. A refusal (such as
    /// `insufficient-funds`, possibly replayed) is [`Error::Problem`];
    /// giving up is [`Error::GaveUp`], after which the intent can be sent
    /// again, or resumed later with its key.
    pub async fn send_transfer(&self, intent: &TransferIntent) -> Result<TransferOutcome, Error> {
        self.transfer(intent, &self.policy).await
    }

    /// One attempt of [`Client::send_transfer`], never retried: for callers
    /// that measure each request or retry on their own terms (with the same
    /// intent, hence the same key).
    pub async fn send_transfer_once(
        &self,
        intent: &TransferIntent,
    ) -> Result<TransferOutcome, Error> {
        self.transfer(intent, &RetryPolicy::single_attempt()).await
    }

    async fn transfer(
        &self,
        intent: &TransferIntent,
        policy: &RetryPolicy,
    ) -> Result<TransferOutcome, Error> {
        let segments = intent.operation().segments();
        let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
        let call = Call {
            operation: intent.operation().route(),
            method: Method::POST,
            url: self.url(&segments, &[])?,
            key: Some(intent.key()),
            body: Some(intent.body().clone()),
        };
        let (answer, attempts) = self.run(&call, policy).await?;
        let transfer: Transfer = decode(&answer)?;
        Ok(TransferOutcome {
            key: intent.key().clone(),
            transfer,
            status: answer.status,
            replayed: answer.replayed,
            location: answer.location,
            body: answer.body,
            attempts,
        })
    }

    /// `GET /transfers`: a page of the caller's transfers, newest first.
    pub async fn list_transfers(&self, query: &TransferQuery) -> Result<TransfersPage, Error> {
        self.get("GET /transfers", &["transfers"], &query.pairs())
            .await
    }

    /// `GET /transfers/{transfer_id}`.
    pub async fn get_transfer(&self, transfer_id: Uuid) -> Result<Transfer, Error> {
        let id = transfer_id.to_string();
        self.get("GET /transfers/{transfer_id}", &["transfers", &id], &[])
            .await
    }

    /// `GET /idempotency-keys/{key}`: what became of one of the caller's
    /// keys, without any side effect.
    pub async fn get_idempotency_key(&self, key: &IdempotencyKey) -> Result<KeyState, Error> {
        self.get(
            "GET /idempotency-keys/{key}",
            &["idempotency-keys", key.as_str()],
            &[],
        )
        .await
    }

    /// `POST /idempotency-keys/{key}/cancel`: no request with the key
    /// executes afterwards. Cancelling twice answers the same, so this is
    /// retried like a read; a key whose intent completed is the final
    /// [`ProblemType::IntentCompleted`].
    pub async fn cancel_intent(&self, key: &IdempotencyKey) -> Result<KeyState, Error> {
        let call = Call {
            operation: "POST /idempotency-keys/{key}/cancel",
            method: Method::POST,
            url: self.url(&["idempotency-keys", key.as_str(), "cancel"], &[])?,
            key: None,
            body: None,
        };
        let (answer, _) = self.run(&call, &self.policy).await?;
        decode(&answer)
    }

    /// `GET /accounts/{account_id}`.
    pub async fn get_account(&self, account_id: &str) -> Result<Account, Error> {
        self.get("GET /accounts/{account_id}", &["accounts", account_id], &[])
            .await
    }

    /// `GET /accounts/{account_id}/entries`: a page of the account's
    /// ledger entries, newest first.
    pub async fn list_entries(
        &self,
        account_id: &str,
        page: &PageQuery,
    ) -> Result<EntriesPage, Error> {
        self.get(
            "GET /accounts/{account_id}/entries",
            &["accounts", account_id, "entries"],
            &page.pairs(),
        )
        .await
    }

    /// `GET /healthz`, asked once.
    pub async fn healthz(&self) -> Result<Health, Error> {
        let call = self.probe("GET /healthz", "healthz")?;
        let (answer, _) = self.run(&call, &RetryPolicy::single_attempt()).await?;
        decode(&answer)
    }

    /// `GET /readyz`, asked once: whether the server can take traffic now.
    /// Not ready (a 503) is an answer, not an error.
    pub async fn readyz(&self) -> Result<Readiness, Error> {
        let call = self.probe("GET /readyz", "readyz")?;
        match self.run(&call, &RetryPolicy::single_attempt()).await {
            Ok((answer, _)) => decode::<Health>(&answer).map(|_| Readiness::Ready),
            Err(Error::Problem(problem)) if problem.status == 503 => {
                Ok(Readiness::NotReady(problem))
            }
            Err(e) => Err(e),
        }
    }

    fn probe(&self, operation: &'static str, segment: &str) -> Result<Call<'static>, Error> {
        Ok(Call {
            operation,
            method: Method::GET,
            url: self.url(&[segment], &[])?,
            key: None,
            body: None,
        })
    }

    async fn get<T: DeserializeOwned>(
        &self,
        operation: &'static str,
        segments: &[&str],
        query: &[(&'static str, String)],
    ) -> Result<T, Error> {
        let call = Call {
            operation,
            method: Method::GET,
            url: self.url(segments, query)?,
            key: None,
            body: None,
        };
        let (answer, _) = self.run(&call, &self.policy).await?;
        decode(&answer)
    }

    /// The base URL with `segments` appended, each percent-encoded as one
    /// path segment (a key may hold `/`, `?`, `#` or `%`).
    fn url(&self, segments: &[&str], query: &[(&'static str, String)]) -> Result<Url, Error> {
        let mut url = self.base.clone();
        url.set_query(None);
        url.set_fragment(None);
        url.path_segments_mut()
            .map_err(|()| Error::Request(format!("base URL {} takes no path", self.base)))?
            .pop_if_empty()
            .extend(segments);
        if !query.is_empty() {
            let mut pairs = url.query_pairs_mut();
            for (name, value) in query {
                pairs.append_pair(name, value);
            }
        }
        Ok(url)
    }

    /// Makes attempts until one is final or `policy` says stop; returns the
    /// successful answer and the attempts it took.
    async fn run(
        &self,
        call: &Call<'_>,
        policy: &RetryPolicy,
    ) -> Result<(Answer, Vec<Attempt>), Error> {
        let first_started = Instant::now();
        let max_attempts = policy.max_attempts.max(1);
        let mut attempts = Vec::new();
        let mut number = 0;
        loop {
            number += 1;
            let started = Instant::now();
            let outcome = self.attempt(call).await;
            let latency = started.elapsed();
            let (result, error, retry_after) = match outcome {
                Ok(answer) if (200..300).contains(&answer.status) => {
                    let result = AttemptResult::Answer {
                        status: answer.status,
                        replayed: answer.replayed,
                        problem: None,
                    };
                    let attempt = self.report(call, number, max_attempts, started, latency, result);
                    attempts.push(attempt.finish(NextStep::Done, self.observer.as_ref()));
                    return Ok((answer, attempts));
                }
                Ok(answer) => {
                    let (status, replayed, retry_after) =
                        (answer.status, answer.replayed, answer.retry_after);
                    let error = answer.into_error();
                    let result = AttemptResult::Answer {
                        status,
                        replayed,
                        problem: error.problem_type(),
                    };
                    (result, error, retry_after)
                }
                Err(error) => {
                    let result = AttemptResult::NoAnswer {
                        error: error.to_string(),
                    };
                    (result, error, None)
                }
            };
            let attempt = self.report(call, number, max_attempts, started, latency, result);
            if !error.is_retryable() {
                attempts.push(attempt.finish(NextStep::Done, self.observer.as_ref()));
                return Err(error);
            }
            let next = if number >= max_attempts {
                NextStep::GiveUp(GiveUpReason::AttemptsExhausted)
            } else {
                let delay = policy.delay(number, retry_after);
                if first_started.elapsed() + delay > policy.max_elapsed {
                    NextStep::GiveUp(GiveUpReason::TimeExhausted)
                } else {
                    NextStep::RetryIn(delay)
                }
            };
            attempts.push(attempt.finish(next, self.observer.as_ref()));
            match next {
                NextStep::RetryIn(delay) => tokio::time::sleep(delay).await,
                // A single-attempt call is not a retry that gave up: its
                // caller wants the answer itself.
                _ if max_attempts == 1 => return Err(error),
                _ => {
                    return Err(Error::GaveUp {
                        attempts: number,
                        elapsed: first_started.elapsed(),
                        last: Box::new(error),
                    });
                }
            }
        }
    }

    fn report(
        &self,
        call: &Call<'_>,
        number: u32,
        max_attempts: u32,
        started: Instant,
        latency: Duration,
        result: AttemptResult,
    ) -> Attempt {
        Attempt {
            operation: call.operation,
            idempotency_key: call.key.cloned(),
            number,
            max_attempts,
            started,
            latency,
            result,
            next: NextStep::Done,
        }
    }

    /// One request and its whole answer: a body that breaks off half-way
    /// is as lost as no answer at all.
    async fn attempt(&self, call: &Call<'_>) -> Result<Answer, Error> {
        let mut request = self
            .http
            .request(call.method.clone(), call.url.clone())
            .timeout(self.attempt_timeout);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some(key) = call.key {
            request = request.header(IDEMPOTENCY_KEY, key.as_str());
        }
        if let Some(body) = &call.body {
            request = request
                .header(CONTENT_TYPE, "application/json")
                .body(body.clone());
        }
        let response = request.send().await.map_err(transport)?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await.map_err(transport)?;
        Ok(Answer::new(status, &headers, body))
    }
}

fn transport(e: reqwest::Error) -> Error {
    if e.is_builder() {
        Error::Request(e.to_string())
    } else {
        Error::Transport(TransportError(e))
    }
}

fn decode<T: DeserializeOwned>(answer: &Answer) -> Result<T, Error> {
    serde_json::from_slice(&answer.body).map_err(|source| Error::Decode {
        status: answer.status,
        body: answer.body.clone(),
        source,
    })
}

/// What `/readyz` said.
#[derive(Debug, Clone)]
pub enum Readiness {
    Ready,
    /// The database does not answer or is not a primary.
    NotReady(Box<ProblemResponse>),
}

impl Readiness {
    pub fn is_ready(&self) -> bool {
        matches!(self, Readiness::Ready)
    }
}

/// One request as every attempt sends it.
struct Call<'a> {
    operation: &'static str,
    method: Method,
    url: Url,
    key: Option<&'a IdempotencyKey>,
    body: Option<Bytes>,
}

/// A whole HTTP answer.
struct Answer {
    status: u16,
    replayed: bool,
    retry_after: Option<Duration>,
    location: Option<String>,
    content_type: Option<String>,
    body: Bytes,
}

impl Answer {
    fn new(status: u16, headers: &HeaderMap, body: Bytes) -> Self {
        let text = |name| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        Self {
            status,
            replayed: headers
                .get(IDEMPOTENT_REPLAYED)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true")),
            retry_after: text(RETRY_AFTER)
                .and_then(|v| retry::parse_retry_after(&v, SystemTime::now())),
            location: text(LOCATION),
            content_type: text(CONTENT_TYPE),
            body,
        }
    }

    fn into_error(self) -> Error {
        let json = self.content_type.as_deref().is_some_and(|t| {
            let essence = t.split(';').next().unwrap_or_default().trim();
            essence.eq_ignore_ascii_case("application/problem+json")
                || essence.eq_ignore_ascii_case("application/json")
        });
        match serde_json::from_slice::<Problem>(&self.body) {
            Ok(problem) if json => Error::Problem(Box::new(ProblemResponse {
                status: self.status,
                problem,
                replayed: self.replayed,
                retry_after: self.retry_after,
                body: self.body,
            })),
            _ => Error::UnexpectedStatus {
                status: self.status,
                body: self.body,
            },
        }
    }
}

/// One attempt of a call, as the observer and [`TransferOutcome`] see it.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// The route: `POST /transfers`, `GET /accounts/{account_id}`, …
    pub operation: &'static str,
    /// The key sent, for a transfer.
    pub idempotency_key: Option<IdempotencyKey>,
    /// 1 for the first attempt.
    pub number: u32,
    pub max_attempts: u32,
    pub started: Instant,
    /// From sending the request to reading the whole answer, or failing to.
    pub latency: Duration,
    pub result: AttemptResult,
    pub next: NextStep,
}

impl Attempt {
    fn finish(mut self, next: NextStep, observer: Option<&Observer>) -> Self {
        self.next = next;
        if let Some(observer) = observer {
            observer(&self);
        }
        self
    }
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "attempt {}/{} {}",
            self.number, self.max_attempts, self.operation
        )?;
        if let Some(key) = &self.idempotency_key {
            write!(f, " key={key}")?;
        }
        write!(f, ": {}: {}", self.result, self.next)
    }
}

/// What one attempt got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptResult {
    /// An HTTP answer; `problem` is the type of its problem document.
    Answer {
        status: u16,
        replayed: bool,
        problem: Option<ProblemType>,
    },
    /// No whole answer: a timeout or a broken connection.
    NoAnswer { error: String },
}

impl fmt::Display for AttemptResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttemptResult::Answer {
                status,
                replayed,
                problem,
            } => {
                write!(f, "HTTP {status}")?;
                if let Some(problem) = problem {
                    write!(f, " {problem}")?;
                }
                if *replayed {
                    f.write_str(" (replayed)")?;
                }
                Ok(())
            }
            AttemptResult::NoAnswer { error } => f.write_str(error),
        }
    }
}

/// What the client does after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextStep {
    /// The answer is final.
    Done,
    /// Sends the same request again after this wait.
    RetryIn(Duration),
    /// The answer may change, but the policy allows no more attempts.
    GiveUp(GiveUpReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiveUpReason {
    /// `max_attempts` were made.
    AttemptsExhausted,
    /// The next retry could not start before `max_elapsed`.
    TimeExhausted,
}

impl fmt::Display for NextStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NextStep::Done => f.write_str("final"),
            NextStep::RetryIn(delay) => {
                write!(f, "retrying in {} ms", delay.as_millis())
            }
            NextStep::GiveUp(GiveUpReason::AttemptsExhausted) => f.write_str("no attempts left"),
            NextStep::GiveUp(GiveUpReason::TimeExhausted) => {
                f.write_str("no time left for another attempt")
            }
        }
    }
}
