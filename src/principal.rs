//! Who is asking: the authenticated principal's id, the scope of its
//! idempotency keys and the owner of its accounts.

use uuid::Uuid;

/// A principal's id. Built only from the `principals` table (a token
/// lookup, an operator command), so holding one means the principal exists.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, sqlx::Type, serde::Serialize,
)]
#[sqlx(transparent)]
#[serde(transparent)]
pub struct PrincipalId(pub Uuid);

impl PrincipalId {
    pub fn as_uuid(self) -> Uuid {
        self.0
    }
}

impl std::fmt::Display for PrincipalId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}
