//! Per-principal rate limiting: each authenticated caller gets its own
//! token bucket (GCRA, from `governor`), checked right after the bearer
//! token resolves, so a throttled request never claims a key and may be
//! retried later with the same one. Past the limit: 429 problem+json with
//! `Retry-After`.
//!
//! Unauthenticated requests are not counted here (they have no principal);
//! per-address limits belong to the load balancer in front.

use std::num::NonZeroU32;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use uuid::Uuid;

use super::error::ApiError;
use crate::config::RateLimitConfig;

/// One bucket per principal. Buckets are kept for as long as the process
/// runs; their number is bounded by the principals that hold a valid token,
/// which only an operator creates.
pub struct PrincipalRateLimiter {
    limiter: DefaultKeyedRateLimiter<Uuid>,
    clock: DefaultClock,
}

impl std::fmt::Debug for PrincipalRateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrincipalRateLimiter")
            .finish_non_exhaustive()
    }
}

impl PrincipalRateLimiter {
    /// `None` when the configured rate is 0 (limiting off).
    pub fn new(config: RateLimitConfig) -> Option<Self> {
        let per_second = NonZeroU32::new(config.rate_limit_per_second)?;
        let burst = NonZeroU32::new(config.rate_limit_burst).unwrap_or(per_second);
        let clock = DefaultClock::default();
        Some(Self {
            limiter: RateLimiter::keyed(Quota::per_second(per_second).allow_burst(burst)),
            clock,
        })
    }

    /// Takes one request from the principal's bucket, or says how long to
    /// wait, in whole seconds rounded up (at least 1, as `Retry-After` has
    /// no smaller unit).
    pub fn check(&self, principal: Uuid) -> Result<(), ApiError> {
        self.limiter.check_key(&principal).map_err(|not_until| {
            let wait = not_until.wait_time_from(self.clock.now());
            let whole_secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            ApiError::RateLimited {
                retry_after_secs: whole_secs.max(1),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_rate_turns_limiting_off() {
        let off = RateLimitConfig {
            rate_limit_per_second: 0,
            rate_limit_burst: 10,
        };
        assert!(PrincipalRateLimiter::new(off).is_none());
    }

    #[test]
    fn each_principal_has_its_own_bucket() {
        let limiter = PrincipalRateLimiter::new(RateLimitConfig {
            rate_limit_per_second: 1,
            rate_limit_burst: 1,
        });
        let Some(limiter) = limiter else {
            panic!("a positive rate builds a limiter");
        };
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        assert!(limiter.check(a).is_ok());
        assert!(matches!(
            limiter.check(a),
            Err(ApiError::RateLimited {
                retry_after_secs: 1
            })
        ));
        assert!(limiter.check(b).is_ok());
    }
}
