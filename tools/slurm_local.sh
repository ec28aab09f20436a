#!/usr/bin/env bash
# A whole SLURM cluster on this one machine (Debian's slurm-wlm 22.05 + munge): a controller, a compute daemon and
# munge on localhost, to try `zaec-sweep --executor slurm` and to test it (tests/extract/sweep/test_slurm_real.py).
#
#   tools/slurm_local.sh up [--accounting] [--cpus N] [--min-job-age S]   start (or reuse) the cluster
#   tools/slurm_local.sh down                                            stop every daemon this script started
#   tools/slurm_local.sh status                                          one line: up/down, mode, node state
#   tools/slurm_local.sh env                                             `export SLURM_CONF=...` for this shell
#   tools/slurm_local.sh install [--accounting]                          only install the Debian packages
#
# ZAEC_SLURM_NO_INSTALL=1: `up` installs nothing and says which packages are missing (the tests set it).
#
# Without --accounting the cluster runs `AccountingStorageType=accounting_storage/none`, as many small clusters do:
# `sacct` then fails ("Slurm accounting storage is disabled"). SLURM 22.05 has no file-based job accounting any more
# (accounting_storage/filetxt and `sacct --completion` are gone): only slurmdbd answers `sacct`, so --accounting adds
# slurmdbd and a private MariaDB server (datadir and socket in the state folder; about 25 more packages).
#
# Everything lives in one folder, $ZAEC_SLURM_DIR (default /tmp/zaec-slurm): slurm.conf, munge key and socket,
# state, spool, logs, pid files, the database. /etc/slurm/slurm.conf is made a link to that slurm.conf when no such
# file exists (so `sinfo`, `sbatch` work without SLURM_CONF); a configuration this script did not write is never
# touched (then `eval "$(tools/slurm_local.sh env)"` points the commands at the cluster).
#
# `up` is idempotent: a running cluster with the same settings is reused; other settings restart the daemons. When
# it cannot start a cluster it prints ONE line saying what is missing and exits 3 (not root, no package index,
# packages unavailable, not Linux) or 1 (a daemon did not come up; the line names its log).
# Timers are short for fast turnaround (KillWait=2 s, MessageTimeout=5 s, scheduler passes every second); jobs that
# ended stay visible to `squeue --states=all` for MinJobAge seconds (--min-job-age, SLURM's default 300).
set -uo pipefail

DIR=${ZAEC_SLURM_DIR:-/tmp/zaec-slurm}
CONF=$DIR/etc/slurm.conf
DBD_CONF=$DIR/etc/slurmdbd.conf
ETC_LINK=/etc/slurm/slurm.conf
CTLD_PORT=${ZAEC_SLURM_PORT:-6817}
SLURMD_PORT=$((CTLD_PORT + 1))
DBD_PORT=$((CTLD_PORT + 2))
DB_PORT=$((CTLD_PORT + 3))
PACKAGES=(munge slurmctld slurmd slurm-client)
ACCOUNTING_PACKAGES=(slurmdbd mariadb-server)
WAIT_S=${ZAEC_SLURM_WAIT_S:-60}
export SLURM_CONF=$CONF

say() { echo "slurm_local: $*" >&2; }
cannot() { say "cannot start a SLURM cluster: $*"; exit 3; }
failed() { say "$*"; exit 1; }

missing_packages() {
    local p
    for p in "$@"; do
        dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
    done
}

