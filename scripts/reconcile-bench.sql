-- A synthetic, consistent ledger for timing `nexo-transfers reconcile`,
-- built with set-based statements only. Run on a throwaway, migrated
-- database: psql -v transfers=1000000 -f scripts/reconcile-bench.sql
--
-- Shape: 1,000 principals with a USD and an EUR account each, one opening
-- deposit per account from its currency's funding account (31 days ago),
-- :transfers customer transfers spread over the last 30 days, two entries
-- per transfer with running balances, and a COMPLETED idempotency record
-- for each customer transfer younger than the 24h key TTL (about 1/30 of
-- them), as a server with NEXO_IDEMPOTENCY_TTL=24h would hold, and one
-- event per transfer.
\set ON_ERROR_STOP on
SELECT setseed(0.4242) AS seeded \gset
-- Foreign-key triggers off for the bulk load (the database is throwaway):
-- checked row by row they would take most of the build time. CHECK and
-- UNIQUE constraints still apply, and the reconciliation checks the rest.
SET session_replication_role = replica;

-- The server gives transfers UUIDv7 ids (time-ordered) and inserts them in
-- time order, so the primary key, the heap and the entries' index all
-- follow time. PostgreSQL 15 has no uuidv7(): 48 bits of Unix milliseconds,
-- the version, the variant and random bits, as RFC 9562 lays them out.
CREATE FUNCTION pg_temp.uuid7(at timestamptz) RETURNS uuid LANGUAGE sql VOLATILE AS $$
    SELECT (lpad(to_hex(floor(extract(epoch FROM at) * 1000)::bigint), 12, '0')
            || '7' || substr(md5(random()::text), 1, 3)
            || '8' || substr(md5(random()::text), 1, 15))::uuid
$$;

INSERT INTO principals (id, name, token_sha256)
SELECT gen_random_uuid(), 'bench_' || n, sha256(convert_to('bench_token_' || n, 'UTF8'))
FROM generate_series(0, 999) n;

INSERT INTO accounts (id, principal_id, currency)
SELECT 'acc_b' || lower(c.code) || substr(p.name, 7), p.id, c.code
FROM principals p CROSS JOIN (VALUES ('USD'), ('EUR')) c (code)
WHERE p.name LIKE 'bench\_%';

CREATE TEMP TABLE bench_accounts AS
SELECT (row_number() OVER (PARTITION BY currency ORDER BY id) - 1)::int AS n, id, principal_id, currency
FROM accounts WHERE id LIKE 'acc\_b%';
CREATE UNIQUE INDEX ON bench_accounts (currency, n);

-- Transfers and their entries in one transaction: the database checks at
-- commit that every transfer has its debit and its credit.
BEGIN;

-- Opening deposits: far more than any account sends in the run, so no
-- customer balance ever goes below zero.
INSERT INTO transfers (id, principal_id, idempotency_key, request_fingerprint, from_account,
                       to_account, currency, amount_minor, receipt_id, created_at)
SELECT pg_temp.uuid7(now() - interval '31 days'), NULL, 'dep_' || a.id, sha256(convert_to('dep_' || a.id, 'UTF8')),
       'sys_funding_' || lower(a.currency), a.id, a.currency, 1000000000000,
       'rcpt_dep_' || a.id, now() - interval '31 days'
FROM bench_accounts a;

-- Customer transfers between two different accounts of one currency (the
-- destination index is the source's plus 1 to 999, modulo 1,000), in time
-- order.
INSERT INTO transfers (id, principal_id, idempotency_key, request_fingerprint, from_account,
                       to_account, currency, amount_minor, receipt_id, created_at)
SELECT pg_temp.uuid7(created_at), principal_id, 'bench-' || g, sha256(convert_to('bench-' || g, 'UTF8')),
       from_account, to_account, currency, 1 + floor(random() * 100000)::bigint,
       'rcpt_bench_' || g, created_at
FROM (SELECT g, f.principal_id, f.id AS from_account, t.id AS to_account, f.currency,
             now() - random() * interval '30 days' AS created_at
      FROM generate_series(1::bigint, :transfers) g
      JOIN bench_accounts f ON f.currency = CASE g % 2 WHEN 0 THEN 'USD' ELSE 'EUR' END
                           AND f.n = (g * 7919) % 1000
      JOIN bench_accounts t ON t.currency = f.currency
                           AND t.n = (f.n + 1 + g % 999) % 1000) planned
ORDER BY created_at;

-- One debit and one credit per transfer, in time order, each with the
-- balance it left behind.
INSERT INTO ledger_entries (transfer_id, account_id, currency, amount_minor, balance_after_minor, created_at)
SELECT transfer_id, account_id, currency, amount_minor,
       sum(amount_minor) OVER (PARTITION BY account_id ORDER BY created_at, transfer_id, side),
       created_at
FROM (SELECT id AS transfer_id, from_account AS account_id, currency, -amount_minor AS amount_minor,
             created_at, 0 AS side FROM transfers
      UNION ALL
      SELECT id, to_account, currency, amount_minor, created_at, 1 FROM transfers) e
ORDER BY created_at, transfer_id, side;

COMMIT;

-- The outbox the server writes with every transfer: one transfer.posted
-- event each, in time order, numbered on each account in the order of its
-- entries. The resource is a stand-in: the reconciliation reads none.
WITH numbered AS (
    SELECT transfer_id, amount_minor < 0 AS debit,
           row_number() OVER (PARTITION BY account_id ORDER BY id) AS seq
    FROM ledger_entries
)
INSERT INTO events (type, resource_id, resource, occurred_at, from_account, to_account,
                    from_principal, to_principal, from_seq, to_seq)
SELECT 'transfer.posted', t.id, jsonb_build_object('transfer_id', t.id), t.created_at,
       t.from_account, t.to_account, fa.principal_id, ta.principal_id, d.seq, c.seq
FROM transfers t
JOIN numbered d ON d.transfer_id = t.id AND d.debit
JOIN numbered c ON c.transfer_id = t.id AND NOT c.debit
JOIN accounts fa ON fa.id = t.from_account
JOIN accounts ta ON ta.id = t.to_account
ORDER BY t.created_at, t.id;

UPDATE accounts a SET balance_minor = s.total, event_seq = s.entries
FROM (SELECT account_id, sum(amount_minor) AS total, count(*) AS entries
      FROM ledger_entries GROUP BY account_id) s
WHERE a.id = s.account_id;

INSERT INTO idempotency_keys (principal_id, idempotency_key, request_method, request_path, fingerprint,
                              status, lock_token, locked_until, response_status, response_headers,
                              response_body, transfer_id, created_at, updated_at, expires_at,
                              retain_until)
SELECT principal_id, idempotency_key, 'POST', '/transfers', request_fingerprint, 'COMPLETED',
       gen_random_uuid(), created_at + interval '30 seconds', 201,
       '[["content-type","application/json"],["location","/transfers"]]'::jsonb,
       convert_to(json_build_object('transfer_id', id, 'from', from_account, 'to', to_account,
                                    'amount_minor', amount_minor, 'currency', currency)::text, 'UTF8'),
       id, created_at, created_at, created_at + interval '24 hours', created_at + interval '400 days'
FROM transfers
WHERE principal_id IS NOT NULL AND created_at > now() - interval '24 hours';

VACUUM ANALYZE;

SELECT (SELECT count(*) FROM transfers) AS transfers,
       (SELECT count(*) FROM ledger_entries) AS entries,
       (SELECT count(*) FROM events) AS events,
       (SELECT count(*) FROM idempotency_keys) AS key_records,
       pg_size_pretty(pg_database_size(current_database())) AS database_size;
