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
# the whole id means all of its parts in order, composed into one context (issue 14)
ok "$bin/kvzip-query" --store "$tmp/st" --doc lab_b214_safety_sop.md --stats --max-tokens 2 "q" > /dev/null 2> "$tmp/err"
ok grep -q "3 documents composed (sequential)" "$tmp/err"
# several --doc; a part named twice (once through its parent) and an unknown id name the document
ok "$bin/kvzip-query" --store "$tmp/st" --doc "lab_b214_safety_sop.md#3" --doc "lab_b214_safety_sop.md#1" \
  --placement parallel --stats --max-tokens 2 "q" > /dev/null 2> "$tmp/err"
ok grep -q "2 documents composed (parallel)" "$tmp/err"
"$bin/kvzip-query" --store "$tmp/st" --doc lab_b214_safety_sop.md --doc "lab_b214_safety_sop.md#2" "q" 2> "$tmp/err"
ok test $? -eq 2
ok grep -q "document 'lab_b214_safety_sop.md#2' is named twice" "$tmp/err"
ok test "$(wc -l < "$tmp/err")" -eq 1
"$bin/kvzip-query" --store "$tmp/st" --doc lab_b214_safety_sop.md --doc nope.md "q" 2> "$tmp/err"
ok test $? -eq 6
ok grep -q "no document 'nope.md'" "$tmp/err"
ok test "$(wc -l < "$tmp/err")" -eq 1
# now one part: stale #1..#3 are removed, the plain id exists
"$bin/kvzip-ingest" --quiet --store "$tmp/st" "$doc"
ok test $? -eq 0
"$bin/kvzip-query" --store "$tmp/st" --doc "lab_b214_safety_sop.md#1" --max-tokens 2 "q" 2> /dev/null
ok test $? -eq 6
ok "$bin/kvzip-query" --store "$tmp/st" --doc lab_b214_safety_sop.md --max-tokens 4 "q" > /dev/null
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
