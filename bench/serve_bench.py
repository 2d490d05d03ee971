#!/usr/bin/env python3
"""Concurrency bench for kvzip-serve (issue 15's H200 targets), stdlib only.

  serve_bench.py URL DOC[,DOC...] QUESTION CONCURRENCY[,C...] REQUESTS_PER_CLIENT MAX_TOKENS

For each concurrency C: C client threads each send REQUESTS_PER_CLIENT streaming chat
requests (greedy, "documents": [one of DOCs, round robin], max_tokens MAX_TOKENS, and
"ignore_eos"-free: a synthetic model rarely stops early). Per request it records the
time to the first content chunk (TTFT) and the decode rate after it
((completion_tokens - 1) / (end - first chunk)). Prints one JSON line per C: requests,
errors, aggregate completion tokens/s over the wall time, mean per-stream decode tok/s,
TTFT p50/p99; the ratio of aggregate tok/s to the C=first run's; and from /metrics
before and after the run, its decode steps: mean step ms (kvzip_batch_step_seconds),
mean step size, and how many were replayed from a CUDA graph, captured, eager, or one
pass per answer. Exit 1 on any error.

  serve_bench.py --reprefill URL DOCDIR DOC[,DOC...] QUESTION

From the store vs re-prefill, at the server (the #8 target): on a server whose session
cache is cold for DOCs (a fresh process), after one warm-up plain chat, per document:
(i) the FIRST request naming it (store load + question prefill), (ii) the same request
again (the decoded session kept: a cache hit), (iii) a plain chat (no "documents") whose
user message is the document's text (DOCDIR/DOC, the file that was ingested) followed by
the question: a re-prefill of the document, median of 3. Each: streamed, greedy,
max_tokens 2, TTFT = request sent -> first SSE chunk (the server sends its first chunk
with the first token). Prints one markdown table (TTFTs in ms, the prompt tokens the
server counted, re-prefill / store). The server must accept an 8K-token question
(kvzip-serve --budget 0: no output-cache bound on the question). Exit 1 on any error.
"""
import json, os, statistics, sys, threading, time, urllib.request


def chunks(url, body):
    """The parsed SSE chunks of one streamed chat request, in order; an error chunk raises."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return
            o = json.loads(data)
            if "error" in o:
                raise RuntimeError(o["error"]["message"])
            yield o


def ttft(url, body):
    """(seconds to the first SSE chunk, prompt tokens) of one streamed request."""
    t0 = time.monotonic()
    first, prompt = None, -1
    for o in chunks(url, body):
        if first is None and o.get("choices"):
            first = time.monotonic()
        if o.get("usage"):
            prompt = o["usage"]["prompt_tokens"]
    if first is None:
        raise RuntimeError("no chunk with a token")
    return first - t0, prompt


def reprefill(url, docdir, docs, question):
    listing = json.loads(urllib.request.urlopen(url + "/v1/documents", timeout=60).read())
    entries = listing["data"] if isinstance(listing, dict) else listing
    def stored_tokens(doc):  # a split document is listed by part: "ID#1", "ID#2", ...
        return sum(e.get("tokens", 0) for e in entries if e["id"] == doc or e["id"].startswith(doc + "#"))
    base = {"max_tokens": 2, "temperature": 0, "stream": True}
    ttft(url, dict(base, messages=[{"role": "user", "content": "Hello"}]))  # warm-up: no document
    print("| document | stored tokens | from the store: first request TTFT ms (load + question prefill) | "
          "cached: second request TTFT ms | re-prefill: plain chat with the text TTFT ms (median of 3) | "
          "re-prefill prompt tokens | re-prefill ÷ store |")
    print("|---|---|---|---|---|---|---|")
    for doc in docs:
        text = open(os.path.join(docdir, doc), encoding="utf-8").read()
        q = dict(base, messages=[{"role": "user", "content": question}], documents=[doc])
        cold, _ = ttft(url, q)
        warm, _ = ttft(url, q)
        plain = dict(base, messages=[{"role": "user", "content": text + "\n\nQuestion: " + question}])
        runs = [ttft(url, plain) for _ in range(3)]
        re_s = statistics.median(r[0] for r in runs)
        print(f"| {doc} | {stored_tokens(doc)} | {cold * 1e3:.1f} | {warm * 1e3:.1f} | {re_s * 1e3:.1f} | "
              f"{runs[0][1]} | {re_s / cold:.2f} |", flush=True)


if len(sys.argv) == 6 and sys.argv[1] == "--reprefill":
    try:
        reprefill(sys.argv[2], sys.argv[3], sys.argv[4].split(","), sys.argv[5])
    except Exception as e:  # one line, non-zero exit
        print(f"serve_bench --reprefill: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    sys.exit(0)
if len(sys.argv) != 7:
    print(__doc__, file=sys.stderr)
    sys.exit(2)
url, docs, question = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
concs = [int(c) for c in sys.argv[4].split(",")]
per, max_tokens = int(sys.argv[5]), int(sys.argv[6])


def one(doc, out, lock):
    body = {"messages": [{"role": "user", "content": question}], "documents": [doc],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    first = None
    n = 0
    try:
        for o in chunks(url, body):
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


def metrics():
    """The server's /metrics counters of the batch (name{labels} -> value); {} if unreadable."""
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    except Exception:
        return {}
    m = {}
    for line in text.splitlines():
        if line.startswith("kvzip_batch_"):
            k, _, v = line.rpartition(" ")
            try:
                m[k] = float(v)
            except ValueError:
                pass
    return m


def run(c):
    m0 = metrics()
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
    m1 = metrics()
    d = lambda k: m1.get(k, 0) - m0.get(k, 0)
    tt = sorted(out["ttft"])
    pct = lambda p: round(tt[min(len(tt) - 1, int(p * len(tt)))], 4) if tt else -1
    r = {"concurrency": c, "requests": out["done"], "errors": len(out["errors"]),
         "error_kinds": sorted(set(out["errors"]))[:3], "wall_s": round(wall, 2),
         "agg_tok_s": round(out["tokens"] / wall, 1),
         "stream_decode_tok_s": round(sum(out["rate"]) / len(out["rate"]), 1) if out["rate"] else 0,
         "ttft_p50_s": pct(0.5), "ttft_p99_s": pct(0.99)}
    n = d("kvzip_batch_step_seconds_count")
    if n > 0:  # this run's decode steps (--max-batch > 1): mean time and size, how they ran
        r["step_ms_mean"] = round(1e3 * d("kvzip_batch_step_seconds_sum") / n, 3)
        r["step_size_mean"] = round(d("kvzip_batch_size_sum") / n, 2)
        r["steps"] = {p: int(d(f'kvzip_batch_step_path_total{{path="{p}"}}'))
                      for p in ("replay", "capture", "eager", "passes")}
    return r


base = None
bad = 0
for c in concs:
    r = run(c)
    base = base or r["agg_tok_s"]
    r["agg_vs_first"] = round(r["agg_tok_s"] / base, 2) if base else 0
    bad += r["errors"]
    print(json.dumps(r), flush=True)
sys.exit(1 if bad else 0)
