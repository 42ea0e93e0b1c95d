#!/usr/bin/env bash
# stop_cluster.sh - stop the single-node SLURM cluster that start_cluster.sh started from
# $DISTEVAL_SLURM_ROOT (default /tmp/disteval-slurm), and nothing else.
#
# Only processes named by the PID files under the root are signalled, and only while the PID still
# belongs to a process of the expected name (a reused PID is left alone). Jobs still queued or
# running are cancelled first so that their slurmstepd processes end cleanly. Job processes that
# outlive the daemons (slurmctld already dead, so no scancel; a job that ignored it) are killed only
# if their environment names this root's slurm.conf (slurmd and slurmstepd pass SLURM_CONF on).
# /etc/slurm/slurm.conf is removed only if it is a symlink into the root. Packages stay installed,
# and so does the state under the root (job ids and accounting continue at the next start):
# rm -rf "$DISTEVAL_SLURM_ROOT" after this script for a full reset.
#
# Knob: DISTEVAL_SLURM_ROOT (as for start_cluster.sh).
set -uo pipefail

R=${DISTEVAL_SLURM_ROOT:-/tmp/disteval-slurm}
export SLURM_CONF=$R/etc/slurm.conf
log() { echo "stop_cluster.sh: $*"; }

alive() {  # alive PIDFILE NAME: as in start_cluster.sh
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

# stop_daemons NAME=PIDFILE...: SIGTERM to each daemon that is alive, then wait for all of them,
# up to 30 s, before SIGKILL (each takes 1-3 s to exit: stopping a group together saves time)
stop_daemons() {
    local arg name pidfile pid i names=() pids=()
    for arg in "$@"; do
        name=${arg%%=*} pidfile=${arg#*=}
        if alive "$pidfile" "$name"; then
            pid=$(cat "$pidfile")
            kill -TERM "$pid" 2>/dev/null
            names+=("$name") pids+=("$pid")
        elif [ -e "$pidfile" ]; then
            log "$name not running (stale PID file removed)"
        fi
        rm -f "$pidfile"
    done
    for i in "${!pids[@]}"; do
        wait_gone "${names[$i]}" "${pids[$i]}"
        log "${names[$i]} (pid ${pids[$i]}) stopped"
    done
}
# wait_gone NAME PID: wait up to 30 s for the process to exit, then SIGKILL it
wait_gone() {
    local name=$1 pid=$2 i
    for ((i = 0; i < 300; i++)); do
        [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || return 0
        sleep 0.1
    done
    log "$name (pid $pid) still there 30 s after SIGTERM: SIGKILL"
    kill -KILL "$pid" 2>/dev/null
    sleep 0.5
}

if [ -d "$R" ]; then
    # 1. cancel what is still in the queue, while slurmctld and slurmd can still end it properly
    if alive "$R/slurmctld.pid" slurmctld; then
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

    # 2. the daemons, in reverse start order: slurmctld sends its last accounting records to
    # slurmdbd as it exits, slurmdbd writes them to MariaDB, and all of them need munge until then
    stop_daemons slurmd="$R/slurmd.pid" slurmctld="$R/slurmctld.pid"
    stop_daemons slurmdbd="$R/slurmdbd.pid"
    stop_daemons mariadbd="$R/mysql/mysqld.pid" munged="$R/munge/munged.pid"  # SIGTERM: clean InnoDB shutdown

    # 3. job processes left behind. slurmstepd ignores SIGTERM and, killed, would orphan the job's
    # processes: SIGTERM the job processes (SLURM_JOB_ID in their environment), SIGKILL what is left
    # of them 5 s later (as KillWait does), then SIGKILL the slurmstepd processes.
    ancestors=" "
    p=$$
    while [ "$p" -gt 1 ] 2>/dev/null; do
        ancestors+="$p "
        p=$(ps -o ppid= -p "$p" 2>/dev/null | tr -d ' ') || break
    done
    steps=() tasks=()
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        [[ "$ancestors" = *" $pid "* ]] && continue   # never this script or the shell that runs it
        env=$({ tr '\0' '\n' <"$p/environ"; } 2>/dev/null) || continue
        grep -qxF "SLURM_CONF=$SLURM_CONF" <<<"$env" || continue
        if [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ]; then
            steps+=("$pid")
        elif grep -q '^SLURM_JOB_ID=' <<<"$env"; then
            tasks+=("$pid")
        fi
    done
    if [ ${#steps[@]} -gt 0 ] || [ ${#tasks[@]} -gt 0 ]; then
        log "job processes left behind: slurmstepd ${steps[*]:-none}, tasks ${tasks[*]:-none}: killing them"
        [ ${#tasks[@]} -gt 0 ] && kill -TERM "${tasks[@]}" 2>/dev/null
        for ((i = 0; i < 50; i++)); do
            left=0
            for pid in "${tasks[@]}"; do   # a zombie (state Z) has exited already
                case "$(ps -o stat= -p "$pid" 2>/dev/null)" in "" | Z*) ;; *) left=1 ;; esac
            done
            [ "$left" = 0 ] && break
            sleep 0.1
        done
        [ ${#tasks[@]} -gt 0 ] && kill -KILL "${tasks[@]}" 2>/dev/null
        [ ${#steps[@]} -gt 0 ] && kill -KILL "${steps[@]}" 2>/dev/null
    fi
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
