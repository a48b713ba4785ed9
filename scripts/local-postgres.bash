# Sourced by the bench scripts: start_postgres DIR [PREFIX...] starts a
# private PostgreSQL 15 cluster in DIR (initdb, then postgres on a free
# loopback port, with `pg_stat_statements` loaded and durability off: the
# figures are CPU, not the disk), run through PREFIX (e.g. taskset). As
# root, both run as the `postgres` user, which PostgreSQL requires. Sets
# pg_dsn (postgres://postgres@127.0.0.1:PORT/postgres), pg_pid (the
# postmaster, whose children serve the connections) and pg_log; the caller
# stops it (kill "$pg_pid"). PG_BIN overrides Debian's place for its programs.

start_postgres() {
    local dir=$1
    shift
    local bin=${PG_BIN:-/usr/lib/postgresql/15/bin} as=()
    [ -x "$bin/initdb" ] || {
        echo "no $bin/initdb: apt-get install postgresql-15 (or set PG_BIN)" >&2
        exit 1
    }
    mkdir -p "$dir"
    if [ "$(id -u)" = 0 ]; then
        as=(runuser -u postgres --)
        # postgres must reach DIR through its (private) parent.
        chmod o+x "$(dirname "$dir")"
        chown postgres:postgres "$dir"
    fi
    "${as[@]}" "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-sync \
        >"$dir/initdb.log" 2>&1 || {
        cat "$dir/initdb.log" >&2
        exit 1
    }
    local port
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    pg_log=$dir/log
    "$@" "${as[@]}" "$bin/postgres" -D "$dir/data" -p "$port" -k "$dir" \
        -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off \
        -c full_page_writes=off -c max_connections=300 \
        -c shared_preload_libraries=pg_stat_statements >"$pg_log" 2>&1 &
    pg_dsn="postgres://postgres@127.0.0.1:$port/postgres"
    for _ in $(seq 1 600); do
        if "$bin/pg_isready" -q -d "$pg_dsn"; then
            pg_pid=$(head -n 1 "$dir/data/postmaster.pid")
            "$bin/psql" -X -q -d "$pg_dsn" -c 'CREATE EXTENSION IF NOT EXISTS pg_stat_statements'
            return 0
        fi
        sleep 0.1
    done
    echo "postgres did not start within 60 s: $(tail -n 5 "$pg_log")" >&2
    exit 1
}
