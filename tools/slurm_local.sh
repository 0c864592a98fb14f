#!/usr/bin/env bash
# slurm_local.sh - bring up a REAL single-node Slurm cluster on localhost
# (munged + slurmctld + slurmd, Debian packages) for tests and for poking at
# distribuuuu's Slurm support by hand. No systemd needed: daemons are started
# directly and tracked through their pid files.
#
# Usage (as root, Debian/Ubuntu):
#   tools/slurm_local.sh up      # install (if missing) + configure + start; idempotent
#   tools/slurm_local.sh down    # stop slurmd, slurmctld and munged
#   tools/slurm_local.sh status  # print sinfo; exit 0 iff the node is usable
#
# The node is $(hostname -s) at 127.0.0.1 with CPUs=$(nproc), in partition
# "debug" (default). Overcommit works (`srun -O -n 3 ...` on 2 CPUs), jobs are
# requeue-able (JobRequeue=1) and there is no accounting.
# Config: /etc/slurm/slurm.conf, logs: /var/log/slurm/*.log, /var/log/munge/.
# Env: SLURM_LOCAL_TIMEOUT (seconds to wait for the node, default 60).
set -euo pipefail

PROG=$(basename "$0")
SLURM_CONF_DIR=/etc/slurm
SLURM_CONF=$SLURM_CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_KEY=/etc/munge/munge.key
MUNGE_RUN=/run/munge
MUNGE_PID=$MUNGE_RUN/munged.pid
PACKAGES=(slurmctld slurmd slurm-client munge)
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
NODE=$(hostname -s)
PARTITION=debug
SLURMD_STARTED=""

log() { echo "[$PROG] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---------------------------------------------------------------- helpers ---

# pid_alive PIDFILE NAME: the process in PIDFILE is alive and is NAME
pid_alive() {
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]]
}

