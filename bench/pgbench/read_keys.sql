-- Completed idempotency records for the read ceiling (pgr-1 to pgr-N, with
-- a body of a real answer's size). They name no transfer, so they leave the
-- ledger untouched. psql variables: principal, read_keys.
INSERT INTO idempotency_keys (principal_id, idempotency_key, request_method, request_path,
                              fingerprint, status, lock_token, locked_until, response_status,
                              response_headers, response_body, expires_at, retain_until)
SELECT :'principal', 'pgr-' || n, 'POST', '/transfers', sha256(convert_to('pgr-' || n, 'UTF8')),
       'COMPLETED', gen_random_uuid(), now(), 201,
       '[["content-type","application/json"],["location","/transfers/x"]]',
       convert_to(repeat('x', 420), 'UTF8'), now() + interval '24 hours',
       now() + interval '400 days'
FROM generate_series(1, :read_keys) AS n;
ANALYZE idempotency_keys;
