//! When an answer may change if the same request is sent again, and how
//! long to wait before sending it.

use std::time::{Duration, SystemTime};

use rand::Rng;

use crate::problem::ProblemType;

/// How often and for how long a call is retried.
///
/// A call makes at most `max_attempts` attempts. Before retry `n` (1 for
/// the first retry) it waits a uniformly random time between zero and
/// `min(initial_backoff × 2^(n-1), max_backoff)` (full jitter, so clients
/// that failed together do not retry together), and never less than the
/// server's `Retry-After`. A retry whose wait would end later than
/// `max_elapsed` after the first attempt started is not made: the call
/// gives up instead of retrying sooner than the server asked. Every attempt
/// is bounded by the client's attempt timeout, so a call ends within
/// `max_elapsed` plus one attempt timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included; 1 never retries.
    pub max_attempts: u32,
    /// No retry starts later than this after the first attempt started.
    pub max_elapsed: Duration,
    /// The backoff ceiling before the first retry; it doubles per retry.
    pub initial_backoff: Duration,
    /// The backoff ceiling never grows past this.
    pub max_backoff: Duration,
}

impl RetryPolicy {
    /// Six attempts: enough to ride out a lost answer, a restart of the
    /// server or a few seconds of an overloaded database.
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 6;
    /// Long enough for the server's 30 s lease on a key whose first request
    /// died to run out, so the last retries can take the key over.
    pub const DEFAULT_MAX_ELAPSED: Duration = Duration::from_secs(40);
    pub const DEFAULT_INITIAL_BACKOFF: Duration = Duration::from_millis(100);
    pub const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(5);

    /// One attempt and no retry: for callers that measure each request
    /// (a load generator) or retry on their own terms.
    pub const fn single_attempt() -> Self {
        Self {
            max_attempts: 1,
            max_elapsed: Duration::ZERO,
            initial_backoff: Duration::ZERO,
            max_backoff: Duration::ZERO,
        }
    }

    /// The most retry `retry` (1-based) waits before `Retry-After` is
    /// considered.
    pub fn backoff_ceiling(&self, retry: u32) -> Duration {
        let doublings = retry.saturating_sub(1).min(31);
        self.initial_backoff
            .saturating_mul(1u32 << doublings)
            .min(self.max_backoff)
    }

    /// The wait before retry `retry` (1-based): full jitter under the
    /// capped exponential ceiling, but at least `retry_after`.
    pub fn delay(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        self.delay_with(&mut rand::rng(), retry, retry_after)
    }

    /// [`RetryPolicy::delay`] with the random source given.
    pub fn delay_with(
        &self,
        rng: &mut impl Rng,
        retry: u32,
        retry_after: Option<Duration>,
    ) -> Duration {
        let ceiling = self.backoff_ceiling(retry);
        let ceiling_ns = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        let jittered = Duration::from_nanos(rng.random_range(0..=ceiling_ns));
        jittered.max(retry_after.unwrap_or(Duration::ZERO))
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: Self::DEFAULT_MAX_ATTEMPTS,
            max_elapsed: Self::DEFAULT_MAX_ELAPSED,
            initial_backoff: Self::DEFAULT_INITIAL_BACKOFF,
            max_backoff: Self::DEFAULT_MAX_BACKOFF,
        }
    }
}

/// Whether an answer may change if the same request (same key, same body)
/// is sent again: 409 while a request holds the key, 429 and every 5xx.
/// Any other answer is final, among them every other 4xx: a refusal of the
/// request itself is the same on every attempt, and so is a 409 that says
/// the intent was cancelled or has completed.
pub fn is_retryable(status: u16, problem: Option<&ProblemType>) -> bool {
    match status {
        409 => !matches!(
            problem,
            Some(ProblemType::IntentCancelled | ProblemType::IntentCompleted)
        ),
        429 => true,
        500..=599 => true,
        _ => false,
    }
}

