#!/usr/bin/env python3
"""Check samples/multidoc/questions.jsonl against the documents it names.

Standard library only. Part boundaries are computed the way kvzip-ingest cuts a
document (cli/kvzip-ingest.c): the whole file is tokenized with the model's
tokenizer (no special tokens), parts = ceil(n / max_part), and part p (0-based)
is the token range [n*p/parts, n*(p+1)/parts) with integer division, i.e.
near-equal consecutive token ranges; no paragraph or line alignment. The text
of a part is the concatenation of its tokens' bytes (from `kvzip-tokenize
--pieces`), checked to reproduce the file byte for byte.

Usage:
  python3 samples/multidoc/check.py              # check everything, exit 1 on any failure
  python3 samples/multidoc/check.py --parts      # also print each split document's parts
  python3 samples/multidoc/check.py --find TEXT  # where TEXT occurs (document, part)

Options: --tokenize PATH (default: $KVZ_TOKENIZE, else build/bin/kvzip-tokenize
of this repository, else kvzip-tokenize on PATH), --model PATH (passed on; the
tool's own default is models/SmolLM2-135M-Instruct.Q4_1.gguf in the repository
root, where it is run), --part-tokens N (default 5808: what kvzip-ingest allows
per part with the default model), --questions FILE, --samples DIR.
"""
import argparse
import ast
import json
import operator
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLES = os.path.dirname(HERE)
REPO = os.path.dirname(SAMPLES)
KINDS = ("long", "retrieval", "cross")
MIN_LONG, MIN_RETRIEVAL, MIN_CROSS = 20, 30, 10
K_RETRIEVAL = 4
MIN_LONG_PARTS = 3


def find_tokenizer(arg):
    for cand in (arg, os.environ.get("KVZ_TOKENIZE"), os.path.join(REPO, "build", "bin", "kvzip-tokenize")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    found = shutil.which("kvzip-tokenize")
    if found:
        return found
    sys.exit("check.py: cannot find kvzip-tokenize (build the project, or pass --tokenize PATH)")


def token_pieces(tool, model, data):
    """Byte strings of the tokens of @data, in order."""
    cmd = [tool, "--pieces"] + (["--model", model] if model else [])
    r = subprocess.run(cmd, input=data, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    if r.returncode != 0:
        sys.exit("check.py: %s failed: %s" % (" ".join(cmd), r.stderr.decode("utf-8", "replace").strip()))
    pieces = []
    for line in r.stdout.split(b"\n"):
        if not line:
            continue
        tid, _, js = line.partition(b"\t")
        # raw bytes inside the JSON string (a token may hold part of a UTF-8
        # character): keep them with surrogateescape through json.loads
        s = json.loads(js.decode("utf-8", "surrogateescape"))
        pieces.append(s.encode("utf-8", "surrogateescape"))
    return pieces


class Doc:
    def __init__(self, did, path, tool, model, max_part):
        self.id, self.path = did, path
        with open(path, "rb") as f:
            self.data = f.read()
        self.text = self.data.decode("utf-8")
        self.low = self.text.lower()
        pieces = token_pieces(tool, model, self.data)
        if b"".join(pieces) != self.data:
            sys.exit("check.py: the tokens of %s do not reproduce the file" % did)
        self.n = len(pieces)
        offs = [0]
        for p in pieces:
            offs.append(offs[-1] + len(p))
        self.parts = []  # (first token, end token, text)
        nparts = (self.n + max_part - 1) // max_part
        for p in range(nparts):
            s0, s1 = self.n * p // nparts, self.n * (p + 1) // nparts
            t = self.data[offs[s0]:offs[s1]].decode("utf-8", "replace")
            self.parts.append((s0, s1, t, t.lower()))

    def has(self, s):
        return s.lower() in self.low

    def parts_with(self, s):
        return [i + 1 for i, p in enumerate(self.parts) if s.lower() in p[3]]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}


def calc(expr):
    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.operand))
        raise ValueError("unsupported expression")
    return ev(ast.parse(expr, mode="eval"))


