#!/usr/bin/env bash
# Redis for the GCS fault-tolerance test (Ray keeps its cluster state there): Debian's
# redis-server package, unpacked under build/redis (no root needed, no service
# started). Prints nothing and does nothing where build/redis is filled already.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=build/redis
[ -x "$dest/usr/bin/redis-server" ] && exit 0
mkdir -p "$dest/debs"
(cd "$dest/debs" && apt-get download redis-server redis-tools liblzf1 libjemalloc2) ||
    { echo "fetch_redis.sh: apt-get download failed (apt lists missing? apt-get update)" >&2; exit 1; }
for deb in "$dest"/debs/*.deb; do dpkg-deb -x "$deb" "$dest"; done
LD_LIBRARY_PATH="$dest/usr/lib/x86_64-linux-gnu" "$dest/usr/bin/redis-server" --version
