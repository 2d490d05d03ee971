#!/usr/bin/env python3
# Split-document proxy for the long-manual set: a sample document stored in 240-token
# parts (store /tmp/md_st, r = 0.3) asked by its id (all parts) sequential / parallel,
# against the same document stored whole at r = 0.3 (/tmp/md_eval/st_0.3).
import json, subprocess, collections
qs = [json.loads(l) for l in open("samples/questions.jsonl")]
per = collections.defaultdict(list)
for q in qs:
    if q["doc"] in ("halcyon_warranty_returns.md", "lab_b214_safety_sop.md", "corvid_cr8_router_guide.md"):
        per[q["doc"]].append(q)
sel = [q for d in per for q in per[d][:2]]
res = collections.defaultdict(list)
for q in sel:
    ans = {}
    for m, st, extra in (("split-sequential", "/tmp/md_st", ["--placement", "sequential"]),
                         ("split-parallel", "/tmp/md_st", ["--placement", "parallel"]),
                         ("whole", "/tmp/md_eval/st_0.3", [])):
        p = subprocess.run(["build/bin/kvzip-query", "--store", st, "--doc", q["doc"], "--json",
                            "--max-tokens", "24"] + extra + ["--", q["question"]], capture_output=True, text=True)
        o = json.loads(p.stdout) if p.returncode == 0 else {"answer": "ERROR " + p.stderr}
        ok = any(a.lower() in o["answer"].lower() for a in q["accept"])
        ans[m] = o["answer"].strip()
        res[m].append(ok)
        print(m, q["doc"], "OK" if ok else "--", o["answer"][:60].replace("\n", " "), flush=True)
    for m in ("split-sequential", "split-parallel"):
        res[m + "/agree"].append(ans[m] == ans["whole"])
for m, v in res.items():
    print("%s: %d/%d" % (m, sum(v), len(v)))
