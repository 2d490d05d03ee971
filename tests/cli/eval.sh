#!/usr/bin/env bash
# kvzip-eval end to end on a small subset: the two smallest sample documents, two
# questions each, ratios 1 and 0.3, 8-token answers. Checks the exit codes of bad
# input, the markdown table, the --json structure, and that at ratio 1.0 the
# KVzip cache answers exactly like the full cache (100% agreement, ΔNLL 0).
# Env: KVZ_BIN (build/bin), KVZ_MODEL, KVZ_SOURCE_DIR. Exit 77 = skipped.
set -u
BIN=${KVZ_BIN:-build/bin}
SRC=${KVZ_SOURCE_DIR:-.}
EVAL=$BIN/kvzip-eval
QA=$SRC/samples/questions.jsonl
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }

[ -x "$EVAL" ] || { echo "skip: $EVAL not built"; exit 77; }
[ -f "${KVZ_MODEL:-}" ] || { echo "skip: model ${KVZ_MODEL:-unset} missing (scripts/setup)"; exit 77; }
command -v python3 >/dev/null || { echo "skip: python3 needed to check the JSON"; exit 77; }
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT

# usage and input errors (no model work)
"$EVAL" --help >"$T/help" 2>&1; check "--help exits 0" [ $? -eq 0 ]
check "--help lists the methods" grep -q "snapkv" "$T/help"
"$EVAL" --ratios 0,0.5 "$QA" >/dev/null 2>&1; check "ratio 0 is a usage error (2)" [ $? -eq 2 ]
"$EVAL" --baselines h2o "$QA" >/dev/null 2>&1; check "unknown baseline is a usage error (2)" [ $? -eq 2 ]
"$EVAL" "$T/none.jsonl" >/dev/null 2>&1; check "missing file exits 6" [ $? -eq 6 ]
"$EVAL" --docs no_such_doc "$QA" >/dev/null 2>&1; check "--docs with no match exits 6" [ $? -eq 6 ]
printf '{"doc": "x.md", "question": "q"}\n' >"$T/bad.jsonl"
"$EVAL" "$T/bad.jsonl" >/dev/null 2>"$T/err"; check "line without answer exits 3" [ $? -eq 3 ]
check "the error names the line" grep -q "bad.jsonl:1" "$T/err"
"$EVAL" --device tpu "$QA" >/dev/null 2>"$T/err"; check "--device tpu is a usage error (2)" [ $? -eq 2 ]
check "--device names what it takes" grep -q "cpu, cuda, cuda:K or auto" "$T/err"
# --device cuda: runs where a GPU is usable; elsewhere one line and exit 4 (no GPU / no CUDA build)
"$EVAL" --device cuda --model "$KVZ_MODEL" --docs halcyon_warranty_returns --limit 1 --ratios 1 --baselines none \
    --max-tokens 4 -q --json "$T/cuda.json" "$QA" >/dev/null 2>"$T/err"
rc=$?
if [ $rc -eq 0 ]; then
    check "--device cuda ran on the GPU" grep -q '"device": "cuda"' "$T/cuda.json"
else
    check "--device cuda without a GPU exits 4" [ $rc -eq 4 ]
    check "... with one line saying so" bash -c '[ "$(wc -l <"$1")" -eq 1 ] && grep -q "(no GPU available)" "$1"' _ "$T/err"
fi

# the real run
t0=$(date +%s)
"$EVAL" --model "$KVZ_MODEL" --docs halcyon_warranty_returns,lab_b214_safety_sop --per-doc 2 \
    --ratios 1,0.3 --max-tokens 8 --json "$T/out.json" "$QA" >"$T/table.md" 2>"$T/log"
rc=$?
echo "kvzip-eval took $(( $(date +%s) - t0 )) s"
check "run exits 0" [ $rc -eq 0 ]
[ $rc -eq 0 ] || cat "$T/log"
check "table header on stdout" grep -q "^| method | ratio | agreement % | accuracy % | mean ΔNLL | KV MB |" "$T/table.md"
check "table has a kvzip 0.30 row" grep -q "^| kvzip | 0.30 |" "$T/table.md"
python3 - "$T/out.json" >"$T/py" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
fails = []
def need(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond: fails.append(what)
need(d["ratios"] == [1, 0.3], "json ratios")
need(d["settings"]["device"] == "cpu", "json settings.device is the default cpu")
need(d["methods"] == ["kvzip", "random", "window", "snapkv", "snapkv-q1"], "json methods")
need(len(d["docs"]) == 2 and all(x["n_ctx"] > 0 and x["questions"] == 2 for x in d["docs"]), "json docs")
need(len(d["questions"]) == 4, "json has 4 questions")
res = {(r["method"], r["ratio"]): r for r in d["results"]}
need(len(d["results"]) == 8 and all((m, r) in res for m in ("kvzip", "random", "window", "snapkv") for r in (1, 0.3)),
     "json results: 4 methods x 2 ratios")
need(all(set(r) >= {"n", "agreement", "accuracy", "delta_nll", "kv_mb"} and r["n"] == 4 for r in d["results"]),
     "json result fields")
k1 = res[("kvzip", 1)]
need(k1["agreement"] == 100.0, "kvzip at ratio 1.0 agrees 100% with the full cache")
need(abs(k1["delta_nll"]) < 1e-4, "kvzip at ratio 1.0 has ΔNLL 0")
need(k1["kv_mb"] == d["full"]["kv_mb"], "ratio 1.0 keeps the full cache's bytes")
k3 = res[("kvzip", 0.3)]
need(0.2 * k1["kv_mb"] < k3["kv_mb"] < 0.45 * k1["kv_mb"], "ratio 0.3 keeps about 30% of the bytes (plus prefix)")
need(all(abs(res[(m, 0.3)]["kv_mb"] - k3["kv_mb"]) < 0.01 * k3["kv_mb"] for m in ("random", "window", "snapkv")),
     "baselines run at equal KV size")
for q in d["questions"]:
    runs = {(r["method"], r["ratio"]): r for r in q["runs"]}
    if not (runs[("kvzip", 1)]["answer"] == q["full"]["answer"] and runs[("kvzip", 1)]["agree"]):
        need(False, "per-question kvzip 1.0 answer equals full: " + q["question"])
need(all(q["full"]["agree"] and isinstance(q["full"]["answer"], str) for q in d["questions"]), "per-question full answers")
need(d["multi_query"] == [], "no multi-query rows with < 3 questions per document")
sys.exit(1 if fails else 0)
PY
cat "$T/py"
pass=$((pass + $(grep -c '^ok ' "$T/py")))
fail=$((fail + $(grep -c '^FAIL' "$T/py")))
grep -q '^ok   json ratios' "$T/py" || bad "the JSON could be read"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
