#!/usr/bin/env bash
# netsim.sh - several "nodes" on one machine, to rehearse a multi-node launch:
# one Linux network namespace per node, each joined to one bridge by a veth
# pair and shaped with `tc tbf` to a link speed, in both directions.
#
# Usage (as root; needs iproute2's `ip` and `tc`, util-linux's `unshare`):
#   tools/netsim.sh up N RATE_MBIT   # N nodes, each link RATE_MBIT Mbit/s (0: unshaped);
#                                    # prints "NAMESPACE ADDRESS INTERFACE" per node
#   tools/netsim.sh run I CMD...     # CMD in node I (0-based), host name NAMESPACE
#   tools/netsim.sh down             # remove all that up made, and end what runs in
#                                    # its nodes; idempotent, also after a failed up
#   tools/netsim.sh check            # exit 0 iff this machine can do it, else say why
#
# Node I is namespace ${NETSIM_PREFIX}nI with address ${NETSIM_SUBNET}.(I+1)/24
# on its interface eth0 (so GLOO_SOCKET_IFNAME=eth0 in every node) and lo up;
# `run` gives the command that host name too (`ip netns exec NAMESPACE CMD`
# alone keeps the machine's).
# The bridge ${NETSIM_PREFIX}b and the host ends ${NETSIM_PREFIX}hI live in the
# host's namespace, which gets no address on the subnet: the nodes reach each
# other only.  Each link's host end shapes what flows to its node and its node
# end what flows out of it (egress tbf on both ends: no ifb needed).
# Env: NETSIM_PREFIX (default dsim; letters, digits, '-', at most 11
# characters, so that interface names fit in 15), NETSIM_SUBNET (default
# 10.77.0).  Sets of different prefixes coexist (each on its own bridge).
set -euo pipefail

PROG=$(basename "$0")
PREFIX=${NETSIM_PREFIX:-dsim}
SUBNET=${NETSIM_SUBNET:-10.77.0}
MAX_NODES=99

