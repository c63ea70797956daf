-- Long memory at low cost. A key's record keeps its full answer until
-- expires_at (NEXO_IDEMPOTENCY_TTL). Past it, the purge compacts the record:
-- the response bytes go, the outcome stays (the answer's status, its problem
-- type, its transfer) until retain_until (NEXO_IDEMPOTENCY_RETENTION). Within
-- that horizon no key executes twice: a success, a business rejection and a
-- cancellation are all answered as they were, from the compact record. Only
-- past retain_until is the row deleted; a late retry of a transfer is still
-- answered from `transfers`' permanent unique key.
ALTER TABLE idempotency_keys
    ADD COLUMN retain_until timestamptz,
    ADD COLUMN compacted_at timestamptz,
    ADD COLUMN problem_type text,
    -- The x-request-id of the request whose refusal the record holds (a
    -- business rejection, or the cancellation of a tombstone): a refusal's
    -- problem document names it, so every answer from the record, rebuilt
    -- past compaction too, is the same bytes. NULL for a success: a 201
    -- does not carry it.
    ADD COLUMN request_id text;

-- Records written before this migration are kept for the default retention
-- counted from their creation, as if they had been written under it.
UPDATE idempotency_keys
SET retain_until = GREATEST(expires_at, created_at + interval '400 days');

-- A stored refusal names its problem type, so its compact record can
-- rebuild it.
UPDATE idempotency_keys
SET problem_type = substring(convert_from(response_body, 'UTF8')::jsonb ->> 'type' FROM '[a-z0-9-]+$')
WHERE status = 'COMPLETED' AND response_status >= 400;

ALTER TABLE idempotency_keys ALTER COLUMN retain_until SET NOT NULL;

-- An instance of the previous version, still running during a rolling
-- upgrade, claims and cancels without retain_until: its rows get the
-- default retention, as if written under it. The WHEN keeps the function
-- off the path of this version's inserts, which always set the column.
CREATE FUNCTION idempotency_keys_default_retention() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.retain_until := GREATEST(NEW.expires_at, NEW.created_at + interval '400 days');
    RETURN NEW;
END
$$;

CREATE TRIGGER idempotency_keys_default_retention
    BEFORE INSERT ON idempotency_keys
    FOR EACH ROW WHEN (NEW.retain_until IS NULL)
    EXECUTE FUNCTION idempotency_keys_default_retention();

ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_completed_has_response;
ALTER TABLE idempotency_keys
    ADD CONSTRAINT idempotency_keys_completed_has_outcome
        CHECK ((status = 'COMPLETED') = (response_status IS NOT NULL)),
    -- The bytes are kept exactly until the record is compacted.
    ADD CONSTRAINT idempotency_keys_full_answer_until_compacted
        CHECK ((status = 'COMPLETED' AND compacted_at IS NULL)
               = (response_body IS NOT NULL AND response_headers IS NOT NULL)),
    -- Only an outcome is worth remembering: a failed or abandoned claim
    -- promised nothing, and the purge deletes it instead.
    ADD CONSTRAINT idempotency_keys_only_outcomes_compacted
        CHECK (compacted_at IS NULL OR status IN ('COMPLETED', 'CANCELLED')),
    -- What a compact record needs to rebuild its answer.
    ADD CONSTRAINT idempotency_keys_compact_success_has_transfer
        CHECK (compacted_at IS NULL OR status <> 'COMPLETED' OR response_status >= 400
               OR transfer_id IS NOT NULL),
    ADD CONSTRAINT idempotency_keys_compact_refusal_has_problem_type
        CHECK (compacted_at IS NULL OR status <> 'COMPLETED' OR response_status < 400
               OR problem_type IS NOT NULL),
    ADD CONSTRAINT idempotency_keys_problem_type_format
        CHECK (problem_type ~ '^[a-z0-9-]{1,64}$'),
    ADD CONSTRAINT idempotency_keys_request_id_length
        CHECK (char_length(request_id) BETWEEN 1 AND 128),
    ADD CONSTRAINT idempotency_keys_retained_past_expiry
        CHECK (retain_until >= expires_at);

-- Whether a record no longer binds its key: past its retention, or past
-- its TTL without an outcome (a failed or abandoned claim). The claim, the
-- takeover, the cancellation, the lookup and the purge all decide with this
-- one definition. A plain SQL function: the planner inlines it.
CREATE FUNCTION idempotency_key_forgotten(
    status text, locked_until timestamptz, expires_at timestamptz, retain_until timestamptz
) RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT retain_until <= now()
        OR (expires_at <= now()
            AND (status = 'FAILED' OR (status = 'IN_PROGRESS' AND locked_until <= now())))
$$;

-- Two purge passes, each with its own partial index, so neither scans rows
-- the other already handled: records to compact (or delete) once their TTL
-- passes, and compact records to delete once their retention passes. A
-- claim writes only the first.
DROP INDEX idempotency_keys_expires_at_idx;
CREATE INDEX idempotency_keys_to_compact_idx ON idempotency_keys (expires_at)
    WHERE compacted_at IS NULL;
CREATE INDEX idempotency_keys_to_delete_idx ON idempotency_keys (retain_until)
    WHERE compacted_at IS NOT NULL;
