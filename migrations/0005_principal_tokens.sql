-- A principal may hold several bearer tokens, so a token is rotated with no
-- downtime (create a new one, deploy it, revoke the old one) and a leaked
-- one is revoked without touching the others. Only each token's SHA-256 is
-- stored. A revoked token is kept (who held it, when it was last used) but
-- never authenticates again.
CREATE TABLE principal_tokens (
    id           uuid        PRIMARY KEY,
    principal_id uuid        NOT NULL REFERENCES principals (id),
    label        text        NOT NULL,
    token_sha256 bytea       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- Refreshed at most once a minute per instance: a hint for finding
    -- unused tokens, not an audit log.
    last_used_at timestamptz,
    revoked_at   timestamptz,
    CONSTRAINT principal_tokens_token_sha256_unique UNIQUE (token_sha256),
    CONSTRAINT principal_tokens_token_sha256_length CHECK (octet_length(token_sha256) = 32),
    CONSTRAINT principal_tokens_label_format CHECK (
        char_length(label) BETWEEN 1 AND 64 AND label ~ '^[\x21-\x7E]+$'
    )
);

-- Among a principal's live tokens a label names one; a revoked token's
-- label may be used again.
CREATE UNIQUE INDEX principal_tokens_live_label_unique
    ON principal_tokens (principal_id, label) WHERE revoked_at IS NULL;

INSERT INTO principal_tokens (id, principal_id, label, token_sha256, created_at)
SELECT gen_random_uuid(), id, 'initial', token_sha256, created_at FROM principals;

-- The tokens live in principal_tokens now. The old column stays, nullable
-- and no longer written, so an instance of the previous version still
-- authenticates its callers during a rolling upgrade; a later migration
-- drops it.
ALTER TABLE principals ALTER COLUMN token_sha256 DROP NOT NULL;
