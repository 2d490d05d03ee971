#!/usr/bin/env bash
# kvzip-eval --multidoc end to end with the real model on a tiny subset: two
# questions over the two smallest sample documents, ratios 1 and 0.3, 8-token answers.
#   - bad input: one line, the documented exit code
#   - the records (one JSON line per answer) and the table
#   - independent truth: a composition of one document must answer exactly as the
#     single-document mode of kvzip-eval (its own cache-building code, no
#     composition) answers from the full cache (r = 1) and from its KVzip cache
#     (r = 0.3): same text, same NLL
#   - positions: sequential questions start after both documents, parallel after
#     the longer one
#   - resume: a rerun adds nothing; a cut last line is dropped and re-measured
# Env: KVZ_BIN (build/bin), KVZ_MODEL, KVZ_SOURCE_DIR. Exit 77 = skipped.
set -u
BIN=${KVZ_BIN:-build/bin}
SRC=${KVZ_SOURCE_DIR:-.}
EVAL=$BIN/kvzip-eval
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
# expect CODE DESC CMD...: exit code CODE and exactly one line on stderr
expect() {
  local code=$1 what=$2; shift 2
  "$@" >"$T/o" 2>"$T/e"
  local rc=$?
  if [ $rc -eq "$code" ] && [ "$(wc -l <"$T/e")" -eq 1 ] && [ ! -s "$T/o" ]; then ok "$what (exit $code: $(cat "$T/e"))"
  else bad "$what: exit $rc (want $code), stderr: $(cat "$T/e")"; fi
}

[ -x "$EVAL" ] || { echo "skip: $EVAL not built"; exit 77; }
[ -f "${KVZ_MODEL:-}" ] || { echo "skip: model ${KVZ_MODEL:-unset} missing (scripts/setup)"; exit 77; }
command -v python3 >/dev/null || { echo "skip: python3 needed to check the JSON"; exit 77; }
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
export OMP_WAIT_POLICY=passive
A=halcyon_warranty_returns.md B=lab_b214_safety_sop.md
QA=$SRC/samples/questions.jsonl
# question 1: over A only, oracle A; question 2: over B and A, oracle A
python3 - "$QA" "$T/qa.jsonl" "$A" "$B" <<'PY'
import json, sys
qa, out, a, b = sys.argv[1:]
qs = [json.loads(l) for l in open(qa) if l.strip()]
qa_a = [q for q in qs if q["doc"] == a]
with open(out, "w") as f:
    for i, (docs, q) in enumerate([([a], qa_a[0]), ([b, a], qa_a[1])]):
        f.write(json.dumps({"id": "t-%d" % (i + 1), "kind": "retrieval", "docs": docs, "question": q["question"],
                            "answer": q["answer"], "accept": q["accept"], "oracle": a}) + "\n")
PY
head -c 200 "$T/qa.jsonl" | grep -q '"t-1"' || { echo "FAIL could not write the questions"; exit 1; }

