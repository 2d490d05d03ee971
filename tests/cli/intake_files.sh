#!/usr/bin/env bash
# Issue 18, items 6-9: what kvzip-ingest and kvzip-query do with odd files.
#  6. a FIFO, device or socket named as input, --text or --model: "not a regular
#     file", exit 1, never blocking (each command runs under a 30 s timeout);
#  7. a symbolic link to an ancestor folder is not followed again: one id per file;
#  8. a dangling link is skipped with a warning wherever it sorts (exit 0);
#  9. a folder whose files are all unusable exits 3 and creates no store.
source "$(dirname "$0")/lib.bash"
cd "$T"
I=("$ING" --ratio 0.3)
TO=30
Q="What is checked?"
printf 'The duty engineer checks pump P-3 every Tuesday.\n' >good.txt

echo "item 6: FIFOs and devices"
mkfifo p.txt
python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1])' sock.txt
expect_err "ingest FIFO"        1 "^kvzip-ingest: error: cannot read p.txt: p.txt: not a regular file \(a FIFO\)" timeout $TO "$ING" --quiet --store s p.txt
expect_err "ingest socket"      1 "^kvzip-ingest: error: cannot read sock.txt: sock.txt: not a regular file \(a socket\)" timeout $TO "$ING" --quiet --store s sock.txt
expect_err "ingest /dev/null"   1 "not a regular file \(a character device\)" timeout $TO "$ING" --quiet --store s /dev/null
check "no store for a FIFO" test ! -e s
expect_err "query --text FIFO"  1 "^kvzip-query: error: cannot use document: p.txt: not a regular file \(a FIFO\)" timeout $TO "$QRY" --text p.txt "$Q"
expect_err "query --text /dev/zero" 1 "^kvzip-query: error: cannot use document: /dev/zero: not a regular file \(a character device\)" timeout $TO "$QRY" --text /dev/zero "$Q"
expect_err "query --model FIFO" 1 "^kvzip-query: error: cannot load model p.txt: p.txt: not a regular file \(a FIFO\)" timeout $TO "$QRY" --model p.txt --text good.txt "$Q"
expect_err "ingest --model FIFO" 1 "^kvzip-ingest: error: cannot load model p.txt: p.txt: not a regular file \(a FIFO\)" timeout $TO "$ING" --quiet --model p.txt --store s good.txt
expect_err "query --model folder" 1 "^kvzip-query: error: cannot load model .: .: not a regular file \(a folder\)" timeout $TO "$QRY" --model . --text good.txt "$Q"
check "no store for a FIFO model" test ! -e s
# a FIFO met by a folder walk is skipped with a warning, the rest goes in
mkdir w
cp good.txt w/a.txt
mkfifo w/b.txt
timeout $TO "${I[@]}" --json --store sw w >w.json 2>w.err
check "walk with a FIFO exits 0" test $? -eq 0
check "walk with a FIFO: warning" grep -q "^kvzip-ingest: warning: skipping w/b.txt: not a regular file" w.err
check "walk with a FIFO: 1 ingested, 1 skipped" grep -q '"ingested": 1, .*"skipped": 1' w.json

echo "item 7: a link to an ancestor folder"
mkdir c
printf 'Loop test: the spare fuse is in drawer 4.\n' >c/notes.txt
ln -s . c/self
mkdir c/sub
ln -s .. c/sub/back   # back to c
timeout $TO "${I[@]}" --json --store s7 c >c.json 2>c.err
check "loop walk exits 0" test $? -eq 0
check "one id for one document" test "$(ndocs s7)" -eq 1
check "the id is notes.txt" has_doc s7 notes.txt
check "loop reported" grep -q "skipping c/self: folder already walked" c.err
check "nested loop reported" grep -q "skipping c/sub/back: folder already walked" c.err

echo "item 8: dangling links, wherever they sort"
for pos in aaa zzz; do
  mkdir "d_$pos"
  cp good.txt "d_$pos/m.txt"
  ln -s nowhere.txt "d_$pos/$pos.txt"
  "${I[@]}" --json --store "s8_$pos" "d_$pos" >d.json 2>d.err
  rc=$?
  check "dangling link $pos: exit 0" test $rc -eq 0
  check "dangling link $pos: warned" grep -q "^kvzip-ingest: warning: skipping d_$pos/$pos.txt: dangling symbolic link" d.err
  check "dangling link $pos: 1 ingested, 1 skipped" grep -q '"ingested": 1, .*"skipped": 1' d.json
done

echo "item 9: nothing usable"
mkdir u
: >u/empty.txt
head -c 2000 /dev/urandom >u/binary.txt
printf 'caf\xe9\n' >u/latin1.md
"$ING" --store s9 u >u.out 2>u.err
rc=$?
check "all unusable: exit 3" test $rc -eq 3
check "all unusable: 3 warnings" test "$(grep -c '^kvzip-ingest: warning: skipping u/' u.err)" -eq 3
check "all unusable: the error line" grep -q "^kvzip-ingest: error: no usable document: 3 files skipped" u.err
check "all unusable: no store" test ! -e s9
# a named file that fails and nothing else: exit 1, and still no store
expect_err "only a failing named file" 1 "u/empty.txt is empty" "$ING" --quiet --store s9 u/empty.txt
check "failing named file: no store" test ! -e s9
finish
