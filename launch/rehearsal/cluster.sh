#!/usr/bin/env bash
# A real Slurm cluster on one Linux box, to rehearse (and test) multi-node rlvla3 runs.
#
# Every node is a Linux network namespace with its own 10.x address on a private bridge; the
# bridge lives in a controller namespace of its own, so nothing touches the host's network.
# One slurmctld (in the controller namespace) and one slurmd per node namespace run from the
# Debian packages (slurmctld slurmd slurm-client munge) with a config written into DIR; one
# munged, reached over a unix socket, authenticates them all.
#
#   sudo launch/rehearsal/cluster.sh up            # 3 nodes: node1..node3 (10.77.0.11-13)
#   sudo launch/rehearsal/cluster.sh up --no-slurm # the network alone (plain hosts: --node)
#   sudo launch/rehearsal/cluster.sh sbatch --nodes=3 launch/slurm.sbatch launch/cartpole_3nodes.yaml
#   sudo launch/rehearsal/cluster.sh squeue
#   sudo launch/rehearsal/cluster.sh exec node2 ip addr     # a command on one node
#   sudo launch/rehearsal/cluster.sh cut node3 / heal node3 # take a node's link down / up
#   sudo launch/rehearsal/cluster.sh down          # stop everything, remove the namespaces
#
# Settings (environment): RLVLA3_CLUSTER_NODES (3), RLVLA3_CLUSTER_DIR (/tmp/rlvla3-cluster:
# config, logs, state), RLVLA3_CLUSTER_PREFIX (rlv: namespace and interface names),
# RLVLA3_CLUSTER_NET (10.77.0: the /24 the nodes live on). Needs root and iproute2.
set -euo pipefail

NODES=${RLVLA3_CLUSTER_NODES:-3}
PREFIX=${RLVLA3_CLUSTER_PREFIX:-rlv}
DIR=${RLVLA3_CLUSTER_DIR:-/tmp/rlvla3-cluster-$PREFIX}
NET=${RLVLA3_CLUSTER_NET:-10.77.0}
CTL_NS="${PREFIX}-ctl"
CTL_ADDR="${NET}.1"

node_ns() { echo "${PREFIX}-node$1"; }
node_addr() { echo "${NET}.$((10 + $1))"; }
node_index() {  # node name (node2) -> 2
    local n=${1#node}
    [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= NODES)) || { echo "no node named $1" >&2; exit 2; }
    echo "$n"
}
slurm_env() { echo "SLURM_CONF=$DIR/etc/slurm.conf"; }
die() { echo "cluster.sh: $*" >&2; exit 1; }

