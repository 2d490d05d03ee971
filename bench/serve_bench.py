#!/usr/bin/env python3
"""Concurrency bench for kvzip-serve (issue 15's H200 targets), stdlib only.

  serve_bench.py URL DOC[,DOC...] QUESTION CONCURRENCY[,C...] REQUESTS_PER_CLIENT MAX_TOKENS

For each concurrency C: C client threads each send REQUESTS_PER_CLIENT streaming chat
requests (greedy, "documents": [one of DOCs, round robin], max_tokens MAX_TOKENS, and
"ignore_eos"-free: a synthetic model rarely stops early). Per request it records the
time to the first content chunk (TTFT) and the decode rate after it
((completion_tokens - 1) / (end - first chunk)). Prints one JSON line per C: requests,
errors, aggregate completion tokens/s over the wall time, mean per-stream decode tok/s,
TTFT p50/p99; and the ratio of aggregate tok/s to the C=first run's. Exit 1 on any error.
"""
import json, sys, threading, time, urllib.request

url, docs, question = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
concs = [int(c) for c in sys.argv[4].split(",")]
per, max_tokens = int(sys.argv[5]), int(sys.argv[6])


def one(doc, out, lock):
    body = json.dumps({"messages": [{"role": "user", "content": question}], "documents": [doc],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    first = None
    n = 0
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                o = json.loads(data)
                if "error" in o:
                    raise RuntimeError(o["error"]["message"])
                if first is None and o.get("choices") and o["choices"][0]["delta"].get("content"):
                    first = time.monotonic()
                if o.get("usage"):
                    n = o["usage"]["completion_tokens"]
        end = time.monotonic()
        if n < 1:
            raise RuntimeError("no tokens")
        with lock:
            out["tokens"] += n
            if first is not None:  # a synthetic model's tokens mostly decode to no text
                out["ttft"].append(first - t0)
                if n > 1 and end > first:
                    out["rate"].append((n - 1) / (end - first))
            else:
                out["rate"].append(n / (end - t0))
            out["done"] += 1
    except Exception as e:
        with lock:
            out["errors"].append(f"{type(e).__name__}: {e}"[:200])


def run(c):
    out = {"ttft": [], "rate": [], "tokens": 0, "errors": [], "done": 0}
    lock = threading.Lock()

    def client(i):
        for k in range(per):
            one(docs[(i + k) % len(docs)], out, lock)

    t0 = time.monotonic()
    ts = [threading.Thread(target=client, args=(i,)) for i in range(c)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    tt = sorted(out["ttft"])
    pct = lambda p: round(tt[min(len(tt) - 1, int(p * len(tt)))], 4) if tt else -1
    return {"concurrency": c, "requests": out["done"], "errors": len(out["errors"]),
            "error_kinds": sorted(set(out["errors"]))[:3], "wall_s": round(wall, 2),
            "agg_tok_s": round(out["tokens"] / wall, 1),
            "stream_decode_tok_s": round(sum(out["rate"]) / len(out["rate"]), 1) if out["rate"] else 0,
            "ttft_p50_s": pct(0.5), "ttft_p99_s": pct(0.99)}


base = None
bad = 0
for c in concs:
    r = run(c)
    base = base or r["agg_tok_s"]
    r["agg_vs_first"] = round(r["agg_tok_s"] / base, 2) if base else 0
    bad += r["errors"]
    print(json.dumps(r), flush=True)
sys.exit(1 if bad else 0)
