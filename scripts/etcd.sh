#!/usr/bin/env bash
# A throwaway etcd on loopback for tests, examples and CI (Debian's etcd-server).
#
#   eval "$(bash scripts/etcd.sh start)"   # prints: export HANDOFF_ETCD=http://127.0.0.1:PORT HANDOFF_ETCD_DIR=...
#   bash scripts/etcd.sh stop [DIR]         # stops it and removes its data dir (default: $HANDOFF_ETCD_DIR)
#
# start picks two free ports, makes a temporary data dir, waits until etcd
# answers /health, and prints the exports on stdout (everything else goes to
# stderr). `start --owner PID` also stops and cleans it once process PID
# exits (the cluster tests start one this way when HANDOFF_ETCD is unset).
# Run as root without HANDOFF_ETCD_NO_INSTALL=1, start installs what is
# missing: etcd-server, and protobuf-compiler, which the etcd-client crate's
# build script needs (its generated gRPC code is not bundled).
set -euo pipefail

say() { echo "etcd.sh: $*" >&2; }

install_missing() {
    local pkgs=()
    command -v etcd >/dev/null 2>&1 || pkgs+=(etcd-server)
    command -v protoc >/dev/null 2>&1 || pkgs+=(protobuf-compiler)
    [ ${#pkgs[@]} -eq 0 ] && return 0
    if [ "${HANDOFF_ETCD_NO_INSTALL:-0}" = 1 ] || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        say "missing ${pkgs[*]}; install them: apt-get install -y ${pkgs[*]}"
        return 0
    fi
    say "installing ${pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "${pkgs[@]}" >&2 ||
        { apt-get update >&2 && apt-get install -y --no-install-recommends "${pkgs[@]}" >&2; }
    # The package's systemd unit may start a system-wide etcd on 2379; ours
    # never uses it.
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

free_port() {
    local p
    for _ in $(seq 1 200); do
        p=$((20000 + RANDOM % 40000))
        port_in_use "$p" || { echo "$p"; return 0; }
    done
    say "no free port found"
    return 1
}

healthy() {
    local reply
    reply=$( (exec 3<>"/dev/tcp/127.0.0.1/$1" && printf 'GET /health HTTP/1.0\r\n\r\n' >&3 && timeout 2 cat <&3) 2>/dev/null || true)
    [[ "$reply" == *'"health":"true"'* ]]
}

stop() {
    local dir="${1:-${HANDOFF_ETCD_DIR:-}}"
    [ -n "$dir" ] && [ -d "$dir" ] || { say "nothing to stop (no data dir given)"; return 0; }
    if [ -f "$dir/pid" ]; then
        local pid
        pid=$(cat "$dir/pid")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -rf "$dir"
}

start() {
    local owner=""
    if [ "${1:-}" = --owner ]; then owner="${2:?--owner needs a PID}"; fi
    install_missing
    command -v etcd >/dev/null 2>&1 || { say "etcd is not installed"; return 1; }
    local dir client peer
    dir=$(mktemp -d "${TMPDIR:-/tmp}/handoff-etcd.XXXXXX")
    client=$(free_port)
    peer=$(free_port)
    while [ "$peer" = "$client" ]; do peer=$(free_port); done
    nohup etcd --name handoff-test --data-dir "$dir/data" \
        --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
        --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
        --initial-cluster "handoff-test=http://127.0.0.1:$peer" \
        --logger zap --log-level error >"$dir/etcd.log" 2>&1 </dev/null &
    echo $! >"$dir/pid"
    for _ in $(seq 1 100); do
        if healthy "$client"; then
            if [ -n "$owner" ]; then
                # Stops etcd once the owner exits; detached from our stdout
                # so a caller reading it sees end of file.
                nohup bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done; bash "$2" stop "$3"' \
                    _ "$owner" "$0" "$dir" >/dev/null 2>&1 </dev/null &
            fi
            echo "export HANDOFF_ETCD=http://127.0.0.1:$client HANDOFF_ETCD_DIR=$dir"
            return 0
        fi
        kill -0 "$(cat "$dir/pid")" 2>/dev/null || break
        sleep 0.1
    done
    say "etcd did not become healthy; its log:"
    cat "$dir/etcd.log" >&2 || true
    stop "$dir"
    return 1
}

case "${1:-}" in
start) shift; start "$@" ;;
stop) shift; stop "$@" ;;
*) say "usage: $0 start [--owner PID] | stop [DIR]"; exit 2 ;;
esac
