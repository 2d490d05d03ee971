#!/usr/bin/env bash
# Scale-out without a scheduler (docs/SCALE.md), real model, tiny documents:
#  - --list: the 4 shards partition the corpus; bad shard specs are one-line errors
#  - 4 shard stores merged == one single-process ingest (same ids, same content
#    hashes, everything verifies); a second merge writes nothing
#  - merge links a hash DST already has; refuses: conflicts (lists them, writes
#    nothing), another model, DST among the sources, mixed corpus listings;
#    --prefer newest; a blob that does not verify is skipped and reported
#  - kill -9 during a merge, then a rerun: complete and consistent
#  - snapshot while an ingest writes: a consistent store; non-empty target refused
#  - --workers 2 --device cpu: the same store as one process; both workers worked
source "$(dirname "$0")/lib.bash"

D="$T/corpus"
tiny_docs "$D" 8
# ids and content hashes of a store, one "id hash" per line, sorted
idhash() { "$STO" --store "$1" ls --json | python3 -c '
import json, sys
for d in sorted(json.load(sys.stdin)["docs"], key=lambda d: d["id"]): print(d["id"], d["hash"])'; }

# ---- shard lists: a partition of the unsharded list ----
"$ING" --list "$D" | sort >"$T/all"
: >"$T/union"
for i in 0 1 2 3; do
  "$ING" --list --shard $i/4 "$D" 2>/dev/null | sort >"$T/list$i"
  cat "$T/list$i" >>"$T/union"
done
check "--list: 8 documents" test "$(wc -l <"$T/all")" -eq 8
check "--list: shards 0..3 together = the corpus, each id once" cmp -s "$T/all" <(sort "$T/union")
check "--list: env SLURM_ARRAY_TASK_ID=2 + SLURM_ARRAY_TASK_COUNT=4 = --shard 2/4" \
  cmp -s "$T/list2" <(SLURM_ARRAY_TASK_ID=2 SLURM_ARRAY_TASK_COUNT=4 "$ING" --list "$D" 2>/dev/null | sort)
check "--list: env JOB_COMPLETION_INDEX=3 + --shards 4 = --shard 3/4" \
  cmp -s "$T/list3" <(JOB_COMPLETION_INDEX=3 "$ING" --shards 4 --list "$D" 2>/dev/null | sort)
check "--list: resubmitted index (SLURM_ARRAY_TASK_COUNT=1) + --shards 4 = --shard 1/4" \
  cmp -s "$T/list1" <(SLURM_ARRAY_TASK_ID=1 SLURM_ARRAY_TASK_COUNT=1 "$ING" --shards 4 --list "$D" 2>/dev/null | sort)

echo "bad input:"
expect_err "--shard 4/4" 2 "shard index 4 is out of range for 4 shards" "$ING" --shard 4/4 "$D"
expect_err "--shard x/2" 2 "expects I/N" "$ING" --shard x/2 "$D"
expect_err "--shard 0/0" 2 "shard count must be" "$ING" --shard 0/0 "$D"
expect_err "SLURM_ARRAY_TASK_ID alone" 2 "SLURM_ARRAY_TASK_COUNT is not" env SLURM_ARRAY_TASK_ID=1 "$ING" "$D"
expect_err "SLURM_ARRAY_TASK_COUNT alone" 2 "SLURM_ARRAY_TASK_ID is not" env SLURM_ARRAY_TASK_COUNT=4 "$ING" "$D"
expect_err "JOB_COMPLETION_INDEX, no --shards" 2 "--shards N is not" env JOB_COMPLETION_INDEX=1 "$ING" "$D"
expect_err "SLURM_ARRAY_TASK_ID=4 of 4" 2 "out of range for 4 shards" env SLURM_ARRAY_TASK_ID=4 SLURM_ARRAY_TASK_COUNT=4 "$ING" "$D"
expect_err "--device cuda:x" 2 "--device expects" "$ING" --device cuda:x "$D"

# ---- single process vs 4 shards + merge ----
"$ING" --quiet --store "$T/one" "$D" || bad "single-process ingest"
for i in 0 1 2 3; do
  "$ING" --quiet --shard $i/4 --store "$T/s$i" "$D" || bad "shard $i/4 ingest"
done
"$STO" merge "$T/s0" "$T/s1" "$T/s2" "$T/s3" --into "$T/m" >"$T/mout" 2>"$T/merr" || bad "merge: $(cat "$T/merr")"
cat "$T/mout"
check "merge: 8 copied" grep -q "8 copied, 0 linked" "$T/mout"
check "merged == single-process ingest (ids and content hashes)" cmp -s <(idhash "$T/one") <(idhash "$T/m")
check "merged: 8 documents" test "$(idhash "$T/m" | wc -l)" -eq 8
verify_ok "merged store" "$T/m"
txn=$(txnid "$T/m")
"$STO" merge "$T/s0" "$T/s1" "$T/s2" "$T/s3" --into "$T/m" --quiet >"$T/mout2" || bad "second merge"
check "second merge: 8 unchanged" grep -q "0 copied, 0 linked, 8 unchanged" "$T/mout2"
check "second merge: no write transaction" test "$txn" = "$(txnid "$T/m")"

# ---- linking: same content under another id ----
mkdir -p "$T/dup"
cp "$D/doc3.txt" "$T/dup/copy-of-doc3.txt"
"$ING" --quiet --store "$T/dupstore" "$T/dup" || bad "dup ingest"
recs=$("$STO" --store "$T/m" stats --json | sed -n 's/.*"records": \([0-9]*\),.*/\1/p')
"$STO" merge "$T/dupstore" --into "$T/m" --quiet >"$T/lout" || bad "merge dup"
check "merge: same hash in DST is linked" grep -q "0 copied, 1 linked" "$T/lout"
check "linked: no new records" test "$recs" = "$("$STO" --store "$T/m" stats --json | sed -n 's/.*"records": \([0-9]*\),.*/\1/p')"
verify_ok "after link" "$T/m"

# ---- conflicts ----
mkdir -p "$T/edit"
cp "$D/doc1.txt" "$T/edit/doc1.txt"
echo "Amended: the pump was replaced in May." >>"$T/edit/doc1.txt"
sleep 1.1  # a later ingest time than the shard stores
"$ING" --quiet --store "$T/newer" "$T/edit" || bad "edited ingest"
"$STO" merge "$T/s0" "$T/s1" "$T/s2" "$T/s3" "$T/newer" --into "$T/c" >"$T/cout" 2>"$T/cerr"
rc=$?
check "conflict: exit 1 (got $rc)" test "$rc" -eq 1
check "conflict: lists doc1.txt" grep -q "conflict: 'doc1.txt' differs between sources" "$T/cerr"
check "conflict: nothing written" test ! -e "$T/c/data.mdb"
sed 's/^/  /' "$T/cerr"
"$STO" merge "$T/s0" "$T/s1" "$T/s2" "$T/s3" "$T/newer" --into "$T/c" --prefer newest --quiet >"$T/cout" 2>"$T/cerr" \
  || bad "merge --prefer newest: $(cat "$T/cerr")"
check "--prefer newest: the edited (newer) doc1.txt wins" \
  test "$(idhash "$T/c" | grep '^doc1.txt ')" = "$(idhash "$T/newer")"
verify_ok "--prefer newest" "$T/c"

# ---- refusals ----
"$ING" --quiet --synthetic tiny-llama --store "$T/other" "$T/edit" || bad "synthetic ingest"
expect_err "merge: another model" 4 "different models cannot be merged" "$STO" merge "$T/s0" "$T/other" --into "$T/x1"
expect_err "merge: DST among the sources" 2 "is the destination store itself" "$STO" merge "$T/s0" "$T/m" --into "$T/m"
expect_err "merge: a source twice" 2 "named twice" "$STO" merge "$T/s0" "$T/s0/" --into "$T/x2"
expect_err "merge: no --into" 2 "merge needs --into DST" "$STO" merge "$T/s0"
# shard 1 cut from a corpus with one more document: another listing
cp -r "$D" "$T/corpus2"
echo "A late addition about valve V-9." >"$T/corpus2/late.txt"
"$ING" --quiet --shard 1/4 --store "$T/s1b" "$T/corpus2" || bad "shard of the changed corpus"
cp -r "$T/s1" "$T/s1c"
"$ING" --quiet --shard 1/4 --store "$T/s1c" "$T/corpus2" 2>"$T/cwarn" || bad "rerun of shard 1 on the changed corpus"
check "rerun of a shard on a changed corpus warns" grep -q "warning: .* the corpus changed; re-run every shard" "$T/cwarn"
sed 's/^/  /' "$T/cwarn"
"$STO" merge "$T/s0" "$T/s1b" "$T/s2" "$T/s3" --into "$T/x3" >"$T/xout" 2>"$T/xerr"
rc=$?
check "mixed corpus: exit 1 (got $rc)" test "$rc" -eq 1
check "mixed corpus: reported" grep -q "different corpus listings" "$T/xerr"
check "mixed corpus: nothing written" test ! -e "$T/x3/data.mdb"
sed 's/^/  /' "$T/xerr"
"$STO" merge "$T/s0" "$T/s1b" "$T/s2" "$T/s3" --into "$T/x3" --allow-mixed-corpus --quiet >/dev/null 2>&1 \
  || bad "--allow-mixed-corpus"
"$STO" merge "$T/s0" "$T/s1" "$T/s3" --into "$T/x4" --quiet >/dev/null 2>"$T/werr" || bad "3 of 4 shards"
check "merge of 3 of 4 shards warns about shard 2" grep -q "shard 2 of 4 is not among the sources" "$T/werr"

# ---- a blob that does not verify is skipped ----
"$STO" --store "$T/s2" snapshot "$T/s2bad" >/dev/null || bad "snapshot of s2"   # compacted: no stale pages
offs=($(kvzb_offsets "$T/s2bad/data.mdb"))
flip_byte "$T/s2bad/data.mdb" $((offs[10] + 300))   # inside a LAYER record's compressed payload
"$STO" merge "$T/s2bad" --into "$T/x5" >"$T/bout" 2>"$T/berr"
rc=$?
check "bad blob: exit 1 (got $rc)" test "$rc" -eq 1
check "bad blob: reported" grep -q "blob does not verify, not merged" "$T/berr"
check "bad blob: the other documents merged" \
  test "$(idhash "$T/x5" | wc -l)" -eq $(($(wc -l <"$T/list2") - 1))
verify_ok "after a skipped blob" "$T/x5"

# ---- kill -9 during merges, then a rerun ----
for delay in 0.02 0.05 0.1 0.2; do
  rm -rf "$T/k"
  "$STO" merge "$T/s0" "$T/s1" "$T/s2" "$T/s3" --into "$T/k" --quiet >/dev/null 2>&1 &
  pid=$!
  sleep $delay
  kill -9 $pid 2>/dev/null
  wait $pid 2>/dev/null
  if [ -e "$T/k/data.mdb" ]; then verify_ok "killed merge (after ${delay}s)" "$T/k"; fi
  "$STO" merge "$T/s0" "$T/s1" "$T/s2" "$T/s3" --into "$T/k" --quiet >/dev/null 2>&1 || bad "rerun after kill"
  check "rerun after kill -9 (${delay}s) == single ingest" cmp -s <(idhash "$T/one") <(idhash "$T/k")
done
verify_ok "after kill + rerun" "$T/k"

# ---- snapshot ----
tiny_docs "$T/more/extra" 6 b   # ids extra/doc1.txt ...
cp -r "$T/one" "$T/live"
"$ING" --quiet --threads 1 --store "$T/live" "$T/more" &
ipid=$!
sleep 2
"$STO" --store "$T/live" snapshot "$T/snap" >"$T/sout" || bad "snapshot during ingest"
wait $ipid || bad "ingest during snapshot"
cat "$T/sout"
check "snapshot holds no lock file to ship" test ! -e "$T/snap/lock.mdb"
verify_ok "snapshot taken while ingesting" "$T/snap"
n_snap=$(ndocs "$T/snap")
check "snapshot: 8..14 documents (got $n_snap)" test "$n_snap" -ge 8 -a "$n_snap" -le 14
check "live store: 14 documents" test "$(ndocs "$T/live")" -eq 14
mkdir -p "$T/empty"
"$STO" --store "$T/one" snapshot "$T/empty" >/dev/null || bad "snapshot into an empty folder"
check "snapshot into an empty folder == the store" cmp -s <(idhash "$T/one") <(idhash "$T/empty")
expect_err "snapshot into a non-empty folder" 1 "exists and is not empty" "$STO" --store "$T/one" snapshot "$T/snap"
expect_err "snapshot without a folder" 2 "snapshot needs a target folder" "$STO" --store "$T/one" snapshot

# ---- two workers on the CPU ----
"$ING" --workers 2 --device cpu --json --store "$T/w" "$D" >"$T/wjson" 2>"$T/wlog" || bad "--workers 2: $(tail -3 "$T/wlog")"
sed -n '1,3p' "$T/wlog"
check "--workers 2 == single-process ingest" cmp -s <(idhash "$T/one") <(idhash "$T/w")
verify_ok "--workers 2 store" "$T/w"
check "--workers 2: both workers took documents" python3 -c '
import json, sys
j = json.load(open(sys.argv[1]))
sys.exit(not (j["ingested"] == 8 and all(w["documents"] >= 1 and w["exit"] == 0 for w in j["per_worker"])))' "$T/wjson"
check "--workers 2: progress lines name the worker" grep -q '^\[w[01] cpu\] ingested' "$T/wlog"
"$ING" --workers 2 --device cpu --json --store "$T/w" "$D" >"$T/wjson2" 2>/dev/null || bad "--workers rerun"
check "--workers 2 rerun: 8 unchanged" grep -q '"ingested": 0, "unchanged": 8' "$T/wjson2"
expect_err "--gpus on a CPU-only build/host" 4 "--gpus" "$ING" --gpus all "$D"

finish