/// A `Retry-After` value, as delta-seconds or an HTTP date; a date in the
/// past is no wait at all.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn the_ceiling_doubles_from_the_initial_backoff_up_to_the_cap() {
        let policy = RetryPolicy::default();
        let ceilings: Vec<u128> = (1..=8)
            .map(|retry| policy.backoff_ceiling(retry).as_millis())
            .collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        assert_eq!(policy.backoff_ceiling(u32::MAX), policy.max_backoff);
        assert_eq!(policy.backoff_ceiling(0), policy.initial_backoff);
    }

    #[test]
    fn delays_are_jittered_within_the_ceiling() {
        let policy = RetryPolicy::default();
        let mut rng = StdRng::seed_from_u64(7);
        for retry in 1..=12 {
            let ceiling = policy.backoff_ceiling(retry);
            let delays: Vec<Duration> = (0..500)
                .map(|_| policy.delay_with(&mut rng, retry, None))
                .collect();
            assert!(delays.iter().all(|d| *d <= ceiling), "retry {retry}");
            let (low, high) = delays.iter().fold((0, 0), |(low, high), d| {
                if *d < ceiling / 4 {
                    (low + 1, high)
                } else if *d > ceiling * 3 / 4 {
                    (low, high + 1)
                } else {
                    (low, high)
                }
            });
            assert!(
                low > 50 && high > 50,
                "retry {retry}: full jitter spreads from zero to the ceiling ({low} low, {high} high)"
            );
        }
    }

    #[test]
    fn a_delay_is_never_shorter_than_retry_after() {
        let policy = RetryPolicy::default();
        let mut rng = StdRng::seed_from_u64(11);
        for retry in 1..=12 {
            for after in [1, 3, 60, 24 * 3600] {
                let after = Duration::from_secs(after);
                assert!(
                    (0..100).all(|_| policy.delay_with(&mut rng, retry, Some(after)) >= after),
                    "retry {retry}: sooner than Retry-After {after:?}"
                );
            }
        }
        let zero_wait = RetryPolicy {
            initial_backoff: Duration::ZERO,
            ..policy
        };
        assert_eq!(
            zero_wait.delay(1, Some(Duration::from_secs(2))),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn only_answers_that_may_change_are_retried() {
        for status in [409, 429, 500, 502, 503, 504] {
            assert!(is_retryable(status, None), "{status}");
        }
        assert!(is_retryable(409, Some(&ProblemType::RequestInFlight)));
        assert!(is_retryable(503, Some(&ProblemType::ServiceUnavailable)));
        for status in [200, 201, 400, 401, 403, 404, 405, 413, 415, 422] {
            assert!(!is_retryable(status, None), "{status}");
        }
        for final_409 in [ProblemType::IntentCancelled, ProblemType::IntentCompleted] {
            assert!(!is_retryable(409, Some(&final_409)), "{final_409}");
        }
        for final_422 in [
            ProblemType::InsufficientFunds,
            ProblemType::IdempotencyKeyReused,
            ProblemType::InvalidAmount,
        ] {
            assert!(!is_retryable(422, Some(&final_422)), "{final_422}");
        }
    }

    #[test]
    fn retry_after_is_read_as_seconds_or_a_date() {
        let now = SystemTime::now();
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        let later = now + Duration::from_secs(120);
        let wait = parse_retry_after(&httpdate::fmt_http_date(later), now).unwrap();
        assert!(wait > Duration::from_secs(118) && wait <= Duration::from_secs(120));
        let earlier = now - Duration::from_secs(120);
        assert_eq!(
            parse_retry_after(&httpdate::fmt_http_date(earlier), now),
            Some(Duration::ZERO)
        );
        for junk in ["soon", "-1", "1.5", ""] {
            assert_eq!(parse_retry_after(junk, now), None, "{junk:?}");
        }
    }

    #[test]
    fn a_single_attempt_policy_never_retries() {
        assert_eq!(RetryPolicy::single_attempt().max_attempts, 1);
    }
}
