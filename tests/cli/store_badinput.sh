#!/usr/bin/env bash
# Bad input of every kind for kvzip-ingest, kvzip-query and kvzip-store: each
# gives one clear line on stderr and the exit code docs/ERRORS.md lists, and a
# store that must stay untouched is byte-for-byte the same listing afterwards and
# passes kvzip-store verify. Also the kvzip-store commands themselves.
source "$(dirname "$0")/lib.bash"

S="$T/store"
tiny_docs "$T/docs" 2
"$ING" --quiet --store "$S" "$T/docs" || bad "base ingest"
before=$(store_state "$S")
txn0=$(txnid "$S")

# ---- inputs ----
: >"$T/empty.txt"
printf '  \n\t\n' >"$T/blank.txt"
head -c 4096 /dev/urandom >"$T/binary.txt"
printf 'Stra\xdfe und Caf\xe9, latin-1 text\n' >"$T/latin1.txt"
printf 'valid start\0 then a NUL byte\n' >"$T/nul.txt"
truncate -s 300M "$T/huge.txt"      # sparse: over the 256 MiB ingest limit
truncate -s 65M "$T/huge64.txt"     # over the 64 MiB kvzip-query --text limit
head -c 1000000 "$MODEL" >"$T/trunc.gguf"
head -c 64 /dev/urandom >"$T/junk.gguf"
echo "What does the duty engineer check?" >/dev/null
Q="What does the duty engineer log?"

echo "kvzip-ingest:"
# explicitly named files that are not usable text: a one-line error, nothing
# stored, exit 1 (a folder walk skips such files with a warning instead)
expect_err "ingest empty file"        1 "^kvzip-ingest: error: cannot read .*empty.txt: .*empty.txt is empty" "$ING" --quiet --store "$S" "$T/empty.txt"
expect_err "ingest blank file"        1 "^kvzip-ingest: error: cannot read .*blank.txt: .*blank.txt is empty" "$ING" --quiet --store "$S" "$T/blank.txt"
expect_err "ingest binary file"       1 "^kvzip-ingest: error: cannot read .*binary.txt: .*binary.txt is not UTF-8 text \(bad byte 0x[0-9a-f]{2} at offset [0-9]+\)" "$ING" --quiet --store "$S" "$T/binary.txt"
expect_err "ingest non-UTF-8 file"    1 "^kvzip-ingest: error: cannot read .*latin1.txt: .*latin1.txt is not UTF-8 text \(bad byte 0xdf at offset 4\)" "$ING" --quiet --store "$S" "$T/latin1.txt"
expect_err "ingest NUL byte"          1 "^kvzip-ingest: error: cannot read .*nul.txt: .*nul.txt is not UTF-8 text \(bad byte 0x00 at offset 11\)" "$ING" --quiet --store "$S" "$T/nul.txt"
expect_err "ingest huge file"         1 "^kvzip-ingest: error: cannot read .*huge.txt: 314572800 bytes is larger than the 268435456-byte limit" "$ING" --quiet --store "$S" "$T/huge.txt"
expect_err "ingest missing file"      1 "^kvzip-ingest: error: .*nope.txt: No such file or directory" "$ING" --quiet --store "$S" "$T/nope.txt"
mkdir -p "$T/emptydir"
expect_err "ingest folder w/o docs"   3 "^kvzip-ingest: error: no .txt, .md or extension-less documents found" "$ING" --quiet --store "$S" "$T/emptydir"
expect_err "ingest truncated GGUF"    4 "^kvzip-ingest: error: cannot load model .*trunc.gguf: gguf: .*\(truncated data\)" "$ING" --quiet --model "$T/trunc.gguf" --store "$S" "$T/docs"
expect_err "ingest junk GGUF"         4 "^kvzip-ingest: error: cannot load model .*junk.gguf: gguf: bad magic" "$ING" --quiet --model "$T/junk.gguf" --store "$S" "$T/docs"
expect_err "ingest missing model"     6 "^kvzip-ingest: error: model file .*nomodel.gguf not found" "$ING" --quiet --model "$T/nomodel.gguf" --store "$S" "$T/docs"
expect_err "ingest other model"       4 "^kvzip-ingest: error: cannot open store .*: store holds blobs of model [0-9a-f]{32}, opened with model [0-9a-f]{32} \(made by another model\)" \
  "$ING" --quiet --synthetic tiny-llama --store "$S" "$T/docs"
expect_err "ingest unknown option"    2 "^kvzip-ingest: unknown option '--bogus'" "$ING" --bogus "$T/docs"
expect_err "ingest bad --ratio"       2 "^kvzip-ingest: --ratio expects a number" "$ING" --ratio 2 "$T/docs"

