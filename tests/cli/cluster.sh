#!/usr/bin/env bash
# A real one-host Slurm cluster (CTest label "cluster"; docs/SCALE.md). As root,
# starts munged, slurmctld and slurmd from Debian's packages (scripts/setup
# installs them) with a generated munge key and slurm.conf (one node, 2 CPUs,
# proctrack/linuxproc, task/none, no systemd), then with the real SmolLM2 model:
#  1. sbatch --array=0-3: kvzip-ingest --shard over 5 sample documents into four
#     stores; every task completes; merge; verify; the merged ids are the corpus
#     listing; a needle question is answered from the merged store.
#  2. the same array into fresh stores, scancel of task 2 mid-run (after its first
#     document committed): its store is consistent and incomplete; sbatch
#     --array=2 again: the rerun skips the stored document and ingests the rest;
#     merge; verify; the final store equals phase 1's (ids and content hashes).
# Stops its daemons at the end. Skips (exit 77, "SKIP:" line) when not root or
# when the Slurm / munge binaries are missing.
skip() { echo "SKIP: $*"; exit 77; }
[ "$(id -u)" -eq 0 ] || skip "the Slurm test runs as root only (it starts munged, slurmctld, slurmd)"
for b in munged munge slurmctld slurmd sbatch squeue scancel scontrol; do
  command -v "$b" >/dev/null || skip "$b missing (scripts/setup installs slurmctld slurmd slurm-client munge)"
done
source "$(dirname "$0")/lib.bash"

pids=()
stop_cluster() {
  [ -n "${SLURM_CONF:-}" ] && scancel --quiet --user=root 2>/dev/null
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  [ -f "$T/munge/munged.pid" ] && kill "$(cat "$T/munge/munged.pid")" 2>/dev/null
  pids=()
}
trap 'stop_cluster; jobs -p | xargs -r kill -9 2>/dev/null; rm -rf "$T"' EXIT

# ---- the cluster ----
mkdir -p "$T/munge" "$T/state" "$T/spool" "$T/log"
chmod 711 "$T" "$T/munge"
dd if=/dev/urandom of="$T/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$T/munge/munge.key"
SOCK="$T/munge/munge.sock"
munged -f --key-file="$T/munge/munge.key" --socket="$SOCK" --pid-file="$T/munge/munged.pid" \
  --seed-file="$T/munge/seed" --log-file="$T/log/munged.log" || { bad "munged did not start"; finish; }
HOST=$(hostname -s)
PORT=$((20000 + RANDOM % 20000))
export SLURM_CONF="$T/slurm.conf"
cat >"$SLURM_CONF" <<EOF
ClusterName=kvztest
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$SOCK
CredType=cred/munge
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/log/slurmctld.log
SlurmdLogFile=$T/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MinJobAge=3600
KillWait=5
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=kvz Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
slurmctld -D -f "$SLURM_CONF" >"$T/log/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -N "$HOST" -f "$SLURM_CONF" >"$T/log/slurmd.out" 2>&1 &
pids+=($!)
up=0
for _ in $(seq 1 60); do
  if sinfo -h -o '%t' 2>/dev/null | grep -q idle; then up=1; break; fi
  sleep 1
done
if [ "$up" -ne 1 ]; then
  bad "the Slurm node did not come up: $(tail -3 "$T/log/slurmctld.log" "$T/log/slurmd.log" 2>&1)"
  finish
fi
echo "slurm: $(sinfo -h -o '%P %D nodes %c CPUs %t') (port $PORT)"

# ---- corpus and job ----
C="$T/corpus"
mkdir -p "$C"
for f in lab_b214_safety_sop orrery_onboarding_guide halcyon_warranty_returns stratadb_tuning_guide \
         corvid_cr8_router_guide; do
  cp "$SRC/samples/$f.md" "$C/"
