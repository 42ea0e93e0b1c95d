#!/usr/bin/env bash
# start_cluster.sh - start a REAL single-node SLURM cluster on this machine, for disteval's tests.
#
# Run as root (Debian bookworm, slurm-wlm 22.05). Everything the cluster writes - configs, state,
# logs, sockets, PID files, the munge key and the MariaDB datadir - lives under $DISTEVAL_SLURM_ROOT;
# the only thing written outside it is the symlink /etc/slurm/slurm.conf (see DISTEVAL_SLURM_LINK_ETC).
#
# Daemons, in start order:
#   munged     authentication for every SLURM message (private socket, private key)
#   mariadbd   the accounting database (private datadir, socket and TCP port)
#   slurmdbd   accounting: submitit learns job states ONLY through `sacct`; without it a cancelled
#              or timed-out job is never seen as finished and job.result() waits forever
#   slurmctld  the controller
#   slurmd     the one compute node, NodeName=localhost
#
# Idempotent: a daemon already running from this root (PID file + process name) is kept, a missing
# one is (re)started; re-running while everything is up is a quick no-op. Exits 0 once `sinfo` shows
# the node idle and `sacct` answers; on failure prints the tail of the daemon logs and exits 1.
# State is kept across stop/start (job ids and accounting continue); for a reset run
# stop_cluster.sh, then rm -rf "$DISTEVAL_SLURM_ROOT".
#
# Knobs (environment variables), with defaults:
#   DISTEVAL_SLURM_ROOT=/tmp/disteval-slurm  all files of the cluster (absolute, short: socket paths
#                                            must stay under the 108-byte limit of unix sockets)
#   DISTEVAL_SLURM_CPUS=4           CPUs declared for the node; more than the real cores is allowed
#                                   (SlurmdParameters=config_overrides) so that 4-rank jobs fit on 2 cores
#   DISTEVAL_SLURM_MEM_MB=<80% of RAM>  RealMemory of the node; DefMemPerCPU = this / CPUS
#   DISTEVAL_SLURM_CLUSTER=disteval     ClusterName (also the accounting cluster)
#   DISTEVAL_SLURM_ACCOUNT=disteval     default accounting account, given to root
#   DISTEVAL_SLURM_CTLD_PORT=16817 DISTEVAL_SLURM_SLURMD_PORT=16818
#   DISTEVAL_SLURM_DBD_PORT=16819  DISTEVAL_SLURM_DB_PORT=16820
#                                   ports off the standard 6817/6818/6819/3306 so that a system
#                                   SLURM or MySQL on the machine is not disturbed
#   DISTEVAL_SLURM_WAIT_S=90        how long to wait for each daemon and for the node to be idle
#   DISTEVAL_SLURM_INSTALL=1        0: fail instead of apt-get installing missing packages
#   DISTEVAL_SLURM_LINK_ETC=1       0: do not symlink /etc/slurm/slurm.conf (then `source
#                                   $DISTEVAL_SLURM_ROOT/env.sh` before using sinfo/sbatch/sacct)
#
# Usage:  sudo scripts/slurm/start_cluster.sh   (then scripts/slurm/stop_cluster.sh to stop)
set -euo pipefail

R=${DISTEVAL_SLURM_ROOT:-/tmp/disteval-slurm}
CPUS=${DISTEVAL_SLURM_CPUS:-4}
CLUSTER=${DISTEVAL_SLURM_CLUSTER:-disteval}
ACCOUNT=${DISTEVAL_SLURM_ACCOUNT:-disteval}
CTLD_PORT=${DISTEVAL_SLURM_CTLD_PORT:-16817}
SLURMD_PORT=${DISTEVAL_SLURM_SLURMD_PORT:-16818}
DBD_PORT=${DISTEVAL_SLURM_DBD_PORT:-16819}
DB_PORT=${DISTEVAL_SLURM_DB_PORT:-16820}
WAIT_S=${DISTEVAL_SLURM_WAIT_S:-90}
INSTALL=${DISTEVAL_SLURM_INSTALL:-1}
LINK_ETC=${DISTEVAL_SLURM_LINK_ETC:-1}
# "localhost" always resolves; the machine's own hostname may not (seen on these sandboxes)
NODE=localhost