echo "kvzip-query:"
expect_err "query empty file"         3 "^kvzip-query: error: cannot use document: .*empty.txt is empty" "$QRY" --text "$T/empty.txt" "$Q"
expect_err "query binary file"        3 "^kvzip-query: error: cannot use document: .*binary.txt is not UTF-8 text" "$QRY" --text "$T/binary.txt" "$Q"
expect_err "query non-UTF-8 file"     3 "^kvzip-query: error: cannot use document: .*latin1.txt is not UTF-8 text \(bad byte 0xdf at offset 4\)" "$QRY" --text "$T/latin1.txt" "$Q"
expect_err "query huge file"          3 "^kvzip-query: error: cannot use document: .*huge64.txt: 68157440 bytes is larger than the 67108864-byte limit" "$QRY" --text "$T/huge64.txt" "$Q"
expect_err "query missing file"       6 "^kvzip-query: error: cannot use document: .*nope.txt: No such file or directory" "$QRY" --text "$T/nope.txt" "$Q"
expect_err "query unknown doc id"     6 "^kvzip-query: error: no document 'nope.txt' in the store" "$QRY" --store "$S" --doc nope.txt "$Q"
expect_err "query missing store"      6 "^kvzip-query: error: cannot open store .*/nostore: kvz_store: no store in" "$QRY" --store "$T/nostore" --doc doc1.txt "$Q"
expect_err "query truncated GGUF"     4 "^kvzip-query: error: cannot load model .*trunc.gguf" "$QRY" --model "$T/trunc.gguf" --store "$S" --doc doc1.txt "$Q"
expect_err "query missing model"      6 "^kvzip-query: error: model file .*nomodel.gguf not found" "$QRY" --model "$T/nomodel.gguf" --store "$S" --doc doc1.txt "$Q"
expect_err "query other model"        4 "^kvzip-query: error: cannot open store .*\(made by another model\)" "$QRY" --synthetic tiny-llama --store "$S" --doc doc1.txt "$Q"
expect_err "query no question"        2 "^kvzip-query: no question given" "$QRY" --store "$S" --doc doc1.txt
expect_err "query --doc and --text"   2 "^kvzip-query: give the document with --doc ID or --text FILE" "$QRY" --doc a --text b "$Q"

# a store made by another model, the other way round
"$ING" --quiet --synthetic tiny-llama --store "$T/synstore" "$T/docs/doc1.txt" || bad "synthetic store"
syn_before=$(store_state "$T/synstore")
expect_err "ingest into other-model store" 4 "store holds blobs of model .*\(made by another model\)" "$ING" --quiet --store "$T/synstore" "$T/docs/doc2.txt"
expect_err "query other-model store"  4 "store holds blobs of model .*\(made by another model\)" "$QRY" --store "$T/synstore" --doc doc1.txt "$Q"
check "other-model store untouched" test "$syn_before" = "$(store_state "$T/synstore")"
verify_ok "other-model store" "$T/synstore"

echo "kvzip-store:"
mkdir -p "$T/notstore"
head -c 100000 /dev/urandom >"$T/notstore/data.mdb"
# a store that is not LMDB is a store problem: exit 5 from every tool
expect_err "ingest into non-LMDB store" 5 "^kvzip-ingest: error: cannot open store .*notstore: .*File is not an LMDB file" "$ING" --quiet --store "$T/notstore" "$T/docs"
expect_err "query non-LMDB store"     5 "^kvzip-query: error: cannot open store .*notstore: .*File is not an LMDB file" "$QRY" --store "$T/notstore" --doc doc1.txt "$Q"
expect_err "store missing"            6 "^kvzip-store: error: no store in .*/nostore" "$STO" --store "$T/nostore" ls
expect_err "store not LMDB"           5 "^kvzip-store: error: cannot open store .*notstore: .*File is not an LMDB file" "$STO" --store "$T/notstore" verify
expect_err "store show unknown id"    6 "^kvzip-store: error: no document 'nope' in" "$STO" --store "$S" show nope
expect_err "store rm unknown id"      6 "^kvzip-store: error: no document 'nope' in" "$STO" --store "$S" rm nope
expect_err "store unknown command"    2 "^kvzip-store: unknown command 'frobnicate'" "$STO" --store "$S" frobnicate
expect_err "store show without id"    2 "^kvzip-store: show needs a document id" "$STO" --store "$S" show
expect_err "store --compact w/o gc"   2 "^kvzip-store: --compact goes with gc" "$STO" --store "$S" ls --compact

# ---- the rejected commands left the store exactly as it was ----
check "store untouched (ls/stats)" test "$before" = "$(store_state "$S")"
check "no write transaction" test "$txn0" = "$(txnid "$S")"
verify_ok "after bad input" "$S"

