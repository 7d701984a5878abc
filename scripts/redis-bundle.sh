#!/usr/bin/env bash
# A redis-server that runs on a machine without one and without a package registry (the GPU machine):
# this machine's binaries with every shared library they load, glibc and its loader included, in one folder.
#
#   scripts/redis-bundle.sh [DIR]      # default DIR: .redis-bundle in the repository root
#   DIR/bin/redis-server [options]     # e.g. --port 0 --unixsocket /tmp/r.sock --save ''
#   DIR/bin/redis-cli [options]
#   PATH=$PWD/DIR/bin:$PATH            # for what looks for redis-server and redis-cli on the PATH (the tests)
#
# DIR/bin holds wrappers that start the binaries (DIR/libexec) through the bundled loader (ld-linux) with
# --library-path DIR/lib, so neither the other machine's libraries nor its glibc version matter, and no
# LD_LIBRARY_PATH is needed (nor passed on to the programs' children). The bundle is about 18 MB; DIR
# belongs in .git/info/exclude. It is checked at the end: the wrappers with an empty environment (env -i),
# and, where this shell may chroot, the server inside a root that holds the bundle alone.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.redis-bundle}
server=$(command -v redis-server) || { echo "redis-server is not installed (scripts/setup.sh)" >&2; exit 1; }
cli=$(command -v redis-cli) || { echo "redis-cli is not installed (scripts/setup.sh)" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/libexec" "$dest/lib"
# redis-server is a link to redis-check-rdb (one binary; argv[0] picks the role): the copy keeps the name
cp "$(readlink -f "$server")" "$dest/libexec/redis-server"
cp "$(readlink -f "$cli")" "$dest/libexec/redis-cli"
for bin in "$dest"/libexec/*; do
  # "name => path (addr)" and the loader's own line "/lib64/ld-linux-x86-64.so.2 (addr)"
  ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | while read -r lib; do
    cp -L "$lib" "$dest/lib/$(basename "$lib")"
  done
done
loader=$(cd "$dest/lib" && ls ld-linux-*.so.* | head -1)
for name in redis-server redis-cli; do
  printf '%s\n' '#!/bin/sh' \
    "# $name of this bundle, with the bundle's libraries only (made by scripts/redis-bundle.sh)" \
    'here=$(cd "$(dirname "$0")/.." && pwd)' \
    "exec \"\$here/lib/$loader\" --library-path \"\$here/lib\" \"\$here/libexec/$name\" \"\$@\"" \
    >"$dest/bin/$name"
  chmod +x "$dest/bin/$name"
done
"$server" --version >"$dest/VERSION"

# the check: an empty environment, a server on a Unix socket, SET and GET through the bundled redis-cli
check=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$check"' EXIT
wait_socket() {
  for _ in $(seq 200); do
    [ -S "$1" ] && return 0
    sleep 0.05
  done
  return 1
}
env -i "$dest/bin/redis-server" --port 0 --unixsocket "$check/r.sock" --save '' --appendonly no \
  --dir "$check" >"$check/log" 2>&1 &
pid=$!
wait_socket "$check/r.sock" && env -i "$dest/bin/redis-cli" -s "$check/r.sock" set bundle ok >/dev/null &&
  [ "$(env -i "$dest/bin/redis-cli" -s "$check/r.sock" get bundle)" = ok ] || {
  echo "the bundle's redis-server did not answer:" >&2; cat "$check/log" >&2; exit 1; }
kill "$pid"
wait "$pid" 2>/dev/null || true
pid=
if chroot / true 2>/dev/null; then  # a root that holds the bundle alone: no library of this machine is there
  mkdir -p "$check/root/tmp"
  cp -r "$dest" "$check/root/b"
  chroot "$check/root" /b/lib/"$loader" --library-path /b/lib /b/libexec/redis-server --port 0 \
    --unixsocket /tmp/r.sock --save '' --appendonly no --dir /tmp >"$check/log" 2>&1 &
  pid=$!
  wait_socket "$check/root/tmp/r.sock" && [ "$(env -i "$dest/bin/redis-cli" -s "$check/root/tmp/r.sock" ping)" = PONG ] || {
    echo "the bundle's redis-server did not run alone in a chroot:" >&2; cat "$check/log" >&2; exit 1; }
  echo "checked: bin/redis-server and bin/redis-cli under env -i, and the server alone in a chroot"
else
  echo "checked: bin/redis-server and bin/redis-cli under env -i (no chroot here)"
fi
echo "$dest: $(cut -d' ' -f1-3 "$dest/VERSION"), $(du -sh "$dest" | cut -f1)"
