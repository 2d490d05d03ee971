#!/usr/bin/env bash
# (1) Re-ingesting an unchanged corpus writes nothing (same last txn id, same
#     data.mdb size and mtime) and takes < 5% of the first run's wall time;
#     editing one file re-ingests only that file.
# (2) A query while an ingest writes gives the same answer as before it;
#     two concurrent ingests on one store leave a consistent store.
source "$(dirname "$0")/lib.bash"

S="$T/store"
D="$T/corpus"
mkdir -p "$D"
for f in halcyon_warranty_returns lab_b214_safety_sop orrery_onboarding_guide corvid_cr8_router_guide; do
  cp "$SRC/samples/$f.md" "$D/"
done

# ---- (1) unchanged corpus ----
t0=$(now)
"$ING" --json --store "$S" "$D" >"$T/first" || bad "first ingest: $(cat "$T/first")"
t1=$(now)
check "first run ingested 4" grep -q '"ingested": 4' "$T/first"
txn=$(txnid "$S")
fstat=$(stat -c '%s %Y' "$S/data.mdb")
listing=$("$STO" --store "$S" ls --json)
sleep 1   # an mtime change would be visible
t2=$(now)
"$ING" --json --store "$S" "$D" >"$T/second" || bad "second ingest"
t3=$(now)
first=$(secs "$t0" "$t1")
second=$(secs "$t2" "$t3")
echo "first run ${first}s, unchanged re-run ${second}s"
check "re-run: 4 unchanged, 0 ingested" grep -q '"ingested": 0, "unchanged": 4' "$T/second"
check "re-run: no write transaction" test "$txn" = "$(txnid "$S")"
check "re-run: data.mdb size and mtime unchanged" test "$fstat" = "$(stat -c '%s %Y' "$S/data.mdb")"
check "re-run: listing unchanged" test "$listing" = "$("$STO" --store "$S" ls --json)"
check "re-run < 5% of the first run (${second}s vs ${first}s)" \
  awk -v a="$second" -v b="$first" 'BEGIN { exit !(a < 0.05 * b) }'

# ---- (1b) one file edited ----
echo "Addendum: the goggles cabinet moved to room B215 in March." >>"$D/lab_b214_safety_sop.md"
"$ING" --json --store "$S" "$D" >"$T/third" || bad "third ingest"
check "edit: 1 ingested, 3 unchanged" grep -q '"ingested": 1, "unchanged": 3' "$T/third"
"$STO" --store "$S" ls --json >"$T/ls_after"
for f in halcyon_warranty_returns orrery_onboarding_guide corvid_cr8_router_guide; do
  check "edit: $f entry untouched" test "$(grep "\"$f.md\"" <<<"$listing")" = "$(grep "\"$f.md\"" "$T/ls_after")"
done
check "edit: lab_b214 entry changed" test "$(grep '"lab_b214_safety_sop.md"' <<<"$listing")" != "$(grep '"lab_b214_safety_sop.md"' "$T/ls_after")"
check "edit: old blob released (4 blobs)" test "$("$STO" --store "$S" stats --json | sed -n 's/.*"blobs": \([0-9]*\),.*/\1/p')" = 4
verify_ok "after edit" "$S"

# ---- (2a) a query while an ingest writes ----
Q="How many days do customers have to return a product?"
qry() { "$QRY" --store "$S" --doc halcyon_warranty_returns.md --threads 1 --max-tokens 12 --json "$Q"; }
qry >"$T/ref" || bad "reference query"
tiny_docs "$T/more" 3
"$ING" --quiet --store "$S" "$T/more" 2>"$T/bg_err" &
bg=$!
overlapped=0 nq=0
while kill -0 "$bg" 2>/dev/null && [ "$nq" -lt 4 ]; do
  nq=$((nq + 1))
  if qry >"$T/during"; then
    kill -0 "$bg" 2>/dev/null && overlapped=$((overlapped + 1))
    a=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["answer"])' "$T/ref")
    b=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["answer"])' "$T/during")
    check "query $nq during ingest: same answer ('$b')" test "$a" = "$b"
  else
    bad "query $nq during ingest failed"
  fi
done
wait "$bg"
check "background ingest succeeded" test $? -eq 0
check "a query overlapped the ingest ($overlapped of $nq)" test "$overlapped" -ge 1
check "7 docs after the background ingest" test "$(ndocs "$S")" = 7
verify_ok "after query + ingest" "$S"

# ---- (2b) two concurrent ingests, one shared doc id with different content ----
tiny_docs "$T/a" 2 " from A"
tiny_docs "$T/b" 2 " from B"
printf 'Shared note written by A: valve V-7 stays closed on Sundays.\n' >"$T/a/shared.txt"
printf 'Shared note written by B: valve V-9 opens at noon on Mondays.\n' >"$T/b/shared.txt"
mv "$T/b/doc1.txt" "$T/b/docb1.txt"
mv "$T/b/doc2.txt" "$T/b/docb2.txt"
S2="$T/store2"
"$ING" --quiet --store "$S2" "$T/a" 2>"$T/a_err" &
pa=$!
"$ING" --quiet --store "$S2" "$T/b" 2>"$T/b_err" &
pb=$!
wait "$pa"; ra=$?
wait "$pb"; rb=$?
check "concurrent ingest A ok ($(head -c 200 "$T/a_err"))" test "$ra" -eq 0
check "concurrent ingest B ok ($(head -c 200 "$T/b_err"))" test "$rb" -eq 0
verify_ok "two concurrent ingests" "$S2"
check "5 docs (doc1, doc2, docb1, docb2, shared)" test "$(ndocs "$S2")" = 5
check "5 blobs: the overwritten shared blob was released" \
  test "$("$STO" --store "$S2" stats --json | sed -n 's/.*"blobs": \([0-9]*\),.*/\1/p')" = 5
for id in doc1.txt doc2.txt docb1.txt docb2.txt shared.txt; do check "$id present" has_doc "$S2" "$id"; done
finish