# usage and input errors (checked before any model work)
"$EVAL" --multidoc --help >"$T/help" 2>&1; check "--multidoc --help exits 0" [ $? -eq 0 ]
check "--help documents the line format" grep -q '"oracle": ORACLE' "$T/help"
"$EVAL" --help >"$T/help1" 2>&1; check "the main --help names --multidoc" grep -q -- "--multidoc" "$T/help1"
expect 2 "no --out" "$EVAL" --multidoc --root "$SRC/samples" "$T/qa.jsonl"
expect 2 "unknown method" "$EVAL" --multidoc --out "$T/x" --methods best "$T/qa.jsonl"
line() { printf '%s\n' "$1" >"$T/bad.jsonl"; }
line '{"id": "b", "kind": "retrieval", "docs": ["'$A'"], "question": "q?"'
expect 3 "malformed line" "$EVAL" --multidoc --root "$SRC/samples" --out "$T/x" "$T/bad.jsonl"
check "the error names file and line" grep -q "bad.jsonl:1:" "$T/e"
line '{"id": "b", "kind": "retrieval", "docs": ["'$A'", "'$B'", "'$A'"], "question": "q?", "answer": "a"}'
expect 3 "a document named twice" "$EVAL" --multidoc --root "$SRC/samples" --out "$T/x" "$T/bad.jsonl"
check "the error names the document" grep -q "'$A' is named twice" "$T/e"
line '{"id": "b", "kind": "long", "docs": ["'$A'", "'$A'#2"], "question": "q?", "answer": "a"}'
expect 3 "a document and one of its parts" "$EVAL" --multidoc --root "$SRC/samples" --out "$T/x" "$T/bad.jsonl"
line '{"id": "b", "kind": "retrieval", "docs": ["'$A'", "no_such_doc.md"], "question": "q?", "answer": "a"}'
expect 6 "unknown document" "$EVAL" --multidoc --root "$SRC/samples" --out "$T/x" "$T/bad.jsonl"
check "the error names it" grep -q "unknown document 'no_such_doc.md'" "$T/e"
line '{"id": "b", "kind": "retrieval", "docs": ["'$A'"], "question": "q?", "answer": "a", "oracle": "'$B'"}'
expect 3 "oracle outside docs" "$EVAL" --multidoc --root "$SRC/samples" --out "$T/x" "$T/bad.jsonl"
line '{"id": "b", "kind": "sideways", "docs": ["'$A'"], "question": "q?", "answer": "a"}'
expect 3 "unknown kind" "$EVAL" --multidoc --root "$SRC/samples" --out "$T/x" "$T/bad.jsonl"
check "no results file was made by bad input" [ ! -e "$T/x" ]

# the real run
run() { "$EVAL" --multidoc --model "$KVZ_MODEL" --root "$SRC/samples" --out "$T/res.jsonl" --ratios 1,0.3 \
          --max-tokens 8 "$@" "$T/qa.jsonl"; }
t0=$(date +%s)
run >"$T/table.md" 2>"$T/log"
rc=$?
echo "kvzip-eval --multidoc took $(( $(date +%s) - t0 )) s"
check "run exits 0" [ $rc -eq 0 ]
[ $rc -eq 0 ] || cat "$T/log"
check "table header" grep -q "^| method | ratio | n | correct | accuracy % | vs oracle |" "$T/table.md"
check "a sequential 0.30 row" grep -q "^| sequential | 0.30 | 2 |" "$T/table.md"
check "a parallel 0.30 row" grep -q "^| parallel | 0.30 | 2 |" "$T/table.md"
check "an oracle 1.00 row" grep -q "^| oracle | 1.00 | 2 |" "$T/table.md"

# the single-document mode on the same document and first question: its own code path
"$EVAL" --model "$KVZ_MODEL" --docs "$A" --limit 1 --ratios 1,0.3 --baselines none --max-tokens 8 \
  --json "$T/single.json" "$QA" >/dev/null 2>"$T/log1"
check "single-document run exits 0" [ $? -eq 0 ]

