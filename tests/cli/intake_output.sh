#!/usr/bin/env bash
# Issue 18, items 11-13 (ingest/query side):
# 11. the summary counts linked documents (content already stored) apart from
#     ingested ones, and its figures describe only what was computed in the run;
# 12. "--" ends the options of kvzip-ingest and kvzip-query;
# 13. names with control characters are printed escaped, one line each.
source "$(dirname "$0")/lib.bash"
cd "$T"
I=("$ING" --ratio 0.3)

echo "item 11: ingested vs linked"
mkdir docs
printf 'Pump P-11 in bay 3 runs at 1450 rpm; the seal is replaced every 90 days.\n' >docs/a.txt
cp docs/a.txt docs/b.txt   # same content: linked to a's records, not recomputed
printf 'Valve V-4 is opened by the night shift at 22:00 and logged in book 7.\n' >docs/c.txt
"${I[@]}" --store s docs >out.txt 2>err.txt || bad "ingest docs"
sum=$(grep '^kvzip-ingest: ' err.txt)
echo "  $sum"
check "2 ingested, 1 linked" grep -q '^kvzip-ingest: 2 ingested, 1 linked, 0 unchanged, 0 failed, 0 skipped' <<<"$sum"
check "per-document line: linked" grep -q '^linked     b.txt' err.txt
# kept share of the context pairs: the --ratio (0.3), measured over computed documents only
pct=$(sed -n 's/.*kept [0-9.]* MB (\([0-9]*\)% of the context pairs.*/\1/p' <<<"$sum")
check "context pairs kept ~30% (got '$pct')" test -n "$pct" -a "${pct:-0}" -ge 27 -a "${pct:-0}" -le 33
check "no ratio below 0.1x" bash -c '! grep -Eq "\(0\.0[0-9]*x\)" <<<"$1"' _ "$sum"
# JSON: the same counts; byte figures only from the 2 computed documents
printf 'Valve V-4 is opened by the night shift at 22:00 and logged in book 7.\n' >docs/d.txt
"${I[@]}" --json --quiet --store s docs >run2.json || bad "re-run"
python3 - run2.json <<'PY' && ok || bad "json counts (linked d.txt, unchanged a-c, no byte figures)"
import json, sys
d = json.load(open(sys.argv[1]))
assert (d["ingested"], d["linked"], d["unchanged"]) == (0, 1, 3), d
assert d["bytes_kv_full"] == 0 and d["bytes_stored"] == 0 and d["tokens_ingested"] == 0, d
PY
"$ING" --store s docs/d.txt 2>only.txt || bad "unchanged run"
check "nothing computed: no KV figures" bash -c '! grep -q "KV" only.txt'

echo "item 12: -- ends the options"
printf 'The file named like an option: the spare key hangs by door 2.\n' >./--help.txt
"${I[@]}" --quiet --store s12 -- --help.txt || bad "ingest -- --help.txt"
# (listed with ls: `kvzip-store show -- ID` is kvzip-store's own part of item 12)
listed() { "$STO" --store "$1" ls --json | grep -q "\"id\": \"$2\""; }
check "id --help.txt stored" listed s12 --help.txt
"$QRY" --store s12 --doc --help.txt --max-tokens 4 -- --where-is-the-key >q.txt 2>q.err
check "query with -- exits 0" test $? -eq 0
check "question after --" test -s q.txt
mkdir w
cp ./--help.txt w/--help.txt
"${I[@]}" --quiet --store s12b w || bad "walk finds --help.txt"
check "walk id --help.txt" listed s12b --help.txt
expect_err "options still parsed before --" 2 "^kvzip-ingest: unknown option '--bogus'" "$ING" --bogus -- x.txt

echo "item 13: control characters in names"
mkdir e
esc=$'e/red\e[31mRED.txt'
bel=$'e/bell\a.txt'
cr=$'e/cr\rfake.txt'
nl=$'e/two\nlines.txt'
for f in "$esc" "$bel" "$cr" "$nl"; do printf 'Document %s about the spare pump.\n' "$RANDOM" >"$f"; done
: >$'e/empty\e[2J.txt'
"${I[@]}" --store s13 e >e.out 2>e.err
check "control names: exit 0" test $? -eq 0
check "4 stored" test "$(ndocs s13)" -eq 4
check "no ESC/BEL/CR on stderr" bash -c '! LC_ALL=C grep -q $'"'"'[\x07\x0d\x1b]'"'"' e.err'
check "ESC escaped" grep -qF 'red\x1b[31mRED.txt' e.err
check "BEL escaped" grep -qF 'bell\x07.txt' e.err
check "CR escaped" grep -qF 'cr\rfake.txt' e.err
check "newline escaped" grep -qF 'two\nlines.txt' e.err
check "warning escaped" grep -qF 'skipping e/empty\x1b[2J.txt' e.err
# 4 documents + 1 warning + 1 summary: one line each
check "one line per document" test "$(wc -l <e.err)" -eq 6
expect_err "error line escaped" 1 '^kvzip-ingest: error: cannot read e/empty\\x1b\[2J.txt: e/empty\\x1b\[2J.txt is empty' \
  "$ING" --quiet --store s13 $'e/empty\e[2J.txt'
expect_err "query error escaped" 6 '^kvzip-query: error: cannot use document: no\\nsuch\\x07.txt: No such file' \
  "$QRY" --text $'no\nsuch\a.txt' "q"
expect_err "usage error escaped" 2 '^kvzip-query: unknown option .--bad\\x1b\[2J. \(see kvzip-query --help\)$' \
  "$QRY" --doc x $'--bad\e[2J' "q"
expect_err "ingest usage error escaped" 2 '^kvzip-ingest: unknown option .--x\\ry. ' "$ING" $'--x\ry' x.txt
finish
