//! Bearer tokens: how they are made, stored (only as SHA-256) and looked up.

use std::time::Duration;

use rand::RngCore;
use sha2::{Digest, Sha256};
use sqlx::PgExecutor;

use crate::principal::PrincipalId;

/// Longest token accepted in a header; anything longer is rejected before
/// hashing. Generated tokens are 68 characters.
pub const TOKEN_LEN_MAX: usize = 256;

/// Prefix of generated tokens, so a leaked one is recognisable in a scan.
pub const TOKEN_PREFIX: &str = "ntk_";

/// Extracts the token from an `Authorization` header value.
pub fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer")
        && !token.is_empty()
        && token.len() <= TOKEN_LEN_MAX
        && token.bytes().all(|b| b.is_ascii_graphic()))
    .then_some(token)
}

pub fn token_sha256(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// A new random token: 32 bytes from the OS generator, hex-encoded.
pub fn generate_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("{TOKEN_PREFIX}{}", hex::encode(bytes))
}

/// How stale a token's `last_used_at` may be: it is written at most this
/// often per token and instance, so authentication stays a read.
pub const LAST_USED_RESOLUTION: Duration = Duration::from_secs(60);

/// Finds the principal a live (not revoked) token belongs to: a plain
/// read, so authentication works wherever reads do (a server turned
/// read-only, a standby in a failover's window) and never waits on a row
/// lock. The lookup is by the token's SHA-256, through a unique index: the
/// comparison happens on a digest the caller cannot steer byte by byte, so
/// its timing tells nothing about stored tokens.
pub async fn principal_for_token<'e>(
    executor: impl PgExecutor<'e>,
    token: &str,
) -> Result<Option<PrincipalId>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT principal_id FROM principal_tokens WHERE token_sha256 = $1 AND revoked_at IS NULL",
    )
    .bind(token_sha256(token).as_slice())
    .fetch_optional(executor)
    .await
}

/// Notes that a token was used, when the last note is older than
/// [`LAST_USED_RESOLUTION`]: a hint for operators, written off the request
/// path (the caller spawns it, on the key pool, which does not wait for a
/// standby). A row locked by another note or by a revocation is skipped,
/// and a revoked token is never noted.
pub async fn note_token_use<'e>(
    executor: impl PgExecutor<'e>,
    token: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE principal_tokens SET last_used_at = now()
         WHERE id = (SELECT id FROM principal_tokens
                     WHERE token_sha256 = $1 AND revoked_at IS NULL
                       AND (last_used_at IS NULL
                            OR last_used_at < now() - make_interval(secs => $2))
                     FOR UPDATE SKIP LOCKED)
           AND revoked_at IS NULL",
    )
    .bind(token_sha256(token).as_slice())
    .bind(LAST_USED_RESOLUTION.as_secs_f64())
    .execute(executor)
    .await
    .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_scheme_is_case_insensitive_and_token_required() {
        assert_eq!(bearer_token("Bearer tok_test_A"), Some("tok_test_A"));
        assert_eq!(bearer_token("bearer tok_test_A"), Some("tok_test_A"));
        assert_eq!(bearer_token("Basic dXNlcjpwYXNz"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("Bearer"), None);
        assert_eq!(bearer_token("Bearer a b"), None);
    }

    #[test]
    fn generated_tokens_are_distinct_and_prefixed() {
        let (a, b) = (generate_token(), generate_token());
        assert_ne!(a, b);
        assert!(a.starts_with(TOKEN_PREFIX));
        assert_eq!(a.len(), TOKEN_PREFIX.len() + 64);
    }
}
