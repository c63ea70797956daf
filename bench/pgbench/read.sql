-- A replay's read, for pgbench: the primary-key lookup of a completed key.
-- Variables (-D): principal, and read_keys (how many pgr-<n> keys exist).
\set n random(1, :read_keys)
SELECT fingerprint, status, locked_until, response_status, response_headers, response_body
FROM idempotency_keys
WHERE principal_id = :principal::uuid AND idempotency_key = 'pgr-' || :n;
