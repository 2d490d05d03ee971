#!/usr/bin/env python3
"""Load client for tests/cli/serve.sh: C concurrent clients x R streaming requests
against /v1/chat/completions (stdlib only). Prints one JSON line: ok, errors, ttft
p50/p99 (client side, first content chunk), tokens/s over the run, each distinct
error, and with an 8th argument (the expected answer) how many answers differ from it
(mismatch). Exit 0 always; the caller asserts on the figures."""
import json, sys, threading, time, urllib.request, urllib.error

url, key, doc, question = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
clients, per, max_tokens = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
expect = sys.argv[8] if len(sys.argv) > 8 else None
lock = threading.Lock()
ttfts, errors, tokens, mismatch = [], [], [0], []

def one():
    body = json.dumps({"messages": [{"role": "user", "content": question}], "documents": [doc],
                       "max_tokens": max_tokens, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
    t0 = time.monotonic()
    first, done, n, text = None, False, 0, ""
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                o = json.loads(data)
                if "error" in o:
                    raise RuntimeError(o["error"]["message"])
                if o["choices"] and o["choices"][0]["delta"].get("content"):
                    text += o["choices"][0]["delta"]["content"]
                    if first is None:
                        first = time.monotonic() - t0
                if "usage" in o:
                    n = o["usage"]["completion_tokens"]
        if not done or first is None:
            raise RuntimeError("stream ended without [DONE] or content")
        with lock:
            ttfts.append(first)
            tokens[0] += n
            if expect is not None and text != expect:
                mismatch.append(text)
    except Exception as e:  # HTTPError included: any failure counts
        msg = f"{type(e).__name__}: {e}"
        if isinstance(e, urllib.error.HTTPError):
            msg += " " + e.read().decode(errors="replace")[:200]
        with lock:
            errors.append(msg)

def client():
    for _ in range(per):
        one()

t0 = time.monotonic()
ts = [threading.Thread(target=client) for _ in range(clients)]
for t in ts: t.start()
for t in ts: t.join()
wall = time.monotonic() - t0
ttfts.sort()
pct = lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else -1
print(json.dumps({"ok": len(ttfts), "errors": len(errors), "error_kinds": sorted(set(errors))[:5],
                  "mismatch": len(mismatch), "mismatch_kinds": sorted(set(mismatch))[:3],
                  "ttft_p50": round(pct(0.5), 3), "ttft_p99": round(pct(0.99), 3),
                  "tokens": tokens[0], "wall_s": round(wall, 2), "tok_s": round(tokens[0] / wall, 2)}))