python3 - "$T/res.jsonl" "$T/single.json" "$A" >"$T/py" 2>&1 <<'PY'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
single = json.load(open(sys.argv[2]))
fails = []
def need(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond: fails.append(what)
head = json.loads(lines[0])
need(head.get("kvzip_eval_multidoc") == 1 and head.get("max_tokens") == 8, "header line binds the settings")
recs = [json.loads(l) for l in lines[1:]]
key = {(r["id"], r["method"], r["ratio"]): r for r in recs}
need(len(recs) == 12 and len(key) == 12, "12 records: 2 questions x 3 methods x 2 ratios (got %d)" % len(recs))
fields = {"id", "kind", "method", "ratio", "placement", "units", "q_pos", "rows_per_head",
          "rows_full_per_head", "n_prefix", "correct", "nll", "answer", "tokens", "compose_s", "answer_s"}
need(all(fields <= set(r) for r in recs), "record fields")
need(all(isinstance(r["tokens"], list) and 0 < len(r["tokens"]) <= 8 for r in recs), "answers of 1..8 tokens")
# question 1 is over one document: every method is that document alone
q1 = [key[("t-1", m, r)] for m in ("sequential", "parallel", "oracle") for r in (1, 0.3)]
need(all(r["units"] == 1 for r in q1), "t-1 composes one document")
s = single["questions"][0]
runs = {(x["method"], x["ratio"]): x for x in s["runs"]}
o1, o3 = key[("t-1", "oracle", 1)], key[("t-1", "oracle", 0.3)]
print("single mode full: %r nll %.6f; multidoc r=1: %r nll %.6f" % (s["full"]["answer"], s["full"]["nll"], o1["answer"], o1["nll"]))
print("single mode kvzip 0.3: %r nll %.6f; multidoc r=0.3: %r nll %.6f" % (runs[("kvzip", 0.3)]["answer"],
      runs[("kvzip", 0.3)]["nll"], o3["answer"], o3["nll"]))
need(o1["answer"] == s["full"]["answer"] and abs(o1["nll"] - s["full"]["nll"]) < 1e-3,
     "r = 1: one composed document answers as the single-document full cache (text, NLL within 1e-3)")
need(o3["answer"] == runs[("kvzip", 0.3)]["answer"] and abs(o3["nll"] - runs[("kvzip", 0.3)]["nll"]) < 1e-3,
     "r = 0.3: ... and as the single-document KVzip cache")
need(key[("t-1", "sequential", 1)]["tokens"] == o1["tokens"], "t-1 sequential r = 1 equals the oracle")
# question 2: two documents
s2, p2, or2 = key[("t-2", "sequential", 1)], key[("t-2", "parallel", 1)], key[("t-2", "oracle", 1)]
P = s2["n_prefix"]
n_a = or2["q_pos"] - P
n_b = s2["q_pos"] - P - n_a
need(s2["units"] == 2 and p2["units"] == 2 and or2["units"] == 1, "t-2: two documents, oracle one")
need(s2["placement"] == "sequential" and p2["placement"] == "parallel", "placements recorded")
need(P > 0 and n_a > 0 and n_b > 0 and s2["rows_full_per_head"] == P + n_a + n_b, "sequential: prefix + A + B rows")
need(p2["q_pos"] == P + max(n_a, n_b), "parallel: the question starts after the longer document (%d = %d + max(%d, %d))"
     % (p2["q_pos"], P, n_a, n_b))
r3 = key[("t-2", "sequential", 0.3)]
need(0.2 < (r3["rows_per_head"]) / s2["rows_per_head"] < 0.45, "r = 0.3 keeps about 30%% of the rows (%.0f of %.0f)"
     % (r3["rows_per_head"], s2["rows_per_head"]))
sys.exit(1 if fails else 0)
PY
cat "$T/py"
pass=$((pass + $(grep -c '^ok ' "$T/py")))
fail=$((fail + $(grep -c '^FAIL' "$T/py")))
grep -q '^ok   header line' "$T/py" || bad "the results could be read"

# resume: nothing left to do; then a cut last line is dropped and measured again
n0=$(wc -l <"$T/res.jsonl")
run >"$T/table2.md" 2>"$T/log2"
check "rerun exits 0" [ $? -eq 0 ]
check "rerun adds no record" [ "$(wc -l <"$T/res.jsonl")" -eq "$n0" ]
check "rerun reports 0 compositions to run" grep -q " 0 compositions to run, 12 answers recorded" "$T/log2"
check "rerun prints the same table" cmp -s <(grep '^|' "$T/table.md") <(grep '^|' "$T/table2.md")
last=$(tail -n 1 "$T/res.jsonl")
head -n $((n0 - 1)) "$T/res.jsonl" >"$T/cut"
printf '%s' "${last:0:40}" >>"$T/cut"
cp "$T/cut" "$T/res.jsonl"
run >/dev/null 2>"$T/log3"
check "a run after a cut line exits 0" [ $? -eq 0 ]
check "it says it dropped the line" grep -q "dropping an incomplete last line" "$T/log3"
check "the record is measured again" [ "$(wc -l <"$T/res.jsonl")" -eq "$n0" ]
check "... and equals the first measurement" [ "$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); r.pop("compose_s"); r.pop("answer_s"); print(json.dumps(r, sort_keys=True))' "$(tail -n 1 "$T/res.jsonl")")" = "$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); r.pop("compose_s"); r.pop("answer_s"); print(json.dumps(r, sort_keys=True))' "$last")" ]
expect 2 "other --max-tokens on the same --out" run --max-tokens 9

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