T0=$(date +%s.%N)
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
log() { echo "start_cluster.sh: $*"; }
# fail: a wrong setting or environment, nothing to learn from the logs
fail() { echo "start_cluster.sh: ERROR: $*" >&2; exit 1; }
# die: something did not start or answer: show the end of every daemon log
die() {
    echo "start_cluster.sh: ERROR: $*" >&2
    local f
    for f in munged.log mariadbd.err slurmdbd.log slurmctld.log slurmd.log; do
        if [ -s "$R/log/$f" ]; then
            echo "---- tail of $R/log/$f" >&2
            tail -n 15 "$R/log/$f" >&2
        fi
    done
    exit 1
}

# alive PIDFILE NAME: the PID file names a live process whose name is NAME. The name check keeps a
# stale PID file whose number was reused by an unrelated process from being taken for our daemon.
alive() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# wait_for WHAT COMMAND...: retry COMMAND every 0.25 s for up to WAIT_S seconds
wait_for() {
    local what=$1 i
    shift
    for ((i = 0; i < WAIT_S * 4; i++)); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.25
    done
    die "timed out after ${WAIT_S}s waiting for $what"
}

[ "$(id -u)" = 0 ] || fail "must run as root (the daemons run as root: SlurmUser=root)"
[[ "$R" = /* ]] && [ "$R" != / ] || fail "DISTEVAL_SLURM_ROOT must be an absolute path other than /"
# the longest socket path is $R/mysql/mysqld.sock: keep it well under sun_path's 108 bytes
[ ${#R} -le 80 ] || fail "DISTEVAL_SLURM_ROOT is too long (${#R} > 80 characters) for unix socket paths"
[[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || fail "DISTEVAL_SLURM_CPUS must be a positive integer"

# --------------------------------------------------------------------------------- 1. packages
PKGS=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
CMDS=(munged munge unmunge slurmctld slurmd sinfo sbatch sacct sacctmgr scontrol slurmdbd
      mariadbd mariadb mariadb-admin mariadb-install-db)
missing() { local c; for c in "${CMDS[@]}"; do command -v "$c" >/dev/null 2>&1 || return 0; done; return 1; }
if missing; then
    [ "$INSTALL" = 1 ] || fail "SLURM/munge/MariaDB commands missing and DISTEVAL_SLURM_INSTALL=0"
    log "installing ${PKGS[*]} with apt-get ..."
    # A postinst would start the system's munge/mariadb services (on the standard ports, with the
    # system datadir). A policy-rc.d that exits 101 forbids that; docker images ship one already.
    own_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && own_policy=1
    fi
    apt_log=$(mktemp /tmp/disteval-slurm-apt.XXXXXX)
    apt_install() {
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${PKGS[@]}" >>"$apt_log" 2>&1
    }
    rc=0
    # apt-get update only when needed: the package lists of the machine are usually recent enough
    apt_install || { log "apt-get install failed, running apt-get update and retrying"
                     apt-get update -q >>"$apt_log" 2>&1 && apt_install; } || rc=$?
    [ "$own_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
    if [ "$rc" != 0 ]; then
        tail -n 25 "$apt_log" >&2
        die "apt-get install failed (rc=$rc), full log: $apt_log"
    fi
    rm -f "$apt_log"
    log "packages installed in $(elapsed)s"
    ! missing || die "commands still missing after apt-get install: ${CMDS[*]}"
fi

# --------------------------------------------------------------------------------- 2. layout
MEM_TOTAL_MB=$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)
MEM_MB=${DISTEVAL_SLURM_MEM_MB:-$((MEM_TOTAL_MB * 8 / 10))}
[[ "$MEM_MB" =~ ^[1-9][0-9]*$ ]] || fail "DISTEVAL_SLURM_MEM_MB must be a positive integer"
MUNGE_SOCK=$R/munge/munge.socket
export SLURM_CONF=$R/etc/slurm.conf   # this script's own sinfo/sacctmgr calls, before /etc is linked

# Ports of daemons that are not running from this root must be free: another cluster (or a system
# slurm/mysql) on them would answer our clients with the wrong key and fail in confusing ways.
busy=()
alive "$R/mysql/mysqld.pid" mariadbd || ! port_open "$DB_PORT" || busy+=("$DB_PORT (mariadbd)")
alive "$R/slurmdbd.pid" slurmdbd || ! port_open "$DBD_PORT" || busy+=("$DBD_PORT (slurmdbd)")
alive "$R/slurmctld.pid" slurmctld || ! port_open "$CTLD_PORT" || busy+=("$CTLD_PORT (slurmctld)")
alive "$R/slurmd.pid" slurmd || ! port_open "$SLURMD_PORT" || busy+=("$SLURMD_PORT (slurmd)")
[ ${#busy[@]} = 0 ] || fail "port(s) in use by processes not started from $R: ${busy[*]}" \
    "(another cluster? stop it, or set DISTEVAL_SLURM_*_PORT)"

mkdir -p "$R"/{etc,munge,mysql,ctld,spool,log,tmp}
chmod 755 "$R" "$R/munge"   # munged refuses a socket directory without o+x (clients connect)
chmod 700 "$R/ctld"         # controller state: job scripts and environments of every job
# slurmd's spool must be traversable: a non-root job's script is exec'ed, as that user, from a
# per-job directory in it (700 here made every non-root job FAIL with "execve: Permission denied")
chmod 755 "$R/spool"
chmod 1777 "$R/tmp"         # TmpFS: writable by jobs of any user, like /tmp

# --------------------------------------------------------------------------------- 3. configs
# Each config is written to FILE.new; once all are written they are moved over the old ones. If one
# differs from what the running daemons read, nothing is changed and the script refuses: a
# half-applied change would leave daemons with mismatched settings.
any_alive() {
    alive "$R/munge/munged.pid" munged || alive "$R/mysql/mysqld.pid" mariadbd ||
        alive "$R/slurmdbd.pid" slurmdbd || alive "$R/slurmctld.pid" slurmctld || alive "$R/slurmd.pid" slurmd
}
CONFS=("$R/etc/slurm.conf" "$R/etc/slurmdbd.conf" "$R/etc/my.cnf")
install_confs() {
    local f changed=()
    for f in "${CONFS[@]}"; do
        if [ -f "$f" ] && ! cmp -s "$f" "$f.new"; then changed+=("$f"); fi
    done
    if [ ${#changed[@]} -gt 0 ] && any_alive; then
        for f in "${changed[@]}"; do diff "$f" "$f.new" >&2 || true; done
        for f in "${CONFS[@]}"; do rm -f "$f.new"; done
        fail "the cluster running from $R was started with other settings (${changed[*]}): run stop_cluster.sh first"
    fi
    for f in "${CONFS[@]}"; do mv -f "$f.new" "$f"; done
}

# The database password is made once and kept (mode 600) with the rest of the state.
[ -s "$R/etc/db.pass" ] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=\n' >"$R/etc/db.pass")
DB_PASS=$(cat "$R/etc/db.pass")

cat >"$R/etc/slurm.conf.new" <<EOF
# Written by disteval scripts/slurm/start_cluster.sh for DISTEVAL_SLURM_ROOT=$R. Do not edit: rerun
# the script (after stop_cluster.sh) with other DISTEVAL_SLURM_* settings instead.
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
# root runs everything: no slurm system user, no file ownership games in a throw-away sandbox
SlurmUser=root
SlurmdUser=root

# munge with a private socket (the system's /run/munge is not ours); cred_expire: a job step credential's
# lifetime, which is also how long a requeued job waits before it may start again (default 120 s: the requeue
# test waited 143 s for it)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK,cred_expire=30

# every file under the root
StateSaveLocation=$R/ctld
SlurmdSpoolDir=$R/spool
SlurmctldPidFile=$R/slurmctld.pid
SlurmdPidFile=$R/slurmd.pid
SlurmctldLogFile=$R/log/slurmctld.log
SlurmdLogFile=$R/log/slurmd.log
TmpFS=$R/tmp
MailProg=/bin/true

# No cgroups (not available / not delegated in these containers): processes are tracked through
# /proc, no CPU binding, no memory enforcement.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none

# Accounting through slurmdbd: submitit polls job states with sacct (see the header).
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# For the connection to slurmdbd, AuthInfo is not used: this names the munge socket for it.
AccountingStoragePass=$MUNGE_SOCK
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none

MpiDefault=none
SchedulerType=sched/backfill
# batch_sched_delay (default 3 s) lets slurmctld put off starting a newly submitted batch job: every
# submitit round trip took 1.5-3 s longer for it. 0: try to start it at once.
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default, a job that gives no --mem is allocated the whole node's memory and jobs run
# one at a time.
DefMemPerCPU=$((MEM_MB / CPUS))
# A job asking for more CPUs than the node has is rejected at sbatch time instead of pending forever
# (with MaxCPUsPerNode on the partition below).
EnforcePartLimits=ALL
# The node declares more CPUs than the hardware has (4-rank jobs on 2 cores): slurmd must report
# the configured CPUs/memory instead of having the node marked INVAL and drained.
SlurmdParameters=config_overrides
# a node that was down (e.g. slurmd restarted) comes back by itself once it registers
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
# scancel: SIGTERM, then SIGKILL 5 s later (default 30 s) so cancelled tests end promptly
KillWait=5
# finished jobs stay visible to squeue/scontrol for 5 minutes (sacct keeps them for ever)
MinJobAge=300
Waittime=0

NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE MaxCPUsPerNode=$CPUS State=UP
EOF

cat >"$R/etc/slurmdbd.conf.new" <<EOF
# Written by disteval scripts/slurm/start_cluster.sh for DISTEVAL_SLURM_ROOT=$R.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$R/slurmdbd.pid
LogFile=$R/log/slurmdbd.log
# MariaDB over TCP on 127.0.0.1: with StorageHost=localhost the client library would use the
# compiled-in system socket (/run/mysqld) instead of ours.
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
chmod 600 "$R/etc/slurmdbd.conf.new"   # slurmdbd refuses to start on a config others can read

cat >"$R/etc/my.cnf.new" <<EOF
# Written by disteval scripts/slurm/start_cluster.sh: a private MariaDB for slurmdbd only.
[mysqld]
datadir=$R/mysql/data
socket=$R/mysql/mysqld.sock
pid-file=$R/mysql/mysqld.pid
log-error=$R/log/mariadbd.err
port=$DB_PORT
bind-address=127.0.0.1
skip-name-resolve
# mariadbd refuses to run as root unless told so
user=root
skip-log-bin
# Linux native AIO (io_setup) can fail in containers; threads are enough here
innodb_use_native_aio=0
# slurmdbd logs an error at start unless buffer pool >= 512M, log file >= 32M (64M recommended)
# and lock wait timeout >= 450 s (the values recommended by SLURM's accounting docs)
innodb_buffer_pool_size=512M
innodb_log_file_size=64M
innodb_lock_wait_timeout=900
[client]
socket=$R/mysql/mysqld.sock
EOF
install_confs
rm -f "$R/etc/cgroup.conf"   # none: an old one would make slurmd try cgroups

printf 'export SLURM_CONF=%s\n' "$SLURM_CONF" >"$R/env.sh"

# --------------------------------------------------------------------------------- 4. munged
if alive "$R/munge/munged.pid" munged; then
    log "munged already running (pid $(cat "$R/munge/munged.pid"))"
else
    if [ ! -s "$R/munge/munge.key" ]; then
        (umask 077; dd if=/dev/urandom of="$R/munge/munge.key" bs=1024 count=1 status=none)
    fi
    chown root:root "$R/munge/munge.key"
    chmod 400 "$R/munge/munge.key"   # munged refuses a key others can read
    # a socket/lock left by a killed munged makes the new one exit ("socket is in use")
    rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock" "$R/munge/munged.pid"
    munged --socket="$MUNGE_SOCK" --key-file="$R/munge/munge.key" --pid-file="$R/munge/munged.pid" \
        --log-file="$R/log/munged.log" --seed-file="$R/munge/munged.seed" </dev/null >/dev/null 2>&1 ||
        die "munged failed to start"
    log "munged started (pid $(cat "$R/munge/munged.pid"))"
fi
wait_for "munge to answer" bash -c "munge -n -S '$MUNGE_SOCK' | unmunge -S '$MUNGE_SOCK'"

# --------------------------------------------------------------------------------- 5. mariadbd
MYSQL=(mariadb --defaults-file="$R/etc/my.cnf")
if alive "$R/mysql/mysqld.pid" mariadbd; then
    log "mariadbd already running (pid $(cat "$R/mysql/mysqld.pid"))"
else
    if [ ! -d "$R/mysql/data/mysql" ]; then
        # root logs in through the private unix socket only (no password to keep)
        mariadb-install-db --defaults-file="$R/etc/my.cnf" --auth-root-authentication-method=socket \
            --skip-test-db >"$R/log/mariadb-install-db.log" 2>&1 ||
            die "mariadb-install-db failed, see $R/log/mariadb-install-db.log"
    fi
    rm -f "$R/mysql/mysqld.pid"
    # mariadbd does not daemonize: setsid detaches it from this shell's session and process group
    setsid mariadbd --defaults-file="$R/etc/my.cnf" </dev/null >>"$R/log/mariadbd.out" 2>&1 &
    wait_for "mariadbd to answer" mariadb-admin --defaults-file="$R/etc/my.cnf" ping
    wait_for "mariadbd's PID file" alive "$R/mysql/mysqld.pid" mariadbd
    log "mariadbd started (pid $(cat "$R/mysql/mysqld.pid"))"
fi
# slurmdbd connects over TCP from 127.0.0.1 (skip-name-resolve: 'localhost' would not match it)
"${MYSQL[@]}" -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
    ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" ||
    die "could not create the database user for slurmdbd"

# --------------------------------------------------------------------------------- 6. slurmdbd
if alive "$R/slurmdbd.pid" slurmdbd; then
    log "slurmdbd already running (pid $(cat "$R/slurmdbd.pid"))"
else
    rm -f "$R/slurmdbd.pid"
    # slurmdbd finds its config next to slurm.conf ($SLURM_CONF's directory); it daemonizes itself
    slurmdbd </dev/null >>"$R/log/slurmdbd.out" 2>&1 || die "slurmdbd failed to start"
    wait_for "slurmdbd on port $DBD_PORT" port_open "$DBD_PORT"
    wait_for "slurmdbd's PID file" alive "$R/slurmdbd.pid" slurmdbd
    log "slurmdbd started (pid $(cat "$R/slurmdbd.pid"))"
fi

# The accounting cluster, account and user. slurmctld would register the cluster by itself, but
# adding it first (before slurmctld starts) makes the very first jobs land in the database, and a
# default account gives every root job an association (Account column filled in sacct).
wait_for "sacctmgr to reach slurmdbd" sacctmgr -n -P show cluster
sacctmgr_add() {  # sacctmgr_add ENTITY NAME ARGS...: add unless present (-i: no confirmation)
    local entity=$1 name=$2 out
    shift 2
    if [ -z "$(sacctmgr -n -P show "$entity" "$name" format="$entity" 2>/dev/null)" ]; then
        out=$(sacctmgr -i add "$entity" "$name" "$@" 2>&1) || die "sacctmgr add $entity $name failed: $out"
        log "accounting: added $entity $name"
    fi
}
sacctmgr_add cluster "$CLUSTER"
sacctmgr_add account "$ACCOUNT" Cluster="$CLUSTER" Description=disteval-tests Organization=disteval
# root exists in a new database already (as the administrator, with account "root"): check for
# its association with our account rather than for the user
if [ -z "$(sacctmgr -n -P show assoc where cluster="$CLUSTER" account="$ACCOUNT" user=root format=user 2>/dev/null)" ]; then
    out=$(sacctmgr -i add user root Account="$ACCOUNT" Cluster="$CLUSTER" 2>&1) || die "sacctmgr add user root failed: $out"
    log "accounting: added user root to account $ACCOUNT"
fi
if [ "$(sacctmgr -n -P show user root format=defaultaccount 2>/dev/null)" != "$ACCOUNT" ]; then
    out=$(sacctmgr -i modify user root set DefaultAccount="$ACCOUNT" 2>&1) || die "sacctmgr: default account of root: $out"
fi

# --------------------------------------------------------------------------------- 7. slurmctld, slurmd
if alive "$R/slurmctld.pid" slurmctld; then
    log "slurmctld already running (pid $(cat "$R/slurmctld.pid"))"
else
    rm -f "$R/slurmctld.pid"
    # -i: a state file damaged by an earlier kill is ignored instead of stopping the controller
    slurmctld -i </dev/null >>"$R/log/slurmctld.out" 2>&1 || die "slurmctld failed to start"
    wait_for "slurmctld to answer" scontrol ping
    wait_for "slurmctld's PID file" alive "$R/slurmctld.pid" slurmctld
    log "slurmctld started (pid $(cat "$R/slurmctld.pid"))"
fi
if alive "$R/slurmd.pid" slurmd; then
    log "slurmd already running (pid $(cat "$R/slurmd.pid"))"
else
    rm -f "$R/slurmd.pid"
    # -N: the node's name in slurm.conf (the hostname would not match it)
    slurmd -N "$NODE" </dev/null >>"$R/log/slurmd.out" 2>&1 || die "slurmd failed to start"
    wait_for "slurmd's PID file" alive "$R/slurmd.pid" slurmd
    log "slurmd started (pid $(cat "$R/slurmd.pid"))"
fi

# --------------------------------------------------------------------------------- 8. usable?
state=""
for ((i = 0; i < WAIT_S * 4; i++)); do
    state=$(sinfo -h -N -n "$NODE" -o %T 2>/dev/null) || state="no answer"
    case "$state" in
        idle | mixed | allocated | completing) break ;;
        inval*) die "node $NODE is INVAL: $(sinfo -h -N -n "$NODE" -o %E)" ;;
        # a node left drained/down by an earlier run: bring it back
        *drain* | down*) scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.25
done
case "$state" in
    idle | mixed | allocated | completing) ;;
    *) die "node $NODE not usable after ${WAIT_S}s (sinfo state: ${state:-none})" ;;
esac
wait_for "sacct to answer" sacct -n -X -S now

# Let plain sinfo/sbatch/sacct/scancel/squeue (and so submitit) find the config without SLURM_CONF:
# Debian's clients read /etc/slurm/slurm.conf. A regular file there belongs to someone else: keep it.
if [ "$LINK_ETC" = 1 ]; then
    mkdir -p /etc/slurm
    if [ -e /etc/slurm/slurm.conf ] && [ ! -L /etc/slurm/slurm.conf ]; then
        log "WARNING: /etc/slurm/slurm.conf is a regular file, left alone: 'source $R/env.sh' first"
    else
        ln -sfn "$SLURM_CONF" /etc/slurm/slurm.conf
    fi
fi

log "cluster up in $(elapsed)s: $(sinfo -h -N -o 'node=%N state=%T cpus=%c mem=%mMB partition=%P')"
log "config: $SLURM_CONF (or: source $R/env.sh); stop: scripts/slurm/stop_cluster.sh"
