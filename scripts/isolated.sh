#!/usr/bin/env bash
# Runs a command inside a private network namespace whose only interface is loopback (up). The
# test suite runs in it: Mooncake 0.3.13 listens on all interfaces whatever it is told (its
# transfer-engine ports, its RPC port, the master's HTTP metadata server), so no test may open a
# port on this machine's real interfaces. Needs root, or unprivileged user namespaces.
set -euo pipefail
if [ "${LAYERKV_IN_NETNS:-}" = 1 ]; then exec "$@"; fi
flags=(--net)
[ "$(id -u)" = 0 ] || flags+=(--map-root-user)
if ! unshare "${flags[@]}" true 2>/dev/null; then
  echo "scripts/isolated.sh: cannot create a network namespace (unshare ${flags[*]}): run as root," \
       "or enable unprivileged user namespaces" >&2
  exit 1
fi
exec unshare "${flags[@]}" -- env LAYERKV_IN_NETNS=1 bash -c 'ip link set lo up && exec "$@"' isolated "$@"