# ---- a corrupt blob: one document, compacted, one byte flipped ----
C="$T/corrupt"
cp -r "$S" "$C"
"$STO" --store "$C" rm doc2.txt >/dev/null || bad "rm doc2"
"$STO" --store "$C" gc --compact >/dev/null || bad "gc --compact"
check "one doc after rm" test "$(ndocs "$C")" = 1
verify_ok "compacted copy" "$C"
# Records are found by their magic; small records live inside LMDB leaf pages, where
# a compacted copy may keep stale bytes of an old copy: count distinct headers, and
# pick the document's LAYER records (raw size other than the prefix blob's, whose
# layers all hold 39 prefix tokens x 3 heads) that occur once and hold > 400 bytes.
offs=($(python3 - "$C/data.mdb" $(kvzb_offsets "$C/data.mdb") <<'PY'
import collections, struct, sys
b = open(sys.argv[1], "rb").read()
offs = [int(o) for o in sys.argv[2:]]
hdr = collections.Counter(b[o:o + 56] for o in offs)
layers = [(o, struct.unpack_from("<Q", b, o + 24)[0]) for o in offs if b[o + 6] == 2]
common = collections.Counter(r for _, r in layers).most_common(1)[0][0]
doc = [o for o, r in layers if r != common and hdr[b[o:o + 56]] == 1 and struct.unpack_from("<Q", b, o + 32)[0] > 400]
print(len(hdr), " ".join(map(str, doc)))
PY
))
check "62 distinct KVZB records in the copy (the document's 31, the shared prefix's 31)" test "${offs[0]}" -eq 62
offs=("${offs[@]:1}")
check "the document's LAYER records found" test "${#offs[@]}" -ge 20
flip_byte "$C/data.mdb" $((offs[10] + 300))   # inside a LAYER record's stored payload
expect_err "query corrupt blob"       5 "^kvzip-query: error: cannot load document 'doc1.txt': .*checksum" "$QRY" --store "$C" --doc doc1.txt "$Q"
"$STO" --store "$C" verify >"$T/vout" 2>"$T/verr"
rc=$?
check "verify corrupt blob exits 5" test "$rc" -eq 5
check "verify names the record" grep -Eq "^kvzip-store: verify: blob [0-9a-f]{32}: layer [0-9]+ record: .*checksum" "$T/verr"
check "verify summary line" grep -q "1 problem found" "$T/verr"
echo "  verify corrupt blob                exit $rc  $(head -1 "$T/verr")"
expect_err "show corrupt blob"        5 "^kvzip-store: error: document 'doc1.txt': layer [0-9]+ record: .*checksum" "$STO" --store "$C" show doc1.txt
flip_byte "$C/data.mdb" $((offs[10] + 300))   # undo
verify_ok "byte restored" "$C"

# ---- kvzip-store commands on the healthy store ----
"$STO" --store "$S" ls >"$T/ls" || bad "ls"
check "ls lists both docs" test "$(grep -c '^doc[12].txt ' "$T/ls")" -eq 2
"$STO" --store "$S" show doc1.txt >"$T/show" || bad "show"
check "show dims" grep -q "^dims         30 layers, 9 query heads, 3 KV heads, head_dim 64, q8" "$T/show"
check "show per-layer table" test "$(grep -cE '^ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+  [0-9]+ [0-9]+ [0-9]+$' "$T/show")" -eq 30
"$STO" --store "$S" show doc1.txt --json | python3 -c 'import json,sys; d=json.load(sys.stdin); assert len(d["blob"]["layers"])==30 and d["blob"]["context_pairs_kept"]>0' \
  && ok || bad "show --json"
"$STO" --store "$S" stats --json | python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["docs"]==2 and d["blobs"]==2 and d["records"]==62 and d["compression"]>1' \
  && ok || bad "stats --json"
"$STO" --store "$S" ls --json | python3 -c 'import json,sys; d=json.load(sys.stdin); assert [x["id"] for x in d["docs"]]==["doc1.txt","doc2.txt"]' \
  && ok || bad "ls --json"
t0=$(txnid "$S")
"$STO" --store "$S" gc >"$T/gc" || bad "gc"
check "gc on a healthy store drops nothing" grep -q "dropped 0 unreferenced blobs and 0 orphan records" "$T/gc"
check "gc on a healthy store commits nothing" test "$t0" = "$(txnid "$S")"
"$STO" --help >"$T/help" || bad "--help"
for c in ls show rm verify gc --compact stats --store --json; do
  check "--help mentions $c" grep -q -- "$c" "$T/help"
done

finish
