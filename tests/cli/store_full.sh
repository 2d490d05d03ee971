#!/usr/bin/env bash
# A size-limited store (kvzip-ingest --max-map): ingest stops at the first
# document that does not fit with one clear error, exit 1, and the store keeps
# exactly the documents committed before, passing verify; a later run with room
# completes. Then gc --compact shrinks the file and the store stays valid.
# Then the file itself cannot grow (a file-size limit, what a full disk looks like to
# LMDB: a short write): one clear error, exit 1, the committed documents intact.
# Last, a real full filesystem (ENOSPC from a 3.5 MB tmpfs in a private mount
# namespace; needs root, said and skipped otherwise): the same guarantees.
source "$(dirname "$0")/lib.bash"

# stopped_full WHAT RC ERR_FILE REGEX NDOCS: an ingest of the 4 docs that ran into a full
# store exited 1 with one error line matching REGEX, and the store kept the 1-3 documents
# committed before it
stopped_full() {
  echo "  $(cat "$3")"
  check "$1: exit 1" test "$2" -eq 1
  check "$1: one error line" test "$(wc -l <"$3")" -eq 1
  check "$1: says so" grep -Eq "$4" "$3"
  check "$1: the documents before it are kept (${5:-none})" test "${5:-0}" -ge 1 -a "${5:-0}" -lt 4
}

S="$T/store"
# each blob ~1.3 MB at --ratio 1 (the system prefix's K/V, ~0.85 MB, is stored once,
# with the first document: docs/FORMAT.md §3.1)
tiny_docs "$T/docs" 4 " (seal kit SK-4, torque 35 Nm, spare parts in cabinet C7, inspection log page 12)"
printf '#!/bin/sh\nexec "%s" --ratio 1 --kv-dtype f16 "$@"\n' "$ING" >"$T/ing_r1" && chmod +x "$T/ing_r1"
ING="$T/ing_r1"
"$ING" --quiet --max-map 3000000 --store "$S" "$T/docs" 2>"$T/err"
stopped_full "full store" $? "$T/err" \
  '^kvzip-ingest: error: doc[0-9].txt: kvz_store: map is full at its maximum of 3000000 bytes \(store is full\)$' \
  "$(ndocs "$S")"
failed=$(sed -n 's/.*error: \(doc[0-9]\).txt.*/\1/p' "$T/err")
check "full store: the failing doc is absent" bash -c "! '$STO' --store '$S' show '$failed.txt' >/dev/null 2>&1"
verify_ok "full store" "$S"
before=$(store_state "$S")

# the same limit again: nothing more fits, nothing changes
"$ING" --quiet --max-map 3000000 --store "$S" "$T/docs" 2>/dev/null
check "still full: exit 1" test $? -eq 1
check "still full: store unchanged" test "$before" = "$(store_state "$S")"
verify_ok "still full" "$S"

# room again (default cap): the rest goes in
"$ING" --quiet --store "$S" "$T/docs" || bad "ingest with room"
check "all 4 docs after growing" test "$(ndocs "$S")" = 4
verify_ok "after growing" "$S"

# remove two documents, compact: smaller file, same remaining content
"$STO" --store "$S" rm doc1.txt >/dev/null && "$STO" --store "$S" rm doc2.txt >/dev/null || bad "rm"
size0=$(stat -c %s "$S/data.mdb")
"$STO" --store "$S" --json gc --compact >"$T/gc" || bad "gc --compact: $(cat "$T/gc")"
size1=$(stat -c %s "$S/data.mdb")
echo "  compact: $size0 -> $size1 bytes"
check "compact shrinks data.mdb" test "$size1" -lt "$size0"
check "compact reports the sizes" grep -q "\"file_bytes_after\": $size1" "$T/gc"
check "nothing left beside the store" test "$(ls -A "$T" | grep -c '^\.store\.')" -eq 0
check "2 docs after compact" test "$(ndocs "$S")" = 2
verify_ok "after compact" "$S"
if "$QRY" --store "$S" --doc doc3.txt --max-tokens 4 "What does the duty engineer log?" >/dev/null; then ok
else bad "query after compact"; fi

# the data file cannot grow: ulimit -f (1 KiB units) at ~3 blobs, no --max-map cap. The
# CLI ignores SIGXFSZ, so the write fails and the commit is rolled back.
S2="$T/store2"
(ulimit -f 3200; exec "$ING" --quiet --store "$S2" "$T/docs") 2>"$T/err2"
stopped_full "file-size limit (not killed by SIGXFSZ)" $? "$T/err2" \
  "^kvzip-ingest: error: doc[0-9].txt: kvz_store: commit: .*/data.mdb would grow past this process's file-size limit \(ulimit -f: 3276800 bytes\); the store is unchanged \(store is full\)$" \
  "$(ndocs "$S2")"
verify_ok "file-size limit" "$S2"
"$ING" --quiet --store "$S2" "$T/docs" || bad "ingest without the limit"
check "all 4 docs without the limit" test "$(ndocs "$S2")" = 4
verify_ok "after the limit" "$S2"

# a real full filesystem: the tmpfs lives only inside the unshare'd mount namespace, so
# the ingest, the verify and the count all run in there; results come out in files
if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
  mkdir -p "$T/fs"
  unshare -m bash -c '
    mount -t tmpfs -o size=3500k tmpfs "$1" || exit 90
    "$2" --quiet --store "$1/store" "$4" 2>"$5/err3"; echo $? >"$5/rc3"
    "$3" --store "$1/store" verify >/dev/null 2>"$5/verr3"; echo $? >"$5/vrc3"
    "$3" --store "$1/store" stats --json >"$5/stats3"' _ "$T/fs" "$ING" "$STO" "$T/docs" "$T"
  check "disk full: tmpfs mounted" test $? -ne 90
  stopped_full "disk full" "$(cat "$T/rc3")" "$T/err3" \
    '^kvzip-ingest: error: doc[0-9].txt: kvz_store: commit: no space left on the device holding .*/store \([0-9]+ bytes free, about [0-9]+ needed\); the store is unchanged \(store is full\)$' \
    "$(docs_in_stats <"$T/stats3")"
  check "disk full: verify passes on the full filesystem" test "$(cat "$T/vrc3")" -eq 0
else
  echo "  SKIP disk full (real ENOSPC): needs root and mount namespaces (the file-size limit above covers the same code path)"
fi
finish
