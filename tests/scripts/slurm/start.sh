#!/bin/bash
# Start a throw-away Slurm 22.05 cluster on this one host (Debian 12, run as root, no systemd).
# From the project's tested recipe (notes/slurm/start.sh); CTLD_PORT added so that test runs beside
# each other do not share a controller port.
#   NNODES=4 ./start.sh        -> nodes n1..n4, one slurmd each (ports 17001..), all on 127.0.0.1
# Needs: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge
# Afterwards: export SLURM_CONF=$BASE/slurm.conf ; sinfo ; srun ... ; ./stop.sh
set -euo pipefail
BASE=${BASE:-${TMPDIR:-/tmp}/slurm-local}
NNODES=${NNODES:-2}
CPUS=${CPUS:-$(nproc)}          # CPUs advertised per node (each fake node claims all real cores; more than nproc untested)
PORT0=${PORT0:-17000}
CTLD_PORT=${CTLD_PORT:-6817}
ADD_HOSTS=${ADD_HOSTS:-1}       # make n1..nN resolvable (MASTER_ADDR=$(scontrol show hostnames ... | head -1))

T0=$(date +%s.%N)
[ "${KEEP_STATE:-0}" = 1 ] || rm -rf "$BASE/state"   # fresh cluster: no jobs, no drains from an earlier run
mkdir -p "$BASE"/{state/ctld,log,run}
for i in $(seq 1 "$NNODES"); do mkdir -p "$BASE/state/d/n$i"; done

# ---- slurm.conf -------------------------------------------------------------
cat > "$BASE/slurm.conf" <<EOF
ClusterName=test
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again only after the credentials of its previous run expire (Slurm
# holds it cred_expire + 1 s; 120 s by default): short here so the requeue tests need not force it.
AuthInfo=cred_expire=10
StateSaveLocation=$BASE/state/ctld
SlurmdSpoolDir=$BASE/state/d/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# A requeued job whose BeginTime has passed starts at the next scheduling pass: every second here,
# not backfill's default 30 s (the requeue tests waited ~17 s each for it).
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=10
InactiveLimit=0
MinJobAge=30
KillWait=5
Waittime=0
SlurmctldDebug=info
SlurmdDebug=info
EOF
for i in $(seq 1 "$NNODES"); do
  echo "NodeName=n$i NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$((PORT0 + i)) CPUs=$CPUS RealMemory=1000 State=UNKNOWN" >> "$BASE/slurm.conf"
done
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$BASE/slurm.conf"
export SLURM_CONF=$BASE/slurm.conf

if [ "$ADD_HOSTS" = 1 ]; then
  missing=$(for i in $(seq 1 "$NNODES"); do getent hosts "n$i" >/dev/null || printf 'n%s ' "$i"; done)
  [ -z "$missing" ] || echo "127.0.0.1 $missing" >> /etc/hosts
fi

# ---- munge (key is created by the Debian package's postinst) -----------------
[ -s /etc/munge/munge.key ] || { mungekey -c -k /etc/munge/munge.key; chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
if ! munge -n >/dev/null 2>&1; then
  setpriv --reuid munge --regid munge --init-groups /usr/sbin/munged   # daemonizes, pid in /run/munge/munged.pid
  for _ in $(seq 1 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
  cp /run/munge/munged.pid "$BASE/run/munged.pid"
fi

# ---- slurmctld + one slurmd per node (foreground daemons, backgrounded here) --
nohup /usr/sbin/slurmctld -D -f "$SLURM_CONF" > "$BASE/log/slurmctld.out" 2>&1 &
echo $! > "$BASE/run/slurmctld.bgpid"
for i in $(seq 1 "$NNODES"); do
  nohup /usr/sbin/slurmd -D -N "n$i" -f "$SLURM_CONF" > "$BASE/log/slurmd-n$i.out" 2>&1 &
  echo $! > "$BASE/run/slurmd-n$i.bgpid"
done

# ---- wait until every node is idle -------------------------------------------
for _ in $(seq 1 150); do
  idle=$(sinfo -h -N -o '%T' 2>/dev/null | grep -cx idle || true)   # exactly "idle": registered, not drained
  [ "$idle" -ge "$NNODES" ] && break
  sleep 0.2
done
sinfo
echo "cluster up ($idle/$NNODES nodes idle) in $(echo "$(date +%s.%N) - $T0" | bc) s; export SLURM_CONF=$SLURM_CONF"
[ "$idle" -ge "$NNODES" ]
