-- Every transfer commits with exactly its two entries: one debit of its
-- amount on its source and one credit of it on its destination. The ledger
-- code writes both in the statement that inserts the transfer; this makes
-- the database refuse, at commit, any transaction that would leave a
-- transfer without them, whatever code path (a batch that failed halfway
-- and was committed by mistake, an operator's hand-written SQL) tried it.
-- Deferred, so a transaction may write the entries after the transfer row.
-- Entries added to a transfer later are the reconciliation's to find.
CREATE FUNCTION transfers_check_double_entry() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    entries bigint;
    debits  bigint;
    credits bigint;
BEGIN
    SELECT count(*),
           count(*) FILTER (WHERE account_id = NEW.from_account AND amount_minor = -NEW.amount_minor),
           count(*) FILTER (WHERE account_id = NEW.to_account AND amount_minor = NEW.amount_minor)
      INTO entries, debits, credits
      FROM ledger_entries
     WHERE transfer_id = NEW.id;
    IF entries <> 2 OR debits <> 1 OR credits <> 1 THEN
        RAISE EXCEPTION 'transfer % must commit with one debit of % on % and one credit of it on %',
                        NEW.id, NEW.amount_minor, NEW.from_account, NEW.to_account
            USING ERRCODE = 'integrity_constraint_violation',
                  DETAIL = format('found %s entries: %s debits and %s credits that match', entries, debits, credits);
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER transfers_double_entry
    AFTER INSERT ON transfers
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION transfers_check_double_entry();
