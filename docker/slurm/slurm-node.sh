#!/bin/bash
# One node of compose/slurm.yml's cluster: `slurm-node controller`, `slurm-node compute`, or
# `slurm-node submit` (waits for the nodes, submits $SBATCH_SCRIPT $EXPERIMENT with
# $SBATCH_ARGS as user ddplab through `sbatch --wait`, prints the job's output, exits with
# the job's code).
# Writes slurm.conf for SLURM_NODES (e.g. "node[1-2]") with SLURM_CPUS CPUs each, shares one
# MUNGE key per cluster through /munge-shared (made by the controller at its first start),
# starts munged, then the Slurm daemon in the foreground.
set -euo pipefail
role=${1:-compute}
nodes=${SLURM_NODES:-node[1-2]}
cpus=${SLURM_CPUS:-2}
memory_mb=${SLURM_MEMORY_MB:-4000}

cat > /etc/slurm/slurm.conf <<CONF
ClusterName=ddplab
SlurmctldHost=slurmctld
AuthType=auth/munge
SlurmUser=slurm
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# Containers have no systemd or cgroup delegation: track job processes by their parent pids.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# The nodes are containers: take the CPU count below, not what the host shows.
SlurmdParameters=config_overrides
# A node that stops answering is DOWN after this long, and its jobs end (ddplab's run FAILED).
SlurmdTimeout=30
KillWait=10
# A job whose node fails ends (NODE_FAIL) instead of waiting in the queue for the node, so
# sbatch --wait returns. Sites that requeue (Slurm's default) get the job started again,
# and ddplab resumes it from its last checkpoint into the same run (checkpoint.resume auto).
JobRequeue=0
# sbatch --wait (the submit service, a study's slurm variants) polls the controller after 2 s,
# then 8 s, then every 32 s, unless finished jobs are purged sooner (its poll stays under half
# MinJobAge, 300 s by default): a 25 s job was seen ending at 42 s. At 16 s it polls every 8 s.
MinJobAge=16
NodeName=${nodes} CPUs=${cpus} RealMemory=${memory_mb} State=UNKNOWN
PartitionName=cpu Nodes=${nodes} Default=YES MaxTime=INFINITE State=UP
CONF

key=/munge-shared/munge.key
if [ "$role" = controller ] && [ ! -s "$key" ]; then
  # One key per cluster, made here and never baked into an image.
  dd if=/dev/urandom of="$key.tmp" bs=1024 count=1 status=none
  mv "$key.tmp" "$key"
fi
for _ in $(seq 1 60); do [ -s "$key" ] && break; sleep 1; done
[ -s "$key" ] || { echo "slurm-node: no MUNGE key in /munge-shared after 60 s" >&2; exit 1; }
install -o munge -g munge -m 0400 "$key" /etc/munge/munge.key
runuser -u munge -- /usr/sbin/munged

submit() {
  local want waited=0
  want=$(scontrol show hostnames "$nodes" | wc -l)
  until [ "$(sinfo -h -t idle,mix,alloc -o '%D' 2>/dev/null | awk '{s+=$1} END {print s+0}')" -ge "$want" ]; do
    if [ "$waited" -ge "${SLURM_WAIT_S:-180}" ]; then
      echo "slurm-node: the $want nodes did not come up within ${SLURM_WAIT_S:-180} s:" >&2
      sinfo -N >&2 || true
      exit 1
    fi
    sleep 2; waited=$((waited + 2))
  done
  # SBATCH_ARGS is split into words on purpose: "--nodes 2 --ntasks-per-node 2".
  local args
  read -r -a args <<< "${SBATCH_ARGS:-}"
  set -- "${args[@]}" "${SBATCH_SCRIPT:-slurm/cpu.sbatch}" "${EXPERIMENT:-experiments/quickstart.yaml}"
  echo "slurm-node: $want nodes up ($(sinfo -h -o '%N %T' | tr '\n' ' ')); submitting as ddplab: sbatch --wait $*"
  cd /workspace
  local code=0
  runuser -u ddplab -- sbatch --wait --parsable --output=/jobs/ddplab-%j.out "$@" > /tmp/job || code=$?
  local job; job=$(cut -d';' -f1 /tmp/job)
  echo "slurm-node: job ${job:-?} ended with exit code $code; its output (/jobs/ddplab-${job:-?}.out):"
  cat "/jobs/ddplab-${job}.out" 2>/dev/null || true
  exit "$code"
}

case "$role" in
  controller) exec /usr/sbin/slurmctld -D -i ;;
  compute) exec /usr/sbin/slurmd -D -N "$(hostname)" ;;
  submit) submit ;;
  *) echo "slurm-node: unknown role '$role' (controller, compute or submit)" >&2; exit 2 ;;
esac
