#!/usr/bin/env python3
"""Multi-document evaluation driver (issue 14) over the real CLI.

For each question of samples/multidoc/questions.jsonl (filtered by --kinds / --ids /
--limit) and each ratio, asks `kvzip-query --json` over the composed documents with
each placement and over the oracle (for retrieval: the one document holding the
answer; for long: the part ID#N holding it), from a store ingested at that ratio
(--store-pattern, e.g. /tmp/st_{r}). Reports per method and ratio: accuracy (an
"accept" string in the answer, case-insensitive) and agreement with the oracle
(answer text equal to the oracle method's answer at the same ratio). Timing: for
--timing-question, each composed document is also loaded alone, and the composed
time to first token (load + question prefill) is compared with the sum of the
single loads plus the question prefill.

ΔNLL is not computed here (kvzip-query does not teacher-force); see docs/EVAL.md.
"""
import argparse, json, os, subprocess, sys, time


def ask(binary, store, docs, questions, placement, max_tokens, extra):
    cmd = [binary, "--store", store, "--json", "--max-tokens", str(max_tokens)]
    for d in docs:
        cmd += ["--doc", d]
    if placement:
        cmd += ["--placement", placement]
    cmd += extra + ["--"] + questions
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError("%s: exit %d: %s" % (" ".join(cmd), p.returncode, p.stderr.strip()))
    return [json.loads(l) for l in p.stdout.splitlines() if l.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("questions")
    ap.add_argument("--bin", default="build/bin/kvzip-query")
    ap.add_argument("--store-pattern", required=True, help="store per ratio, {r} replaced")
    ap.add_argument("--ratios", default="0.3")
    ap.add_argument("--kinds", default="retrieval")
    ap.add_argument("--only-small", action="store_true", help="skip questions naming multidoc/ documents")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--ids", default="", help="comma-separated question ids (default all)")
    ap.add_argument("--methods", default="sequential,parallel,oracle")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--key-scale", default="")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    qs = [json.loads(l) for l in open(a.questions) if l.strip()]
    qs = [q for q in qs if q["kind"] in a.kinds.split(",")]
    if a.only_small:
        qs = [q for q in qs if not any(d.startswith("multidoc/") for d in q["docs"])]
    if a.ids:
        qs = [q for q in qs if q["id"] in a.ids.split(",")]
    if a.limit:
        qs = qs[: a.limit]
    methods = a.methods.split(",")
    extra = ["--key-scale", a.key_scale] if a.key_scale else []
    rows, results = [], []
    for r in a.ratios.split(","):
        store = a.store_pattern.replace("{r}", r)
        per = {m: [] for m in methods}
        for q in qs:
            ans = {}
            for m in methods:
                if m == "oracle":
                    if q["kind"] == "long":
                        docs = ["%s#%d" % (q["docs"][0], q["oracle"])]
                    elif q["kind"] == "retrieval":
                        docs = [q["oracle"]]
                    else:
                        continue
                    pl = None
                else:
                    docs, pl = q["docs"], m
                t0 = time.time()
                o = ask(a.bin, store, docs, [q["question"]], pl, a.max_tokens,
                        extra if m == "parallel" else [])[0]
                ans[m] = o
                ok = any(s.lower() in o["answer"].lower() for s in q["accept"])
                per[m].append((q["id"], ok, o))
                results.append({"ratio": float(r), "id": q["id"], "method": m, "answer": o["answer"],
                                "correct": ok, "doc_prefill_s": o["doc_prefill_s"], "ttft_s": o["ttft_s"],
                                "wall_s": time.time() - t0})
                print("r=%s %-10s %-13s %s %s" % (r, m, q["id"], "OK " if ok else "-- ",
                                                   o["answer"][:70].replace("\n", " ")), flush=True)
            if "oracle" in ans:
                for m in methods:
                    if m != "oracle" and m in ans:
                        results.append({"ratio": float(r), "id": q["id"], "method": m + "/agree",
                                        "agree": ans[m]["answer"].strip() == ans["oracle"]["answer"].strip()})
        for m in methods:
            n = len(per[m])
            if not n:
                continue
            acc = sum(ok for _, ok, _ in per[m]) / n
            ag = [x["agree"] for x in results if x["ratio"] == float(r) and x["method"] == m + "/agree"]
            rows.append((r, m, n, acc, (sum(ag) / len(ag)) if ag else None))
    print("\n| ratio | method | questions | accuracy | agreement with oracle |")
    print("|---|---|---|---|---|")
    for r, m, n, acc, ag in rows:
        print("| %s | %s | %d | %.1f%% | %s |" % (r, m, n, 100 * acc, "-" if ag is None else "%.1f%%" % (100 * ag)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": rows, "answers": results}, f, indent=1)


if __name__ == "__main__":
    main()
