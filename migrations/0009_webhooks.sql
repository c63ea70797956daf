-- Webhooks: endpoints that principals register, to which the delivery
-- worker posts the events of `events` (0008) that the principal may see, in
-- the feed's order, at least once, signed. Why it is built this way:
-- ADR-012.

CREATE TABLE webhook_endpoints (
    id                    uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    principal_id          uuid        NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
    -- http or https, at most 2,048 characters: checked in Rust
    -- (webhooks::EndpointUrl), the length again here.
    url                   text        NOT NULL,
    -- Signing needs the secret itself (an HMAC key), so it is stored, not a
    -- hash of it; the API shows it only when it is created or rotated.
    secret                text        NOT NULL,
    -- The secret before the last rotation, still signing (next to the new
    -- one) until previous_secret_until, so a receiver can switch over.
    previous_secret       text,
    previous_secret_until timestamptz,
    -- The event types delivered; empty means every type.
    event_types           text[]      NOT NULL DEFAULT '{}',
    status                text        NOT NULL DEFAULT 'enabled',
    disabled_reason       text,
    disabled_at           timestamptz,
    -- The last event delivered, or given up on, in the feed's (txid,
    -- position) order: the worker delivers what follows it.
    cursor_txid           xid8        NOT NULL,
    cursor_position       bigint      NOT NULL DEFAULT 0,
    consecutive_failures  integer     NOT NULL DEFAULT 0,
    -- When the event at the head started failing: past the retry window
    -- the endpoint is disabled.
    failing_since         timestamptz,
    -- When the event at the head was written, while one waits: the age of
    -- the oldest undelivered event is read from here, one row per endpoint.
    undelivered_since     timestamptz,
    next_attempt_at       timestamptz NOT NULL DEFAULT now(),
    -- One worker per endpoint at a time: whoever set the token, until
    -- leased_until. Every write of a delivery's outcome is fenced by it.
    lease_token           uuid,
    leased_until          timestamptz,
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT webhook_endpoints_url_unique UNIQUE (principal_id, url),
    CONSTRAINT webhook_endpoints_url_length CHECK (char_length(url) BETWEEN 1 AND 2048),
    CONSTRAINT webhook_endpoints_status_known CHECK (status IN ('enabled', 'disabled')),
    CONSTRAINT webhook_endpoints_disabled_says_why CHECK (
        (status = 'disabled') = (disabled_at IS NOT NULL AND disabled_reason IS NOT NULL)
    ),
    CONSTRAINT webhook_endpoints_event_types_known CHECK (
        event_types <@ ARRAY['transfer.posted', 'transfer.reversed', 'hold.created', 'hold.posted',
                             'hold.voided', 'hold.expired']::text[]
    ),
    CONSTRAINT webhook_endpoints_failures_non_negative CHECK (consecutive_failures >= 0)
);

-- The worker's poll: enabled endpoints due for an attempt.
CREATE INDEX webhook_endpoints_due_idx ON webhook_endpoints (next_attempt_at) WHERE status = 'enabled';

-- Every attempt to deliver one event to one endpoint. Inserting the row is
-- the claim of attempt n: the primary key lets exactly one instance make
-- it.
CREATE TABLE webhook_attempts (
    endpoint_id uuid        NOT NULL REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    event_id    uuid        NOT NULL,
    attempt     integer     NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    -- NULL while in flight (or when the instance died during it).
    outcome     text,
    status_code integer,
    error       text,
    duration_ms bigint,
    PRIMARY KEY (endpoint_id, event_id, attempt),
    CONSTRAINT webhook_attempts_attempt_positive CHECK (attempt >= 1),
    CONSTRAINT webhook_attempts_outcome_known CHECK (
        outcome IN ('delivered', 'http_error', 'timeout', 'connect_error')
    )
);

-- GET /webhook-endpoints/{id}/attempts: newest first.
CREATE INDEX webhook_attempts_recent_idx ON webhook_attempts (endpoint_id, started_at DESC);
-- The purge deletes attempts past the event retention, oldest first.
CREATE INDEX webhook_attempts_started_idx ON webhook_attempts (started_at);

-- Events asked to be delivered again, one by one: the worker sends them
-- before what follows the cursor.
CREATE TABLE webhook_redeliveries (
    endpoint_id  uuid        NOT NULL REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    event_id     uuid        NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (endpoint_id, event_id)
);