done
"$ING" --list "$C" | sort >"$T/all"
# --shards 4: a resubmitted single index (SLURM_ARRAY_TASK_COUNT=1) stays shard I of 4
cat >"$T/job.sh" <<EOF
#!/bin/bash
exec "$ING" --shards 4 --threads 1 --store "\$1/shard\$SLURM_ARRAY_TASK_ID" "$C"
EOF
chmod +x "$T/job.sh"
idhash() { "$STO" --store "$1" ls --json | python3 -c '
import json, sys
for d in sorted(json.load(sys.stdin)["docs"], key=lambda d: d["id"]): print(d["id"], d["hash"])'; }
# wait_job JOBID SECONDS: until no task of the job is pending or running
wait_job() {
  local t
  for t in $(seq 1 "$2"); do
    [ -z "$(squeue -h -j "$1" 2>/dev/null)" ] && return 0
    sleep 1
  done
  bad "job $1 still running after $2 s: $(squeue -h -j "$1")"
  return 1
}
# task_state JOBID INDEX -> "STATE EXITCODE" of that array task
task_state() {
  scontrol -o show job "$1" | grep -E "ArrayTaskId=$2( |$)" |
    sed -n 's/.*JobState=\([A-Z_]*\).*ExitCode=\([0-9:]*\).*/\1 \2/p' | head -1
}

# ---- 1. four array tasks, merge, verify, a question ----
P1="$T/p1"
mkdir -p "$P1"
t0=$(now)
j1=$(sbatch --parsable --array=0-3 --cpus-per-task=1 -o "$P1/task-%a.log" "$T/job.sh" "$P1") || bad "sbatch"
wait_job "$j1" 900
t1=$(now)
echo "phase 1: array job $j1 done in $(secs "$t0" "$t1") s"
for i in 0 1 2 3; do
  st=$(task_state "$j1" $i)
  check "task $i: COMPLETED 0:0 (got '$st'; $(tail -1 "$P1/task-$i.log" 2>/dev/null))" test "$st" = "COMPLETED 0:0"
done
"$STO" merge "$P1"/shard0 "$P1"/shard1 "$P1"/shard2 "$P1"/shard3 --into "$T/merged1" --quiet >"$T/m1" 2>"$T/m1err" \
  || bad "merge phase 1: $(cat "$T/m1err")"
cat "$T/m1"
verify_ok "merged phase 1" "$T/merged1"
check "merged ids = the corpus listing" cmp -s "$T/all" <(idhash "$T/merged1" | cut -d' ' -f1)

# ---- 2. cancel one task mid-run, resubmit it ----
P2="$T/p2"
mkdir -p "$P2"
n2=$("$ING" --list --shard 2/4 "$C" 2>/dev/null | wc -l)
check "shard 2 holds 2 documents (the cancel target)" test "$n2" -eq 2
j2=$(sbatch --parsable --array=0-3 --cpus-per-task=1 -o "$P2/task-%a.log" "$T/job.sh" "$P2") || bad "sbatch 2"
cancelled=0
for _ in $(seq 1 1800); do
  if [ -e "$P2/shard2/data.mdb" ] && [ "$(ndocs "$P2/shard2" 2>/dev/null)" = 1 ]; then
    scancel "${j2}_2" && cancelled=1
    break
  fi
  [ -z "$(squeue -h -j "$j2" 2>/dev/null)" ] && break
  sleep 0.5
done
check "task 2 cancelled after its first document" test "$cancelled" -eq 1
wait_job "$j2" 900
st=$(task_state "$j2" 2)
check "task 2: CANCELLED (got '$st')" test "${st%% *}" = "CANCELLED"
for i in 0 1 3; do
  st=$(task_state "$j2" $i)
  check "phase 2 task $i: COMPLETED 0:0 (got '$st')" test "$st" = "COMPLETED 0:0"
done
verify_ok "cancelled task's store" "$P2/shard2"
check "cancelled task's store: 1 of 2 documents" test "$(ndocs "$P2/shard2")" = 1
j3=$(sbatch --parsable --array=2 --cpus-per-task=1 -o "$P2/rerun-%a.log" "$T/job.sh" "$P2") || bad "sbatch 3"
wait_job "$j3" 900
st=$(task_state "$j3" 2)
check "resubmitted task 2: COMPLETED 0:0 (got '$st')" test "$st" = "COMPLETED 0:0"
sed 's/^/  rerun: /' "$P2/rerun-2.log"
check "rerun: the stored document is skipped" grep -q "^unchanged *halcyon_warranty_returns.md" "$P2/rerun-2.log"
check "rerun: the rest is ingested" grep -q "^ingested *stratadb_tuning_guide.md" "$P2/rerun-2.log"
"$STO" merge "$P2"/shard0 "$P2"/shard1 "$P2"/shard2 "$P2"/shard3 --into "$T/final" --quiet >"$T/m2" 2>"$T/m2err" \
  || bad "merge phase 2: $(cat "$T/m2err")"
cat "$T/m2"
verify_ok "final store" "$T/final"
check "final store == phase 1's merged store (ids and content hashes)" cmp -s <(idhash "$T/merged1") <(idhash "$T/final")
check "final store: 5 documents" test "$(ndocs "$T/final")" = 5

# ---- a needle question from the final store ----
Q="Who is the laboratory supervisor of B-214?"   # samples/questions.jsonl: accept "Marwood"
"$QRY" --store "$T/final" --doc lab_b214_safety_sop.md --threads 2 "$Q" >"$T/ans" 2>"$T/qerr" || bad "query: $(cat "$T/qerr")"
echo "Q: $Q"
echo "A: $(cat "$T/ans")"
check "needle answered from the merged store (Marwood)" grep -q "Marwood" "$T/ans"

stop_cluster
check "daemons stopped" test -z "$(for p in $(cat "$T/slurmctld.pid" "$T/slurmd.pid" 2>/dev/null); do kill -0 "$p" 2>/dev/null && echo "$p"; done)"
finish