install_packages() {
    # Installs what is missing (no recommends: 8 packages, ~15 s; --accounting adds ~25 packages).
    local want=("${PACKAGES[@]}") missing
    [[ ${1:-} == accounting ]] && want+=("${ACCOUNTING_PACKAGES[@]}")
    missing=$(missing_packages "${want[@]}" | tr '\n' ' ')
    [[ -z $missing ]] && return 0
    [[ ${ZAEC_SLURM_NO_INSTALL:-0} == 1 ]] &&
        cannot "packages missing: ${missing% } (as root: tools/slurm_local.sh install${1:+ --accounting};" \
            "make test does it)"
    [[ $(uname -s) == Linux ]] || cannot "not Linux ($(uname -s)); SLURM's Debian packages need Linux"
    [[ $(id -u) == 0 ]] || cannot "not root (installing ${missing% } needs root; run: sudo $0 up)"
    command -v apt-get >/dev/null || cannot "no apt-get on this machine (install ${missing% } yourself)"
    # An empty package list on a fresh machine: read the index once.
    if [[ -z $(apt-cache policy slurmctld 2>/dev/null | awk '/Candidate:/ && $2 != "(none)" {print $2}') ]]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >"$DIR/log/apt-update.log" 2>&1 ||
            cannot "no package index (apt-get update failed, see $DIR/log/apt-update.log)"
    fi
    local p
    for p in $missing; do
        [[ -n $(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/ && $2 != "(none)" {print $2}') ]] ||
            cannot "package $p unavailable from the package index (apt-cache policy $p shows no candidate)"
    done
    # policy-rc.d on these machines refuses service starts; this script starts the daemons itself.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing \
        >"$DIR/log/apt-install.log" 2>&1 ||
        cannot "apt-get install $missing failed (see $DIR/log/apt-install.log)"
}

pid_of() {  # the pid in a pid file of ours whose process still runs, else nothing
    local f=$DIR/run/$1.pid pid
    [[ -s $f ]] || return 1
    pid=$(cat "$f")
    kill -0 "$pid" 2>/dev/null && echo "$pid"
}

settings_line() {  # what the running cluster was started with; a different line means restart
    echo "accounting=$ACCOUNTING cpus=$CPUS mem=$MEM_MB min_job_age=$MIN_JOB_AGE port=$CTLD_PORT"
}

write_slurm_conf() {
    local host storage
    host=$(hostname -s)
    if [[ $ACCOUNTING == 1 ]]; then
        storage="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
    else
        storage="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
    fi
    cat >"$CONF.tmp" <<EOF
# written by tools/slurm_local.sh ($(settings_line)); a one-machine test cluster
ClusterName=zaec
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups (containers rarely allow them): processes tracked by their parent, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=256
# use the CPUs/memory written here even where they differ from what slurmd counts (--cpus)
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=100000
# fast turnaround: 2 s from SIGTERM to SIGKILL, no grace beyond the time limit, quick timeouts
KillWait=2
OverTimeLimit=0
MessageTimeout=5
SlurmdTimeout=30
SlurmctldTimeout=30
InactiveLimit=0
MinJobAge=$MIN_JOB_AGE
ReturnToService=2
JobCompType=jobcomp/none
$storage
NodeName=$host NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

link_etc_conf() {
    # /etc/slurm/slurm.conf -> ours, unless a configuration we did not write is there
    mkdir -p /etc/slurm
    if [[ -L $ETC_LINK && $(readlink "$ETC_LINK") == "$CONF" ]]; then return 0; fi
    if [[ -e $ETC_LINK || -L $ETC_LINK ]]; then
        say "note: $ETC_LINK is not ours and is left alone; commands need: export SLURM_CONF=$CONF"
        return 0
    fi
    ln -s "$CONF" "$ETC_LINK" && touch "$DIR/run/etc-link"
}

start_munge() {
    # SLURM's clients (sacct talking to slurmdbd among them) look for munge at its default socket: a munged that
    # answers there is reused (and left running by `down`); otherwise one is started there with the package's key.
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
    install -d -o munge -g munge -m 0700 "$DIR/munge"
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        install -d -o munge -g munge -m 0700 /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
        touch "$DIR/run/munge-key"
    fi
    runuser -u munge -- munged --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
        --seed-file="$DIR/munge/munged.seed" >>"$DIR/log/munged.out" 2>&1 ||
        failed "munged did not start: $(tail -1 "$DIR/log/munged.out")"
    cp "$DIR/munge/munged.pid" "$DIR/run/munged.pid"
    munge -n </dev/null | unmunge >/dev/null 2>&1 || failed "munge does not answer (see $DIR/munge/munged.log)"
}

wait_for() {  # wait_for SECONDS COMMAND...: true once COMMAND succeeds, false after SECONDS
    local deadline=$((SECONDS + $1))
    shift
    while ((SECONDS < deadline)); do
        timeout 5 "$@" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    return 1
}

start_mariadb() {
    [[ -n $(pid_of mariadbd) ]] && return 0
    local db=$DIR/db
    if [[ ! -d $db/data/mysql ]]; then
        install -d -o mysql -g mysql "$db" "$db/data"
        mariadb-install-db --user=mysql --datadir="$db/data" --auth-root-authentication-method=socket \
            --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 ||
            failed "mariadb-install-db failed (see $DIR/log/mariadb-install.log)"
    fi
    install -d -o mysql -g mysql "$db/run"
    # a private server: its own datadir, socket and port; nothing of the system's MariaDB is used
    mariadbd --no-defaults --user=mysql --datadir="$db/data" --socket="$db/run/mysqld.sock" \
        --pid-file="$db/run/mariadbd.pid" --bind-address=127.0.0.1 --port="$DB_PORT" \
        --log-error="$DIR/log/mariadb.log" --innodb-buffer-pool-size=32M --innodb-log-file-size=8M \
        --skip-name-resolve >/dev/null 2>&1 &
    echo $! >"$DIR/run/mariadbd.pid"
    wait_for "$WAIT_S" mariadb --no-defaults --socket="$db/run/mysqld.sock" -uroot -e 'select 1'
    mariadb --no-defaults --socket="$db/run/mysqld.sock" -uroot -e "
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'zaec-local';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" >>"$DIR/log/mariadb.log" 2>&1 ||
        failed "the private MariaDB server did not come up within ${WAIT_S}s (see $DIR/log/mariadb.log)"
}

start_slurmdbd() {
    [[ -n $(pid_of slurmdbd) ]] && return 0
    cat >"$DBD_CONF" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=zaec-local
StorageLoc=slurm_acct_db
EOF
    chmod 0600 "$DBD_CONF"
    slurmdbd >>"$DIR/log/slurmdbd.log" 2>&1 || failed "slurmdbd did not start (see $DIR/log/slurmdbd.log)"
    wait_for "$WAIT_S" sacctmgr -i -n list cluster || failed "slurmdbd does not answer (see $DIR/log/slurmdbd.log)"
    # the cluster and root's association must exist before slurmctld registers
    sacctmgr -i -n add cluster zaec >/dev/null 2>&1
    sacctmgr -i -n add account zaec Cluster=zaec >/dev/null 2>&1
    sacctmgr -i -n add user root Account=zaec Cluster=zaec >/dev/null 2>&1
    return 0
}

wait_node_idle() {
    local state deadline=$((SECONDS + WAIT_S))
    while ((SECONDS < deadline)); do
        state=$(timeout 5 sinfo -h -N -o '%T' 2>/dev/null | head -1)
        case $state in
            idle | mixed | allocated) return 0 ;;
            down* | drain* | fail*) scontrol update NodeName="$(hostname -s)" State=RESUME >/dev/null 2>&1 ;;
        esac
        sleep 0.5
    done
    failed "the node is not idle after ${WAIT_S}s (sinfo: ${state:-no answer}; see $DIR/log/slurmctld.log," \
        "slurmd.log)"
}

stop_pid() {  # stop one daemon of ours by its pid file, SIGKILL after 10 s
    local name=$1 pid i
    pid=$(pid_of "$name") || { rm -f "$DIR/run/$name.pid"; return 0; }
    kill "$pid" 2>/dev/null
    for ((i = 0; i < 20; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
    rm -f "$DIR/run/$name.pid"
}

cmd_down() {
    [[ -d $DIR/run ]] || { say "no cluster of this script at $DIR"; return 0; }
    # jobs first (their processes are children of slurmstepd, which outlives slurmd)
    [[ -n $(pid_of slurmctld) ]] && scancel --full --quiet --user=root >/dev/null 2>&1
    local d
    for d in slurmd slurmctld slurmdbd mariadbd; do stop_pid "$d"; done
    pkill_steps
    stop_pid munged
    if [[ -f $DIR/run/etc-link && -L $ETC_LINK ]]; then rm -f "$ETC_LINK" "$DIR/run/etc-link"; fi
    rm -f "$DIR/run/settings"
    say "down (logs kept in $DIR/log)"
}

pkill_steps() {
    # slurmstepd processes of our spool (a job cancelled as the daemons stop), found by their spool path
    local pid
    for pid in $(pgrep -x slurmstepd 2>/dev/null); do
        grep -qa "$DIR" "/proc/$pid/environ" "/proc/$pid/cmdline" 2>/dev/null && kill -9 "$pid" 2>/dev/null
    done
    return 0
}

cmd_status() {
    local settings
    settings=$(cat "$DIR/run/settings" 2>/dev/null)
    if [[ -n $(pid_of slurmctld) && -n $(pid_of slurmd) ]]; then
        echo "up: $settings; node $(sinfo -h -N -o '%N %T %c CPUs %m MB' 2>/dev/null | head -1); SLURM_CONF=$CONF"
    else
        echo "down ($DIR)"
        return 1
    fi
}

cmd_up() {
    ACCOUNTING=0
    CPUS=$(nproc)
    MIN_JOB_AGE=300
    while [[ $# -gt 0 ]]; do
        case $1 in
            --accounting) ACCOUNTING=1 ;;
            --no-accounting) ACCOUNTING=0 ;;
            --cpus) CPUS=$2; shift ;;
            --min-job-age) MIN_JOB_AGE=$2; shift ;;
            *) say "unknown option '$1' of up; valid: --accounting, --no-accounting, --cpus N, --min-job-age S"
               exit 2 ;;
        esac
        shift
    done
    [[ $(uname -s) == Linux ]] || cannot "not Linux ($(uname -s))"
    [[ $(id -u) == 0 ]] || cannot "not root (the daemons run as root here; run: sudo $0 up)"
    # 90% of the memory, in MB: slurmd drains a node that has less than its RealMemory
    MEM_MB=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
    mkdir -p "$DIR"/{etc,run,log,state,spool}
    local running
    running=$(cat "$DIR/run/settings" 2>/dev/null)
    if [[ -n $(pid_of slurmctld) && -n $(pid_of slurmd) && $running == "$(settings_line)" ]]; then
        wait_node_idle
        link_etc_conf
        echo "slurm_local: reusing the running cluster ($running)"
        return 0
    fi
    local mode=accounting
    [[ $ACCOUNTING == 1 ]] || mode=""
    install_packages "$mode"
    stop_pid slurmd
    stop_pid slurmctld
    [[ $ACCOUNTING == 1 ]] || stop_pid slurmdbd
    write_slurm_conf
    link_etc_conf
    start_munge
    if [[ $ACCOUNTING == 1 ]]; then start_mariadb; start_slurmdbd; fi
    # -i: a state file from an older run that does not fit this configuration is ignored, not fatal
    slurmctld -i -f "$CONF" >>"$DIR/log/slurmctld.log" 2>&1 ||
        failed "slurmctld did not start (see $DIR/log/slurmctld.log)"
    wait_for "$WAIT_S" bash -c 'scontrol ping | grep -q UP' ||
        failed "slurmctld does not answer (see $DIR/log/slurmctld.log)"
    slurmd -f "$CONF" >>"$DIR/log/slurmd.log" 2>&1 || failed "slurmd did not start (see $DIR/log/slurmd.log)"
    settings_line >"$DIR/run/settings"
    wait_node_idle
    echo "slurm_local: up: $(settings_line); $(sinfo -h -N -o 'node %N %T, %c CPUs, %m MB' | head -1)"
}

case ${1:-} in
    up) shift; cmd_up "$@" ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    install)
        mkdir -p "$DIR/log" 2>/dev/null || DIR=$(mktemp -d)
        mkdir -p "$DIR/log"
        start=$SECONDS
        install_packages ""  # the cluster first: without accounting's packages the other tests still run
        [[ ${2:-} == --accounting ]] && install_packages accounting
        echo "slurm_local: packages present ($((SECONDS - start)) s): ${PACKAGES[*]}${2:+ ${ACCOUNTING_PACKAGES[*]}}" ;;
    *) echo "usage: $0 up [--accounting] [--cpus N] [--min-job-age S] | down | status | env |" \
            "install [--accounting]" >&2
       exit 2 ;;
esac
