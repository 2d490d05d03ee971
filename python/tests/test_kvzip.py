"""Binding tests on the real model ($KVZ_MODEL) and a tiny synthetic one: errors map
to KvzipError codes, streaming equals the answer, a text session equals a stored r=1.0
f32 session, two Python threads with their own sessions on one model answer as one
thread does, closed handles raise."""
import os
import sys
import tempfile
import threading

import kvzip

passed = failed = 0


def check(cond, what):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print("FAIL:", what, file=sys.stderr)


def raises(code, fn):
    try:
        fn()
    except kvzip.KvzipError as e:
        return e.code == code
    return False


doc = ("The Quillmark 7 label printer ships with firmware 4.2. Its service PIN is 7731 and the "
       "maintenance interval is 90 days.")
with tempfile.TemporaryDirectory() as d:
    check(raises(kvzip.ERR_NOTFOUND, lambda: kvzip.Model("/nonexistent.gguf")), "missing model")
    check(raises(kvzip.ERR_NOTFOUND, lambda: kvzip.Store(os.path.join(d, "none"), "r")), "missing store")
    tiny = kvzip.Model(synthetic="tiny-llama", device="cpu")
    check(tiny.info["arch"] == "llama" and tiny.info["n_layer"] == 2, "model info")
    st = kvzip.Store(os.path.join(d, "s"), "c", model=tiny)
    r = kvzip.ingest(tiny, st, "q.txt", doc, ratio=1.0, kv_dtype="f32")
    check(r["parts"] == 1 and r["written"] == 1 and "q.txt" in st, "ingest")
    check(raises(kvzip.ERR_EMPTY, lambda: kvzip.ingest(tiny, st, "e", "  ")), "empty text")
    with kvzip.Session(tiny, st, "q.txt", max_tokens=16) as s, \
         kvzip.Session(tiny, text=doc, max_tokens=16) as t:
        pieces = []
        a = s.ask("What is the PIN?", stream=pieces.append)
        check("".join(pieces) == a and s.last_stats["answer_tokens"] > 0, "stream == answer")
        check(t.ask("What is the PIN?") == a, "text session == stored r=1 session")
        check(raises(kvzip.ERR_EMPTY, lambda: s.ask("")), "empty question")
    with kvzip.Session(tiny, chat=True, max_tokens=8) as c:
        check(c.info["doc_tokens"] == c.info["prefix_tokens"] > 0 and c.info["from_store"] == 0,
              "chat session holds the prefix only")
        check(isinstance(c.ask("Say hello."), str) and c.last_stats["answer_tokens"] > 0, "chat answers")
    try:
        kvzip.Session(tiny, text=doc, chat=True)
        both = False
    except ValueError:
        both = True
    check(both, "text and chat at once is refused")
    check(raises(kvzip.ERR_NOTFOUND, lambda: kvzip.Session(tiny, st, "nope")), "unknown doc")
    st.close()
    check(raises(kvzip.ERR_CLOSED, lambda: "q.txt" in st), "closed store")
    tiny.close()

    model = os.environ.get("KVZ_MODEL")
    if model and os.path.exists(model):
        m = kvzip.Model(model, device="cpu")
        check(m.info["chat"] == "smollm", "chat template recognised")
        text = open(os.path.join(os.path.dirname(__file__), "..", "..", "samples",
                                 "lab_b214_safety_sop.md"), encoding="utf-8").read()
        qs = ["Who is the lab manager?", "What is the SOP number?"]
        alone = []
        for q in qs:
            with kvzip.Session(m, text=text, max_tokens=24) as s:
                alone.append(s.ask(q))
        together = [None, None]

        def run(i):
            with kvzip.Session(m, text=text, max_tokens=24) as s:
                together[i] = s.ask(qs[i])

        th = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for x in th:
            x.start()
        for x in th:
            x.join()
        check(together == alone, f"threads {together} vs alone {alone}")
        check("Marwood" in alone[0], f"answer {alone[0]!r}")
        m.close()
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
