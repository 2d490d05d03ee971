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

S="$T/store"
tiny_docs "$T/docs" 4        # each blob is ~1 MB
"$ING" --quiet --max-map 3000000 --store "$S" "$T/docs" 2>"$T/err"
rc=$?
echo "  $(cat "$T/err")"
check "full store: exit 1" test "$rc" -eq 1
check "full store: one error line" test "$(wc -l <"$T/err")" -eq 1
check "full store: clear message" grep -Eq '^kvzip-ingest: error: doc[0-9].txt: kvz_store: map is full at its maximum of 3000000 bytes \(store is full\)$' "$T/err"
n=$(ndocs "$S")
check "full store: some docs stored before the limit ($n)" test "$n" -ge 1 -a "$n" -lt 4
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
rc=$?
echo "  $(cat "$T/err2")"
check "file-size limit: exit 1 (not killed by SIGXFSZ)" test "$rc" -eq 1
check "file-size limit: one error line" test "$(wc -l <"$T/err2")" -eq 1
check "file-size limit: says so" grep -Eq "^kvzip-ingest: error: doc[0-9].txt: kvz_store: commit: .*/data.mdb would grow past this process's file-size limit \(ulimit -f: 3276800 bytes\); the store is unchanged \(store is full\)$" "$T/err2"
n2=$(ndocs "$S2")
check "file-size limit: the documents before it are kept ($n2)" test "$n2" -ge 1 -a "$n2" -lt 4
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
  echo "  $(cat "$T/err3")"
  check "disk full: exit 1" test "$(cat "$T/rc3")" -eq 1
  check "disk full: one error line" test "$(wc -l <"$T/err3")" -eq 1
  check "disk full: says so" grep -Eq '^kvzip-ingest: error: doc[0-9].txt: kvz_store: commit: no space left on the device holding .*/store \([0-9]+ bytes free, about [0-9]+ needed\); the store is unchanged \(store is full\)$' "$T/err3"
  n3=$(sed -n 's/.*"docs": \([0-9]*\),.*/\1/p' "$T/stats3")
  check "disk full: the documents before it are kept ($n3)" test "${n3:-0}" -ge 1 -a "${n3:-0}" -lt 4
  check "disk full: verify passes on the full filesystem" test "$(cat "$T/vrc3")" -eq 0
else
  echo "  SKIP disk full (real ENOSPC): needs root and mount namespaces (the file-size limit above covers the same code path)"
fi
finish
