#!/usr/bin/env bash
# stop_cluster.sh - stop the single-node SLURM cluster that start_cluster.sh started from
# $DISTEVAL_SLURM_ROOT (default /tmp/disteval-slurm), and nothing else.
#
# Only processes named by the PID files under the root are signalled, and only while the PID still
# belongs to a process of the expected name (a reused PID is left alone). Jobs still queued or
# running are cancelled first so that their slurmstepd processes end cleanly; a job step process
# that outlives slurmd is killed only if its environment names this root's slurm.conf.
# /etc/slurm/slurm.conf is removed only if it is a symlink into the root. Packages stay installed,
# and so does the state under the root (job ids and accounting continue at the next start):
# rm -rf "$DISTEVAL_SLURM_ROOT" after this script for a full reset.
#
# Knobs: DISTEVAL_SLURM_ROOT (as for start_cluster.sh); DISTEVAL_SLURM_CANCEL=0 skips the scancel.
set -uo pipefail

R=${DISTEVAL_SLURM_ROOT:-/tmp/disteval-slurm}
CANCEL=${DISTEVAL_SLURM_CANCEL:-1}
export SLURM_CONF=$R/etc/slurm.conf
log() { echo "stop_cluster.sh: $*"; }

alive() {  # alive PIDFILE NAME: as in start_cluster.sh
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

# stop_pid NAME PID: SIGTERM, up to 30 s for a clean exit, then SIGKILL
stop_pid() {
    local name=$1 pid=$2 i
    kill -TERM "$pid" 2>/dev/null
    for ((i = 0; i < 120; i++)); do
        [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || return 0
        sleep 0.25
    done
    log "$name (pid $pid) still there 30 s after SIGTERM: SIGKILL"
    kill -KILL "$pid" 2>/dev/null
    sleep 0.5
}

# stop_daemon NAME PIDFILE
stop_daemon() {
    local name=$1 pidfile=$2 pid
    if alive "$pidfile" "$name"; then
        pid=$(cat "$pidfile")
        stop_pid "$name" "$pid"
        log "$name (pid $pid) stopped"
    elif [ -e "$pidfile" ]; then
        log "$name not running (stale PID file removed)"
    fi
    rm -f "$pidfile"
}

if [ -d "$R" ]; then
    # 1. cancel what is still in the queue, while slurmctld and slurmd can still end it properly
    if [ "$CANCEL" = 1 ] && alive "$R/slurmctld.pid" slurmctld; then
        jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
        if [ -n "${jobs// /}" ]; then
            log "cancelling jobs: $jobs"
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null
            for ((i = 0; i < 60; i++)); do  # KillWait is 5 s: 30 s is plenty
                [ -z "$(squeue -h -t PD,R,CG,S -o %A 2>/dev/null)" ] && break
                sleep 0.5
            done
        fi
    fi

    # 2. the daemons, in reverse start order
    stop_daemon slurmd "$R/slurmd.pid"
    stop_daemon slurmctld "$R/slurmctld.pid"
    stop_daemon slurmdbd "$R/slurmdbd.pid"
    stop_daemon mariadbd "$R/mysql/mysqld.pid"   # SIGTERM = clean InnoDB shutdown
    stop_daemon munged "$R/munge/munged.pid"

    # 3. job step daemons left behind (DISTEVAL_SLURM_CANCEL=0, or a job that would not die): slurmd
    # passes its environment, SLURM_CONF included, to the slurmstepd processes it starts
    for p in /proc/[0-9]*; do
        [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] || continue
        if tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF"; then
            log "slurmstepd (pid ${p#/proc/}) left behind: stopping it"
            stop_pid slurmstepd "${p#/proc/}"
        fi
    done
else
    log "nothing to stop: $R does not exist"
fi

# 4. the /etc symlink, only if it is ours
if [ -L /etc/slurm/slurm.conf ]; then
    target=$(readlink /etc/slurm/slurm.conf)
    if [ "${target#"$R"/}" != "$target" ]; then
        rm -f /etc/slurm/slurm.conf
        log "removed the symlink /etc/slurm/slurm.conf -> $target"
    fi
fi
log "done"
