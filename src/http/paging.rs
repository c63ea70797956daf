//! Keyset pages: the `limit` every listing takes, and its bounds.

use super::error::ApiError;

/// Items per page when the client does not ask.
pub const PAGE_SIZE_DEFAULT: i64 = 50;
/// The most items one page may hold: bounds the query and the response.
pub const PAGE_SIZE_MAX: i64 = 200;

/// The page size a `limit` query parameter asks for.
pub fn limit(raw: Option<&str>) -> Result<i64, ApiError> {
    match raw {
        None => Ok(PAGE_SIZE_DEFAULT),
        Some(raw) => raw
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=PAGE_SIZE_MAX).contains(n))
            .ok_or_else(|| {
                ApiError::invalid_query(
                    "limit",
                    format!("limit must be an integer from 1 to {PAGE_SIZE_MAX}"),
                )
            }),
    }
}

/// Splits one extra row off a page fetched with `limit + 1`: whether
/// another page exists, known without a count.
pub fn has_more<T>(rows: &mut Vec<T>, limit: i64) -> bool {
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    let more = rows.len() > limit;
    rows.truncate(limit);
    more
}