# stop_pids PIDFILE:NAME...: SIGTERM them all, wait up to 15 s, then SIGKILL
stop_pids() {
    local spec file name pid i pids=() alive
    for spec in "$@"; do
        file=${spec%%:*} name=${spec#*:}
        if pid_alive "$file" "$name"; then
            pid=$(<"$file")
            log "stopping $name (pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
        rm -f "$file"
    done
    for ((i = 0; i < 150; i++)); do
        alive=()
        for pid in "${pids[@]}"; do
            kill -0 "$pid" 2>/dev/null && alive+=("$pid")
        done
        ((${#alive[@]})) || return 0
        sleep 0.1
    done
    log "pid(s) ${alive[*]} ignored SIGTERM, sending SIGKILL"
    kill -KILL "${alive[@]}" 2>/dev/null || true
    sleep 0.5
}

# node_state: compact state of our node as printed by sinfo (e.g. idle, down*)
node_state() {
    sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n1 || true
}

# usable STATE: node is responding and can run jobs
usable() {
    case $1 in
        idle | mixed | allocated | completing) return 0 ;;
        *) return 1 ;;
    esac
}

dump_logs() {
    local f
    for f in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" /var/log/munge/munged.log; do
        if [[ -f $f ]]; then
            echo "----- tail -n 30 $f -----" >&2
            # (pmix noise: Debian's slurmd loads mpi/pmix even with MpiDefault=none)
            grep -v -e pmix -e 'MPI: Cannot' "$f" | tail -n 30 >&2 || true
        fi
    done
}

need_root() {
    [[ $(id -u) -eq 0 ]] || die "must be run as root (try: sudo $0 ${1:-up})"
}

# ----------------------------------------------------------------- install ---

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    # binaries gone although dpkg thinks otherwise (e.g. half-removed): reinstall
    if ((${#missing[@]} == 0)); then
        for p in slurmctld slurmd sinfo srun munged; do
            command -v "$p" >/dev/null 2>&1 || [[ -x /usr/sbin/$p ]] || missing=("${PACKAGES[@]}")
        done
    fi
    ((${#missing[@]})) || return 0
    command -v apt-get >/dev/null 2>&1 || die "apt-get not found; install ${missing[*]} by hand"
    log "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    # Only refresh the package lists when they are empty (fresh containers).
    if ! compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null; then
        apt-get update -qq
    fi
    if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

# ------------------------------------------------------------------- munge ---

start_munge() {
    if [[ ! -s $MUNGE_KEY ]]; then
        log "creating $MUNGE_KEY"
        install -d -m 0700 -o munge -g munge /etc/munge
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile="$MUNGE_KEY" --force
        else
            dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
        fi
    fi
    chown munge:munge "$MUNGE_KEY"
    chmod 0400 "$MUNGE_KEY"
    install -d -m 0755 -o munge -g munge "$MUNGE_RUN"
    install -d -m 0700 -o munge -g munge /var/log/munge /var/lib/munge

    if pid_alive "$MUNGE_PID" munged && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0
    fi
    stop_pids "$MUNGE_PID:munged"
    log "starting munged"
    # 9>&-: daemons must not inherit (and so hold forever) our lock fd.
    # munged daemonizes itself and writes $MUNGE_PID; --force: ignore a stale socket
    runuser -u munge -- /usr/sbin/munged --force 9>&-
    local i
    for ((i = 0; i < 50; i++)); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    dump_logs
    die "munged did not come up"
}

# ------------------------------------------------------------------- slurm ---

render_conf() {
    cat <<EOF
# Generated by distribuuuu tools/slurm_local.sh -- single-node test cluster.
# Edits are overwritten by '$PROG up'.
ClusterName=localcluster
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
# cred_expire also delays a requeued job restart (default 120 s!)
AuthInfo=cred_expire=10
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# rescan pending jobs often (default 60 s/30 s), so requeued jobs restart quickly
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
EnforcePartLimits=ALL
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=300
Waittime=0
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE CPUs=$(nproc) State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

# write_conf: install slurm.conf; returns 0 if it changed
write_conf() {
    local tmp
    install -d -m 0755 "$SLURM_CONF_DIR" "$LOG_DIR" "$SPOOL_DIR"
    install -d -m 0700 "$STATE_DIR"
    tmp=$(mktemp "$SLURM_CONF_DIR/.slurm.conf.XXXXXX")
    render_conf >"$tmp"
    chmod 0644 "$tmp"
    if [[ -f $SLURM_CONF ]] && cmp -s "$tmp" "$SLURM_CONF"; then
        rm -f "$tmp"
        return 1
    fi
    [[ -f $SLURM_CONF ]] && log "$SLURM_CONF changed, (re)writing it"
    mv -f "$tmp" "$SLURM_CONF"
    return 0
}

start_slurm() {
    if ! pid_alive "$CTLD_PID" slurmctld; then
        log "starting slurmctld"
        /usr/sbin/slurmctld 9>&- || { dump_logs; die "slurmctld failed to start"; }
    fi
    if ! pid_alive "$SLURMD_PID" slurmd; then
        log "starting slurmd (node $NODE)"
        SLURMD_STARTED=$(date +%Y-%m-%dT%H:%M:%S)
        /usr/sbin/slurmd -N "$NODE" 9>&- || { dump_logs; die "slurmd failed to start"; }
    fi
}

stop_slurm() {
    stop_pids "$CTLD_PID:slurmctld" "$SLURMD_PID:slurmd"
}

# slurmd_start_time: SlurmdStartTime of our node as slurmctld knows it
slurmd_start_time() {
    scontrol show node "$NODE" 2>/dev/null | sed -n 's/.*SlurmdStartTime=\([^ ]*\).*/\1/p' | head -n1 || true
}

wait_node() {
    local deadline=$((SECONDS + TIMEOUT)) state="" resumed=0 started
    while true; do
        state=$(node_state)
        if [[ -n $SLURMD_STARTED ]]; then
            # slurmctld restores the old node state ("idle") from its state
            # files: also wait until the slurmd we just started has registered
            started=$(slurmd_start_time)
            if [[ $started == None || $started < $SLURMD_STARTED ]]; then
                state="$state (slurmd not registered yet)"
            fi
        fi
        if usable "$state"; then
            return 0
        fi
        case $state in
            down | drain* | fail*)
                # responding but administratively down (e.g. after a crash): resume
                if ((resumed < SECONDS)); then
                    log "node $NODE is '$state', resuming it"
                    scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
                    resumed=$((SECONDS + 3))
                fi
                ;;
        esac
        pid_alive "$CTLD_PID" slurmctld || { dump_logs; die "slurmctld died"; }
        pid_alive "$SLURMD_PID" slurmd || { dump_logs; die "slurmd died"; }
        ((SECONDS < deadline)) || break
        sleep 0.5
    done
    sinfo >&2 || true
    dump_logs
    die "node $NODE not usable after ${TIMEOUT}s (last state: '${state:-none}')"
}

# ---------------------------------------------------------------- commands ---

cmd_up() {
    install_packages
    start_munge
    if write_conf; then
        # new or changed config: (re)start the slurm daemons on it
        stop_slurm
    fi
    start_slurm
    wait_node
    sinfo
}

cmd_down() {
    stop_slurm
    stop_pids "$MUNGE_PID:munged"
    log "stopped"
}

cmd_status() {
    local state
    if ! command -v sinfo >/dev/null 2>&1; then
        log "slurm is not installed (run: $0 up)"
        return 1
    fi
    sinfo || { log "slurmctld not reachable"; return 1; }
    if [[ -e $SLURMD_PID ]] && ! pid_alive "$SLURMD_PID" slurmd; then
        log "slurmd is not running (run: $0 up)"
        return 1
    fi
    state=$(node_state)
    usable "$state" || { log "node $NODE is not usable (state: '${state:-none}')"; return 1; }
}

main() {
    local cmd=${1:-}
    case $cmd in
        up | down)
            need_root "$cmd"
            # serialize concurrent callers (e.g. parallel test sessions)
            exec 9>/run/slurm_local.lock
            flock -w 120 9 || die "could not take /run/slurm_local.lock"
            "cmd_$cmd"
            ;;
        status) cmd_status ;;
        -h | --help | help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' ;;
        *)
            sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2
            exit 2
            ;;
    esac
}

main "$@"