def fmt_num(v):
    if abs(v - round(v)) < 1e-9:
        return "{:,}".format(int(round(v)))
    return ("%.2f" % v).rstrip("0")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", default=os.path.join(HERE, "questions.jsonl"))
    ap.add_argument("--samples", default=SAMPLES)
    ap.add_argument("--tokenize")
    ap.add_argument("--model")
    ap.add_argument("--part-tokens", type=int, default=5808)
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--find")
    a = ap.parse_args()
    tool = find_tokenizer(a.tokenize)

    docs = {}

    def doc(did):
        if did not in docs:
            path = os.path.join(a.samples, did)
            parts = did.split("/")
            ok_name = (not os.path.isabs(did) and all(p and not p.startswith(".") for p in parts)
                       and (os.path.splitext(did)[1] in (".md", ".txt", "")))
            if not ok_name or not os.path.isfile(path):
                return None
            docs[did] = Doc(did, path, tool, a.model, a.part_tokens)
        return docs[did]

    if a.find:
        for root, dirs, files in os.walk(a.samples):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for fn in sorted(files):
                if fn.startswith(".") or os.path.splitext(fn)[1] not in (".md", ".txt"):
                    continue
                did = os.path.relpath(os.path.join(root, fn), a.samples)
                d = doc(did)
                if d.has(a.find):
                    print("%s: %d tokens, %d part(s); in part(s) %s" % (did, d.n, len(d.parts), d.parts_with(a.find)))
        return 0

    errors = []
    counts = {k: 0 for k in KINDS}
    covered = {}  # long doc -> set of parts
    seen_q = set()
    with open(a.questions, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for ln, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = "line %d" % ln

        def err(msg):
            errors.append("%s: %s" % (where, msg))

        try:
            q = json.loads(line)
        except ValueError as e:
            err("not JSON: %s" % e)
            continue
        kind, ids, accept = q.get("kind"), q.get("docs"), q.get("accept")
        where = "line %d (%s)" % (ln, q.get("id", kind))
        if kind not in KINDS:
            err("kind must be one of %s" % (KINDS,))
            continue
        counts[kind] += 1
        for fld in ("question", "answer"):
            if not isinstance(q.get(fld), str) or not q[fld].strip():
                err("missing %s" % fld)
        if q.get("question") in seen_q:
            err("duplicate question")
        seen_q.add(q.get("question"))
        if not (isinstance(accept, list) and accept and all(isinstance(s, str) and s.strip() for s in accept)):
            err("accept must be a non-empty list of non-empty strings")
            continue
        if not any(s.lower() in q.get("answer", "").lower() for s in accept):
            err("the reference answer contains none of the accept strings")
        if not (isinstance(ids, list) and ids and all(isinstance(i, str) for i in ids)) or len(set(ids)) != len(ids):
            err("docs must be a list of distinct document ids")
            continue
        ds = [doc(i) for i in ids]
        if None in ds:
            err("unknown document id(s): %s" % [i for i, d in zip(ids, ds) if d is None])
            continue
        oracle = q.get("oracle")

        if kind == "long":
            if len(ds) != 1:
                err("a long question names exactly one document")
                continue
            d = ds[0]
            if len(d.parts) < MIN_LONG_PARTS:
                err("%s has %d part(s), needs %d+" % (d.id, len(d.parts), MIN_LONG_PARTS))
                continue
            if not (isinstance(oracle, int) and 1 <= oracle <= len(d.parts)):
                err("oracle must be a part number 1..%d" % len(d.parts))
                continue
            for s in accept:
                where_s = d.parts_with(s)
                if oracle not in where_s:
                    err("accept %r is not inside part %d (found in parts %s)" % (s, oracle, where_s))
                elif where_s != [oracle]:
                    err("accept %r also occurs in part(s) %s" % (s, [p for p in where_s if p != oracle]))
            covered.setdefault(d.id, set()).add(oracle)

        elif kind == "retrieval":
            if len(ds) != K_RETRIEVAL:
                err("a retrieval question names %d documents" % K_RETRIEVAL)
                continue
            if oracle not in ids:
                err("oracle must be one of docs")
                continue
            for s in accept:
                if not docs[oracle].has(s):
                    err("accept %r not in the oracle document %s" % (s, oracle))
                for d in ds:
                    if d.id != oracle and d.has(s):
                        err("accept %r also occurs in %s" % (s, d.id))

        else:  # cross
            if len(ds) != 2:
                err("a cross question names exactly two documents")
                continue
            if not (isinstance(oracle, list) and sorted(oracle) == sorted(ids)):
                err("oracle must list the same two documents as docs")
            facts = q.get("facts")
            if not (isinstance(facts, list) and facts and
                    all(isinstance(x, list) and len(x) == 2 and all(isinstance(y, str) for y in x) for x in facts)):
                err("facts must be a list of [doc id, substring] pairs")
                continue
            used = set()
            for fid, sub in facts:
                if fid not in ids:
                    err("fact document %s is not in docs" % fid)
                    continue
                other = [d for d in ds if d.id != fid][0]
                if not docs[fid].has(sub):
                    err("fact %r not in %s" % (sub, fid))
                if other.has(sub):
                    err("fact %r also occurs in %s (not needed from %s)" % (sub, other.id, fid))
                used.add(fid)
            if used != set(ids):
                err("the facts must come from both documents")
            bridge = q.get("bridge")
            if bridge is not None:
                if not any(bridge.lower() in sub.lower() for _, sub in facts):
                    err("bridge %r is not part of a fact" % bridge)
                if bridge.lower() in q["question"].lower():
                    err("the question names the bridge %r itself" % bridge)
            if "calc" in q:
                try:
                    v = calc(q["calc"])
                except (ValueError, SyntaxError, ZeroDivisionError) as e:
                    err("calc %r: %s" % (q["calc"], e))
                    continue
                num = fmt_num(v)
                if num not in q["answer"]:
                    err("calc gives %s, not in the answer %r" % (num, q["answer"]))
                for s in accept:
                    if num.replace(",", "") not in s.replace(",", ""):
                        err("accept %r does not contain the computed %s" % (s, num))
                    for d in ds:
                        if d.has(s):
                            err("computed accept %r already occurs in %s" % (s, d.id))
            else:
                for s in accept:
                    inn = [d.id for d in ds if d.has(s)]
                    if len(inn) != 1:
                        err("accept %r must occur in exactly one of the two documents (found in %s)" % (s, inn))
                    elif not any(inn[0] == fid and s.lower() in sub.lower() for fid, sub in facts):
                        err("accept %r is not inside a fact of %s" % (s, inn[0]))

    for did, got in sorted(covered.items()):
        want = set(range(1, len(docs[did].parts) + 1))
        if got != want:
            errors.append("%s: no long question for part(s) %s" % (did, sorted(want - got)))
    if counts["long"] < MIN_LONG or len(covered) < 2:
        errors.append("need >= %d long questions over >= 2 split documents (have %d over %d)"
                      % (MIN_LONG, counts["long"], len(covered)))
    if counts["retrieval"] < MIN_RETRIEVAL:
        errors.append("need >= %d retrieval questions (have %d)" % (MIN_RETRIEVAL, counts["retrieval"]))
    if counts["cross"] < MIN_CROSS:
        errors.append("need >= %d cross questions (have %d)" % (MIN_CROSS, counts["cross"]))

    for did in sorted(covered):
        d = docs[did]
        print("%s: %d tokens, %d parts of %s tokens" % (did, d.n, len(d.parts), [p[1] - p[0] for p in d.parts]))
        if a.parts:
            for i, (s0, s1, t, _) in enumerate(d.parts, 1):
                head = [l for l in t.splitlines() if l.startswith("#")]
                print("  part %d: tokens %d..%d, starts %r, headings %s .. %s"
                      % (i, s0, s1 - 1, t[:50], head[:1], head[-1:]))
    print("questions: %d long, %d retrieval, %d cross; %d documents checked"
          % (counts["long"], counts["retrieval"], counts["cross"], len(docs)))
    for e in errors:
        print("FAIL", e)
    print("FAILED: %d problem(s)" % len(errors) if errors else "OK")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
