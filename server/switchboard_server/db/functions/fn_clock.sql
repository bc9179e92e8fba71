-- The clock every replica shares: the database's.
--
-- (0001_dispatch_core.sql declares sb_now() with a stand-in body, because
-- table defaults call it; the body is this one.)

-- The database's now, moved by the skew row, which exists only so that tests
-- can move time across lease expiries and window boundaries without
-- sleeping; the server never writes it.
CREATE OR REPLACE FUNCTION sb_now() RETURNS timestamptz
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT now() + (SELECT skew FROM clock_skew) $$;
