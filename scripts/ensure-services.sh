#!/usr/bin/env bash
# Start the Redis and PostgreSQL servers the test suite talks to, when they are not running, and install
# the Prometheus binary the metrics test runs its own server from.
set -euo pipefail

redis_up() { (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; }
postgres_up() { (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if ! redis_up; then
  if ! command -v redis-server >/dev/null && command -v apt-get >/dev/null; then
    as_root apt-get install -y -q redis-server >/dev/null || true
  fi
  server=$(command -v redis-server || echo .venv/bin/redis-server)
  echo "starting Redis with $server"
  mkdir -p /tmp/pagedserve-redis
  "$server" --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /tmp/pagedserve-redis --logfile /tmp/pagedserve-redis/redis.log
fi

if ! postgres_up; then
  if ! command -v pg_ctlcluster >/dev/null && command -v apt-get >/dev/null; then
    as_root apt-get install -y -q postgresql >/dev/null || true
  fi
  if command -v pg_ctlcluster >/dev/null; then
    version=$(ls /etc/postgresql | sort -n | tail -n 1)
    conf=/etc/postgresql/$version/main/pg_hba.conf
    # tests connect as postgres over TCP without a password, as on the dev machines
    if ! grep -q "pagedserve-trust" "$conf"; then
      as_root sed -i '1i host all all 127.0.0.1/32 trust # pagedserve-trust' "$conf"
    fi
    echo "starting PostgreSQL $version"
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start
  fi
fi

if ! command -v prometheus >/dev/null && command -v apt-get >/dev/null; then
  as_root apt-get install -y -q --no-install-recommends prometheus >/dev/null || true
fi

for _ in $(seq 1 30); do
  redis_up && postgres_up && exit 0
  sleep 1
done
redis_up || { echo "Redis is not reachable on 127.0.0.1:6379" >&2; exit 1; }
echo "PostgreSQL is not reachable on 127.0.0.1:5432; its tests will be skipped" >&2
