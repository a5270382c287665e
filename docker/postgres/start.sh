#!/bin/sh
# Make the database on the first start (an empty volume), then run PostgreSQL in the foreground.
# Logins over the network need the password (scram-sha-256); the socket stays in /tmp.
set -eu
if [ ! -s "$POSTGRES_PASSWORD_FILE" ]; then
  echo "postgres-start: error: POSTGRES_PASSWORD_FILE=$POSTGRES_PASSWORD_FILE: missing or empty" >&2
  exit 2
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  initdb --pgdata="$PGDATA" --username="$POSTGRES_USER" --pwfile="$POSTGRES_PASSWORD_FILE" \
    --auth-local=scram-sha-256 --auth-host=scram-sha-256 --encoding=UTF8 --no-instructions
  printf 'host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n' >> "$PGDATA/pg_hba.conf"
  # Single-user mode: no server listening, no password needed, before anyone can connect.
  echo "CREATE DATABASE \"$POSTGRES_DB\" OWNER \"$POSTGRES_USER\";" \
    | postgres --single -D "$PGDATA" postgres >/dev/null
  echo "postgres-start: made the database $POSTGRES_DB (user $POSTGRES_USER) in $PGDATA"
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/tmp
