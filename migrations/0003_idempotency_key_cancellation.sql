-- An intent may be cancelled by its key: the record becomes a tombstone
-- (status CANCELLED, no response) that answers every later request with
-- that key `409 intent-cancelled`, whatever its body, until it expires.
-- A tombstone is written for a key never seen too, so an original that
-- arrives after its cancellation can no longer execute. Its fingerprint is
-- 32 zero bytes: no request hashes to it.
ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_status_known;
ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_status_known
    CHECK (status IN ('IN_PROGRESS', 'COMPLETED', 'FAILED', 'CANCELLED'));
