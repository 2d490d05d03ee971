#!/usr/bin/env bash
# Issue 18, items 1, 2 and 14: document ids.
#  1. ingesting X never deletes (or overwrites) an independently ingested X#1; the
#     parts a document created are still removed when it shrinks;
#  2. two inputs that would be stored under one id are an error naming both paths,
#     before any model work, with nothing stored;
# 14. an id over 511 bytes is rejected before the model is even loaded.
source "$(dirname "$0")/lib.bash"
cd "$T"
I=("$ING" --ratio 0.3)

echo "item 1: X and an independent X#1"
mkdir c
printf 'Alpha notes: pump P-7 runs at 300 rpm and is checked every Monday.\n' >c/notes
printf 'Beta notes: the blue valve V-2 is closed during the night shift.\n' >'c/notes#1'
"${I[@]}" --quiet --store s c || bad "ingest c"
"${I[@]}" --quiet --store s c/notes || bad "ingest c/notes"
"$STO" --store s ls --json >ls.json
check "notes#1 survives ingesting notes" grep -q '"id": "notes#1"' ls.json
check "both ids listed" test "$(grep -o '"id": ' ls.json | wc -l)" -eq 2
# every re-run: nothing recomputed, nothing deleted
"${I[@]}" --json --quiet --store s c >rerun.json || bad "re-run c"
check "re-run: 2 unchanged" grep -q '"ingested": 0, "unchanged": 2' rerun.json
check "re-run keeps notes#1" has_doc s 'notes#1'
# the answer of notes#1 is still its own text (the blue valve), not notes'
"$STO" --store s show 'notes#1' >show.txt || bad "show notes#1"
check "notes#1 still from c/notes#1" grep -q 'c/notes#1' show.txt

echo "item 1: a document's own parts are still removed when it shrinks"
doc="$SRC/samples/lab_b214_safety_sop.md"   # ~690 tokens: 3 parts of <= 240
cp "$doc" lab.md
"${I[@]}" --quiet --store s2 --part-tokens 240 lab.md || bad "ingest in parts"
check "3 parts" test "$(ndocs s2)" -eq 3
# an independent document named like a 4th part, ingested before the shrink
printf 'Gamma: an unrelated note about the stockroom key.\n' >'lab.md#4'
"${I[@]}" --quiet --store s2 'lab.md#4' || bad "ingest lab.md#4"
"${I[@]}" --quiet --store s2 lab.md || bad "ingest whole"
"$STO" --store s2 ls --json >ls2.json
check "whole id stored" grep -q '"id": "lab.md"' ls2.json
check "old parts removed" test "$(grep -c '"id": "lab.md#[123]"' ls2.json)" -eq 0
check "independent lab.md#4 kept" grep -q '"id": "lab.md#4"' ls2.json
verify_ok "after shrink" s2
# a longer version may not overwrite another document's id: split lab.md into 4
# parts now and lab.md#4 would be replaced; the document fails, nothing changes
before=$(store_state s2)
expect_err "part id taken" 1 "^kvzip-ingest: error: lab.md: id 'lab.md#4' is another document's \(from lab.md#4\); not overwritten" \
  "${I[@]}" --quiet --store s2 --part-tokens 180 lab.md
check "store unchanged after refusal" test "$before" = "$(store_state s2)"
# in one run: lab.md in 4 parts and the file lab.md#4 -> refused before scoring
before=$(store_state s2)
expect_err "part id collides in one run" 1 "^kvzip-ingest: error: lab.md \(part 4 of 4\) and lab.md#4 would both be stored as 'lab.md#4'; nothing stored" \
  "${I[@]}" --quiet --store s2 --part-tokens 180 lab.md 'lab.md#4'
check "store unchanged after collision" test "$before" = "$(store_state s2)"

echo "item 2: two inputs, one id"
mkdir -p dir1 dir2 a b
printf 'First same.txt: the red pump.\n' >dir1/same.txt
printf 'Second same.txt: the green pump.\n' >dir2/same.txt
printf 'a/x.txt: the north gate.\n' >a/x.txt
printf 'b/x.txt: the south gate.\n' >b/x.txt
# a model that cannot load proves the check comes first: it must never be reached
t0=$(now)
expect_err "dir1 dir2 same.txt" 1 "^kvzip-ingest: error: dir1/same.txt and dir2/same.txt would both be stored as 'same.txt'; nothing stored" \
  "$ING" --quiet --model "$T/none.gguf" --store s3 dir1 dir2
expect_err "a/x.txt b/x.txt" 1 "^kvzip-ingest: error: a/x.txt and b/x.txt would both be stored as 'x.txt'; nothing stored" \
  "$ING" --quiet --model "$T/none.gguf" --store s3 a/x.txt b/x.txt
check "no store created" test ! -e s3
# with the real model as well: exit 1, nothing stored, fast (no scoring)
expect_err "collision, real model" 1 "would both be stored as 'x.txt'" "${I[@]}" --quiet --store s3 a/x.txt b/x.txt
check "no store created (real model)" test ! -e s3
echo "  collision checks took $(secs "$t0" "$(now)") s"
# the same file named twice is stored once, not a collision
"${I[@]}" --json --quiet --store s3 a/x.txt ./a/x.txt >twice.json || bad "same file twice"
check "same file twice: 1 stored" grep -q '"ingested": 1,' twice.json
# distinct ids through --id resolve it
"${I[@]}" --quiet --store s3 --id x-b.txt b/x.txt || bad "--id"
check "both gates stored" test "$(ndocs s3)" -eq 2
# or --path-ids: ids keep the DIR argument's name / the FILE's path as given
"${I[@]}" --quiet --path-ids --store s5 dir1 dir2 ./a/x.txt b/x.txt || bad "--path-ids"
"$STO" --store s5 ls --json >p.json
for id in dir1/same.txt dir2/same.txt a/x.txt b/x.txt; do
  check "--path-ids stored $id" grep -q "\"id\": \"$id\"" p.json
done
(cd dir1 && "${I[@]}" --json --quiet --path-ids --store ../s5 . >../p2.json) || bad "--path-ids ."
check "--path-ids: '.' is named by its real folder" grep -q '"ingested": 0, "unchanged": 1' p2.json

echo "item 14: id over 511 bytes"
long=$(printf 'd%.0s' $(seq 1 200))
mkdir -p "deep/$long/$long"
printf 'A document deep in a tree.\n' >"deep/$long/$long/$(printf 'n%.0s' $(seq 1 120)).txt"
expect_err "walk id over 511" 1 "^kvzip-ingest: error: deep/d+/d+/n+\.txt: document id of 526 bytes is outside 1\.\.511 bytes" \
  "$ING" --quiet --model "$T/none.gguf" --store s4 deep
expect_err "--id over 511" 1 "document id of 600 bytes is outside 1\.\.511 bytes" \
  "$ING" --quiet --model "$T/none.gguf" --store s4 --id "$(printf 'i%.0s' $(seq 1 600))" a/x.txt
check "no store for an over-long id" test ! -e s4
# a part suffix that pushes an id over the limit: rejected after tokenizing, before scoring
id509=$(printf 'p%.0s' $(seq 1 509))
expect_err "part id over 511" 1 "^kvzip-ingest: error: lab.md: document id of 512 bytes is over the 511-byte limit" \
  "${I[@]}" --quiet --store s4 --part-tokens 64 --id "$id509" lab.md
# the store is opened only after every id passed, and scoring only after that
check "no store for a part id over the limit" test ! -e s4
finish
