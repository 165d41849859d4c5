#!/usr/bin/env bash
# Start the Redis and PostgreSQL servers the test suite talks to, when they are not running, and install
# the Prometheus binaries (prometheus, promtool) the metrics tests run. Exits non-zero, saying what is
# missing, when it cannot provide any of them: the suite fails on skipped tests, so a missing service
# must fail here first, with a clear message.
set -euo pipefail

redis_up() { (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; }
postgres_up() { (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
fail() { echo "ensure-services: $*" >&2; exit 1; }

apt_updated=no
# Install Debian packages, waiting for another apt/dpkg run to release its lock (up to 5 minutes), and
# refreshing the package lists once when a package is not found in them.
apt_install() {
  command -v apt-get >/dev/null || fail "cannot install $* (no apt-get): install it by hand"
  local log
  log=$(mktemp)
  while true; do
    if as_root apt-get install -y -q -o DPkg::Lock::Timeout=300 --no-install-recommends "$@" >"$log" 2>&1; then
      rm -f "$log"
      return 0
    fi
    if [ "$apt_updated" = no ] && grep -q "Unable to locate package\|has no installation candidate" "$log"; then
      apt_updated=yes
      as_root apt-get update -q >/dev/null || { cat "$log" >&2; fail "apt-get update failed"; }
      continue
    fi
    cat "$log" >&2
    rm -f "$log"
    fail "apt-get could not install $*"
  done
}

if ! redis_up; then
  if ! command -v redis-server >/dev/null && [ ! -x .venv/bin/redis-server ]; then
    apt_install redis-server
  fi
  server=$(command -v redis-server || echo .venv/bin/redis-server)
  echo "starting Redis with $server"
  mkdir -p /tmp/pagedserve-redis
  "$server" --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /tmp/pagedserve-redis --logfile /tmp/pagedserve-redis/redis.log
fi

# The server binaries are needed even when a server already listens: the fault tests run their own cluster.
if ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  apt_install postgresql
fi
if ! postgres_up; then
  command -v pg_ctlcluster >/dev/null || fail "PostgreSQL is installed without pg_ctlcluster: start it on 127.0.0.1:5432"
  version=$(ls /etc/postgresql | sort -n | tail -n 1)
  conf=/etc/postgresql/$version/main/pg_hba.conf
  # tests connect as postgres over TCP without a password, as on the dev machines
  if ! grep -q "pagedserve-trust" "$conf"; then
    as_root sed -i '1i host all all 127.0.0.1/32 trust # pagedserve-trust' "$conf"
  fi
  echo "starting PostgreSQL $version"
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start
fi

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  apt_install prometheus
fi
command -v prometheus >/dev/null && command -v promtool >/dev/null \
  || fail "the prometheus package did not provide prometheus and promtool on PATH"

for _ in $(seq 1 30); do
  redis_up && postgres_up && exit 0
  sleep 1
done
redis_up || fail "Redis is not reachable on 127.0.0.1:6379 (log: /tmp/pagedserve-redis/redis.log)"
fail "PostgreSQL is not reachable on 127.0.0.1:5432"