log() { echo "[$PROG] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
usage() { sed -n '6,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

[[ $PREFIX =~ ^[A-Za-z][A-Za-z0-9-]{0,10}$ ]] ||
    die "NETSIM_PREFIX '$PREFIX': letters, digits and '-', 1 to 11 characters"
[[ $SUBNET =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] ||
    die "NETSIM_SUBNET '$SUBNET': three octets, e.g. 10.77.0"

namespace() { echo "${PREFIX}n$1"; }

# our_namespaces / our_links: what exists of this prefix (any node count)
our_namespaces() {
    ip netns list | awk '{print $1}' | grep -E "^${PREFIX}n[0-9]+$" || true
}
our_links() {
    ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 |
        grep -E "^${PREFIX}(b|h[0-9]+|n[0-9]+)$" || true
}

# ------------------------------------------------------------------- down ---

down() {
    local ns link pid
    for ns in $(our_namespaces); do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do
            kill -KILL "$pid" 2>/dev/null || true
        done
        ip netns del "$ns" 2>/dev/null || true
    done
    # A host end outlives its namespace while a process still holds the
    # namespace; deleting it takes the node end with it.
    for link in $(our_links); do
        ip link del "$link" 2>/dev/null || true
    done
    [[ -z $(our_namespaces) && -z $(our_links) ]] ||
        die "could not remove: $(our_namespaces) $(our_links)"
}

# --------------------------------------------------------------------- up ---

# shape DEV RATE_MBIT [NAMESPACE]: a tbf on DEV's egress, in NAMESPACE if given
shape() {
    local dev=$1 rate=$2 ns=${3:-} burst
    # 4 ms of traffic at the rate (what a 250 Hz tick lets through), at least
    # one 64 KiB segment of TCP's offloads.
    burst=$((rate * 500))
    ((burst >= 65536)) || burst=65536
    local cmd=(tc qdisc add dev "$dev" root tbf rate "${rate}mbit"
        burst "$burst" latency 50ms)
    if [[ -n $ns ]]; then
        cmd=(ip netns exec "$ns" "${cmd[@]}")
    fi
    "${cmd[@]}" || die "tc tbf on $dev failed (is the kernel's sch_tbf there?)"
}

add_node() {
    local i=$1 rate=$2 ns host node
    ns=$(namespace "$i") host="${PREFIX}h$i" node="${PREFIX}n$i"
    ip netns add "$ns"
    ip link add "$host" type veth peer name "$node"
    ip link set "$node" netns "$ns"
    ip -n "$ns" link set "$node" name eth0
    ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    ip link set "$host" master "${PREFIX}b"
    ip link set "$host" up
    if ((rate > 0)); then
        shape "$host" "$rate"
        shape eth0 "$rate" "$ns"
    fi
}

up() {
    (($# == 2)) || usage
    local count=$1 rate=$2 i
    [[ $count =~ ^[0-9]+$ ]] && ((count >= 1 && count <= MAX_NODES)) ||
        die "N '$count': a node count from 1 to $MAX_NODES"
    [[ $rate =~ ^[0-9]+$ ]] || die "RATE_MBIT '$rate': whole Mbit/s (0: unshaped)"
    [[ -z $(our_namespaces) && -z $(our_links) ]] ||
        die "prefix $PREFIX is in use: tools/netsim.sh down (NETSIM_PREFIX=$PREFIX)"
    # Whatever stops up half-way (a failed step, Ctrl-C, a kill) removes
    # what it made.
    trap 'log "up did not finish: removing what it made"; down' EXIT
    trap 'exit 130' INT TERM HUP
    ip link add "${PREFIX}b" type bridge
    ip link set "${PREFIX}b" up
    for ((i = 0; i < count; i++)); do
        add_node "$i" "$rate"
    done
    trap - EXIT INT TERM HUP
    for ((i = 0; i < count; i++)); do
        echo "$(namespace "$i") $SUBNET.$((i + 1)) eth0"
    done
}

# ------------------------------------------------------------------ check ---

# remove_probe NAME: check's throw-away namespace, bridge and veth pair
remove_probe() {
    ip netns del "$1" 2>/dev/null || true
    ip link del "${1}b" 2>/dev/null || true
    ip link del "${1}h" 2>/dev/null || true
}

# What up needs, tried on throw-away objects of their own name.
check() {
    local probe="${PREFIX}x" tool
    ((EUID == 0)) || die "needs root (network namespaces, veth pairs, tc)"
    for tool in ip tc unshare hostname; do
        command -v "$tool" >/dev/null || die "needs '$tool' (iproute2, util-linux)"
    done
    # shellcheck disable=SC2064  # the name is fixed now
    trap "remove_probe $probe" EXIT
    ip netns add "$probe" 2>/dev/null || die "'ip netns add' failed: no network namespaces"
    ip link add "${probe}b" type bridge 2>/dev/null || die "no bridge support in the kernel"
    ip netns exec "$probe" unshare --uts -- true 2>/dev/null ||
        die "'unshare --uts' failed: no UTS namespaces"
    ip link add "${probe}h" type veth peer name "${probe}n" 2>/dev/null ||
        die "no veth support in the kernel"
    tc qdisc add dev "${probe}h" root tbf rate 100mbit burst 65536 latency 50ms \
        2>/dev/null || die "no tc tbf (sch_tbf) in the kernel"
    echo "ok"
}

# ------------------------------------------------------------------- main ---

(($# >= 1)) || usage
command=$1
shift
case $command in
    up) up "$@" ;;
    down) (($# == 0)) || usage; down ;;
    run)
        (($# >= 2)) || usage
        [[ $1 =~ ^[0-9]+$ ]] || die "node '$1': a number"
        ns=$(namespace "$1")
        shift
        [[ -e /run/netns/$ns ]] || die "no node $ns: tools/netsim.sh up first"
        # Its own host name too (a UTS namespace of the command's own).
        exec ip netns exec "$ns" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' \
            "$ns" "$@"
        ;;
    check) (($# == 0)) || usage; check ;;
    *) usage ;;
esac
