#!/usr/bin/env python3
"""Ingest one document into a store and answer a question from its compressed cache,
through the installed library (pip install ./python; see python/README.md):

    python3 ask.py --model MODEL.gguf [--store DIR] DOCUMENT "question"
"""
import argparse
import os
import sys

import kvzip


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--store", default="kvzip-store")
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("document")
    ap.add_argument("question")
    a = ap.parse_args()
    doc_id = os.path.basename(a.document)
    with open(a.document, encoding="utf-8") as f:
        text = f.read()
    with kvzip.Model(a.model, device="cpu") as m, kvzip.Store(a.store, "c", model=m) as st:
        r = kvzip.ingest(m, st, doc_id, text, ratio=a.ratio, source_path=a.document)
        print(f"ask.py: {doc_id}: {r['tokens']} tokens, {r['pairs_kept']} of {r['pairs_total']} "
              f"context KV pairs kept", file=sys.stderr)
        with kvzip.Session(m, st, doc_id) as s:
            pieces = []

            def show(piece):
                pieces.append(piece)
                print(piece, end="", flush=True)

            answer = s.ask(a.question, stream=show)
            print()
            assert "".join(pieces) == answer, "the stream and the answer differ"
            print(f"ask.py: {s.last_stats['answer_tokens']} answer tokens, first after "
                  f"{s.last_stats['ttft_s']:.3f} s, output cache {s.last_stats['out_used']} of "
                  f"{s.last_stats['out_slots']} slots", file=sys.stderr)


if __name__ == "__main__":
    main()
