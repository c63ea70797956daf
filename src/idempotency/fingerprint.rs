//! The fingerprint that tells "the same request again" from "another request
//! with a reused key".

use sha2::{Digest, Sha256};

/// SHA-256 over the method, the route template and the canonical bytes of the
/// *parsed, typed* request. Callers produce the canonical bytes by serialising
/// their typed request (fixed field order, integers as integers, no
/// whitespace), so reordered or reformatted JSON hashes the same and any
/// changed value hashes differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    pub fn compute(method: &str, route: &str, canonical_request: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        // Length-prefixed parts: no concatenation of two different
        // (method, route, body) triples can produce the same input.
        for part in [method.as_bytes(), route.as_bytes(), canonical_request] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        Self(hasher.finalize().into())
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_route_and_body_all_count() {
        let base = Fingerprint::compute("POST", "/transfers", b"{}");
        assert_ne!(base, Fingerprint::compute("PUT", "/transfers", b"{}"));
        assert_ne!(base, Fingerprint::compute("POST", "/other", b"{}"));
        assert_ne!(base, Fingerprint::compute("POST", "/transfers", b"{ }"));
        assert_eq!(base, Fingerprint::compute("POST", "/transfers", b"{}"));
    }

    #[test]
    fn parts_cannot_bleed_into_each_other() {
        assert_ne!(
            Fingerprint::compute("POST", "/a", b"b"),
            Fingerprint::compute("POST", "/ab", b"")
        );
    }
}
