#!/usr/bin/env bash
# kill -9 of kvzip-ingest at >= 20 random moments (KVZ_CRASH_KILLS, seed
# KVZ_TEST_SEED): before every run all three documents change, so each run
# replaces every blob (write new records, release the old ones); after each kill
# the store passes kvzip-store verify and still names all three documents; a
# final run completes and leaves exactly the latest content (a re-run is a no-op).
# KVZ_CRASH_ARGS adds ingest options: scripts/gpu-check's crash stage runs this with
# "--synthetic smollm2-135m --device cuda" (the overlapped GPU pipeline, ingest/kvz_pipeline.h).
source "$(dirname "$0")/lib.bash"
XA=${KVZ_CRASH_ARGS:-}

seed=${KVZ_TEST_SEED:-$((RANDOM * 32768 + RANDOM))}
RANDOM=$seed
want=${KVZ_CRASH_KILLS:-20}
echo "seed $seed (KVZ_TEST_SEED), $want kills${XA:+, ingest options: $XA}"
S="$T/store"
D="$T/docs"
tiny_docs "$D" 3 " round 0"
t0=$(now)
"$ING" $XA --quiet --store "$S" "$D" || bad "first ingest"
full_ms=$(awk -v s="$(secs "$t0" "$(now)")" 'BEGIN { printf "%d", s * 1000 }')
echo "a full run takes ${full_ms} ms"

killed=0 round=0 completed=0
while [ "$killed" -lt "$want" ] && [ "$round" -lt $((want * 2)) ]; do
  round=$((round + 1))
  tiny_docs "$D" 3 " round $round"
  ms=$((50 + (RANDOM * 32768 + RANDOM) % (full_ms * 95 / 100)))
  delay=$(awk -v m="$ms" 'BEGIN { printf "%.3f", m / 1000 }')
  # (the subshell swallows bash's "Killed" job notice)
  (timeout -s KILL "$delay" "$ING" $XA --quiet --store "$S" "$D" 2>"$T/ing_err") 2>/dev/null
  rc=$?
  if [ "$rc" -eq 137 ]; then killed=$((killed + 1))
  elif [ "$rc" -eq 0 ]; then completed=$((completed + 1))
  else bad "round $round: ingest exit $rc: $(head -c 300 "$T/ing_err")"; fi
  verify_ok "round $round (killed after ${delay}s)" "$S"
  check "round $round: 3 documents" test "$(ndocs "$S")" = 3
  check "round $round: 3 blobs" test "$("$STO" --store "$S" stats --json | sed -n 's/.*"blobs": \([0-9]*\),.*/\1/p')" = 3
done
echo "$round rounds: $killed killed, $completed completed before the kill"
check "at least $want kills" test "$killed" -ge "$want"

"$ING" $XA --json --store "$S" "$D" >"$T/final" || bad "final ingest: $(cat "$T/final")"
check "final run: nothing failed" grep -q '"failed": 0' "$T/final"
"$ING" $XA --json --store "$S" "$D" >"$T/again" || bad "re-run"
check "re-run: all 3 unchanged (store holds the latest text)" grep -q '"unchanged": 3' "$T/again"
for i in 1 2 3; do check "doc$i.txt present" has_doc "$S" "doc$i.txt"; done
verify_ok "final" "$S"
finish