check_tools() {
    [[ $(id -u) == 0 ]] || die "needs root (network namespaces, slurmd)"
    local missing=()
    for tool in ip slurmctld slurmd sbatch munged munge; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    ((${#missing[@]} == 0)) || die "missing ${missing[*]}: apt-get install slurmctld slurmd slurm-client munge iproute2"
}

own_state_dir() {  # the munge key and slurm.conf live here: nobody else may plant or read them
    if [[ -e $DIR ]]; then
        [[ -d $DIR && ! -L $DIR && $(stat -c %u "$DIR") == 0 ]] || die "$DIR is not root's own directory"
        (( (8#$(stat -c %a "$DIR") & 8#022) == 0 )) || die "$DIR is writable by others"
    else
        mkdir -p -m 755 "$DIR"
    fi
}

write_config() {
    local ctl_name
    ctl_name=$(hostname -s)  # slurmctld insists that SlurmctldHost names the host it runs on
    own_state_dir
    mkdir -p "$DIR"/{etc,state,spool,run,log,munge-key,munge}
    chmod 700 "$DIR/munge-key"
    chmod 755 "$DIR/munge"  # munged wants its socket's directory searchable by all
    if [[ ! -f $DIR/munge-key/munge.key ]]; then
        head -c 1024 /dev/urandom >"$DIR/munge-key/munge.key"
        chmod 400 "$DIR/munge-key/munge.key"
    fi
    local cpus mem
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / NODES ))
    {
        echo "ClusterName=rlvla3rehearsal"
        echo "SlurmctldHost=${ctl_name}(${CTL_ADDR})"
        echo "AuthType=auth/munge"
        echo "AuthInfo=socket=$DIR/munge/munge.socket"
        echo "CredType=cred/munge"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "StateSaveLocation=$DIR/state"
        echo "SlurmdSpoolDir=$DIR/spool/%n"
        echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
        echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
        echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
        echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "MpiDefault=none"
        echo "SwitchType=switch/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "SchedulerType=sched/backfill"
        echo "SelectType=select/linear"
        echo "ReturnToService=2"
        echo "SlurmdParameters=config_overrides"
        echo "SlurmdTimeout=30"
        echo "KillWait=10"
        for i in $(seq 1 "$NODES"); do
            echo "NodeName=node$i NodeAddr=$(node_addr "$i") CPUs=$cpus RealMemory=$mem State=UNKNOWN"
        done
        echo "PartitionName=rehearsal Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP"
    } >"$DIR/etc/slurm.conf"
    # `ip netns exec` remounts /sys, so slurmd would not find the cgroup v2 tree: v1 with the
    # plain process tracker needs none.
    printf 'CgroupPlugin=cgroup/v1\nIgnoreSystemd=yes\n' >"$DIR/etc/cgroup.conf"
}

write_hosts() {  # each namespace sees every node's name (ip netns exec bind-mounts these)
    local ns
    for ns in "$CTL_NS" $(for i in $(seq 1 "$NODES"); do node_ns "$i"; done); do
        mkdir -p "/etc/netns/$ns"
        {
            echo "127.0.0.1 localhost"
            echo "$CTL_ADDR ${PREFIX}-ctl"
            for i in $(seq 1 "$NODES"); do echo "$(node_addr "$i") node$i"; done
        } >"/etc/netns/$ns/hosts"
    done
}

make_network() {
    ip netns add "$CTL_NS"
    ip -n "$CTL_NS" link set lo up
    ip -n "$CTL_NS" link add br0 type bridge
    ip -n "$CTL_NS" addr add "$CTL_ADDR/24" dev br0
    ip -n "$CTL_NS" link set br0 up
    local i ns
    for i in $(seq 1 "$NODES"); do
        ns=$(node_ns "$i")
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip link add "${PREFIX}n${i}a" type veth peer name "${PREFIX}n${i}b"
        ip link set "${PREFIX}n${i}a" netns "$ns"
        ip -n "$ns" link set "${PREFIX}n${i}a" name eth0
        ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip link set "${PREFIX}n${i}b" netns "$CTL_NS"
        ip -n "$CTL_NS" link set "${PREFIX}n${i}b" master br0 up
    done
}

start_daemons() {
    munged --force --key-file="$DIR/munge-key/munge.key" --socket="$DIR/munge/munge.socket" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge-key/munged.seed"
    ip netns exec "$CTL_NS" env "$(slurm_env)" slurmctld -c -i
    local i
    for i in $(seq 1 "$NODES"); do
        ip netns exec "$(node_ns "$i")" env "$(slurm_env)" slurmd -N "node$i"
    done
    local deadline=$((SECONDS + 60)) idle=0
    while ((SECONDS < deadline)); do
        # (slurmctld may not answer yet: sinfo failing is no reason to give up)
        idle=$(ip netns exec "$CTL_NS" env "$(slurm_env)" sinfo -h -t idle -o '%D' 2>/dev/null | awk '{s+=$1} END {print s+0}' || true)
        ((idle == NODES)) && break
        sleep 0.5
    done
    if ((idle != NODES)); then
        tail -20 "$DIR"/log/*.log >&2
        cmd_down >&2
        die "only $idle of $NODES nodes came up"
    fi
}

cmd_up() {
    local slurm=1
    [[ ${1:-} == --no-slurm ]] && slurm=0
    [[ $(id -u) == 0 ]] || die "needs root (network namespaces, slurmd)"
    ((slurm == 0)) || check_tools
    ip netns list | grep -q "^$CTL_NS\b" && die "a cluster named $PREFIX is up already (cluster.sh down first)"
    trap 'echo "cluster.sh: up failed; taking down what was made" >&2; cmd_down >&2' ERR
    write_config
    write_hosts
    make_network
    ((slurm == 0)) || start_daemons
    trap - ERR
    echo "cluster up: controller ${CTL_NS} ($CTL_ADDR), nodes node1..node$NODES ($(node_addr 1)..), state in $DIR"
    if ((slurm)); then
        echo "submit with: $0 sbatch --nodes=$NODES launch/slurm.sbatch CONFIG.yaml"
    else
        echo "run a node with: $0 exec node1 rlvla3 launch CONFIG.yaml --node NAME"
    fi
}

kill_pidfile() {
    local f=$1
    [[ -f $f ]] || return 0
    kill "$(cat "$f")" 2>/dev/null || true
}

cmd_down() {
    [[ $(id -u) == 0 ]] || die "needs root"
    if [[ -f $DIR/etc/slurm.conf ]] && ip netns list | grep -q "^$CTL_NS\b"; then
        ip netns exec "$CTL_NS" env "$(slurm_env)" scancel --full --quiet --partition=rehearsal 2>/dev/null || true
    fi
    local i ns
    for f in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid" "$DIR/run/munged.pid"; do kill_pidfile "$f"; done
    # whatever still runs inside the namespaces (jobs, daemons) goes too
    for ns in "$CTL_NS" $(for i in $(seq 1 "$NODES"); do node_ns "$i"; done); do
        if ip netns list | grep -q "^$ns\b"; then
            ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
            ip netns del "$ns" 2>/dev/null || true
        fi
        rm -rf "/etc/netns/$ns"
    done
    for i in $(seq 1 "$NODES"); do ip link del "${PREFIX}n${i}b" 2>/dev/null || true; done
    pkill -f -- "--socket=$DIR/munge/munge.socket" 2>/dev/null || true
    echo "cluster $PREFIX down"
}

in_ctl() { exec ip netns exec "$CTL_NS" env "$(slurm_env)" "$@"; }

case ${1:-} in
    up) cmd_up "${2:-}" ;;
    down) cmd_down ;;
    sbatch | squeue | sinfo | scancel | scontrol | srun | sacct) in_ctl "$@" ;;
    exec)
        i=$(node_index "${2:?usage: cluster.sh exec NODE CMD...}")
        shift 2
        exec ip netns exec "$(node_ns "$i")" env "$(slurm_env)" "$@"
        ;;
    cut | heal)
        i=$(node_index "${2:?usage: cluster.sh $1 NODE}")
        state=$([[ $1 == cut ]] && echo down || echo up)
        ip -n "$CTL_NS" link set "${PREFIX}n${i}b" "$state"
        echo "node$i link $state"
        ;;
    env) echo "export $(slurm_env)" ;;
    *) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac
