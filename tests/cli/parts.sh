#!/usr/bin/env bash
# Long documents are split into numbered parts (ID#1, ID#2, ...), each answerable;
# re-ingesting the same document with a larger part size removes stale parts.
set -u
bin=${KVZ_BIN:?}; src=${KVZ_SOURCE_DIR:?}
pass=0; fail=0
ok() { if "$@"; then pass=$((pass+1)); else fail=$((fail+1)); echo "FAIL: $*" >&2; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
doc="$src/samples/lab_b214_safety_sop.md"   # ~690 tokens
# 3 parts of ~230 tokens
"$bin/kvzip-ingest" --quiet --json --store "$tmp/st" --part-tokens 240 "$doc" > "$tmp/a.json"
ok test $? -eq 0
ok grep -q '"parts": 3' "$tmp/a.json"
for p in 1 2 3; do
  ok "$bin/kvzip-query" --store "$tmp/st" --doc "lab_b214_safety_sop.md#$p" --max-tokens 4 "What is this part about?" > /dev/null
done
# the whole id is not stored: a clear hint and exit 6
"$bin/kvzip-query" --store "$tmp/st" --doc lab_b214_safety_sop.md "q" 2> "$tmp/err"
ok test $? -eq 6
ok grep -q "stored in parts" "$tmp/err"
ok test "$(wc -l < "$tmp/err")" -eq 1
# now one part: stale #1..#3 are removed, the plain id exists
"$bin/kvzip-ingest" --quiet --store "$tmp/st" "$doc"
ok test $? -eq 0
"$bin/kvzip-query" --store "$tmp/st" --doc "lab_b214_safety_sop.md#1" --max-tokens 2 "q" 2> /dev/null
ok test $? -eq 6
ok "$bin/kvzip-query" --store "$tmp/st" --doc lab_b214_safety_sop.md --max-tokens 4 "q" > /dev/null
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
