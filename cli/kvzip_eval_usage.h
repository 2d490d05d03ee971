/* The --help texts of kvzip-eval (cli/kvzip-eval.c), kept apart so the CLI's code reads
 * on its own. KVZ_EVAL_USAGE is a printf format: one %s, the default model path. */
#ifndef KVZIP_EVAL_USAGE_H
#define KVZIP_EVAL_USAGE_H

#define KVZ_EVAL_USAGE \
    "usage: kvzip-eval [options] FILE.jsonl\n" \
    "       kvzip-eval --multidoc [options] --out RESULTS.jsonl FILE.jsonl\n" \
    "                  (questions over several composed documents: kvzip-eval --multidoc --help)\n" \
    "\n" \
    "Evaluates KVzip compression against eviction baselines at equal ratios.\n" \
    "FILE.jsonl has one object per line: {\"doc\": PATH, \"question\": ..., \"answer\": ...,\n" \
    "\"accept\": [...]} (PATH relative to the file's folder; \"accept\" optional, default\n" \
    "[answer]). Each document is scored once with KVzip; every question is answered\n" \
    "greedily from the full cache once and from each compressed cache, all in memory.\n" \
    "\n" \
    "Per method and ratio (fraction of context KV pairs kept; the system prefix is\n" \
    "always kept) it reports, over the questions:\n" \
    "  agreement  greedy answer token-for-token equal to the full cache's answer\n" \
    "  accuracy   answer contains any \"accept\" string (case-insensitive)\n" \
    "  dNLL       mean NLL of the reference answer tokens (teacher-forced after the\n" \
    "             question) minus the same on the full cache\n" \
    "  KV MB      K+V of the cache the question was answered from, counted at\n" \
    "             fp16, prefix included; mean over questions\n" \
    "\n" \
    "Methods: kvzip (global threshold over all layers x heads, DESIGN §3) plus\n" \
    "  random     per-head uniform: each (layer, KV head) keeps round(n*r) context\n" \
    "             tokens drawn uniformly at random (--seed)\n" \
    "  window     per head: the first 4 context tokens (sinks) + the most recent ones\n" \
    "  snapkv     query-aware: attention of the question+postfix tokens to the\n" \
    "             context on the full cache (softmax over all visible keys, summed\n" \
    "             over the window queries, max over the GQA group, max-pool 7 over\n" \
    "             tokens), per-head top-k; compressed per question with that question.\n" \
    "             Also 'snapkv-q1': for documents with >= 3 questions, compress once\n" \
    "             with question 1 and answer questions 2..n (multi-query table).\n" \
    "Ratio 1.0 keeps everything, so every method's cache is the same; it is\n" \
    "evaluated once (as kvzip) and the result is shared.\n" \
    "\n" \
    "Options:\n" \
    "  --ratios LIST      comma-separated ratios in (0, 1] (default 1,0.5,0.3,0.2,0.1)\n" \
    "  --baselines LIST   any of random,window,snapkv, or none (default all)\n" \
    "  --docs LIST        only these documents (file names, or prefixes of them)\n" \
    "  --limit N          only the first N questions (after --docs)\n" \
    "  --per-doc N        only the first N questions of each document\n" \
    "  --max-tokens N     greedy answer length limit (default 48; stops on <|im_end|>)\n" \
    "  --seed N           random-eviction seed (default 1)\n" \
    "  --kv-dtype T       pass every compressed cache's kept K/V rows through the\n" \
    "                     stored type T (f32, f16, bf16, q8, q4: encode + decode with\n" \
    "                     the same row codecs as kvzip-ingest/the loader); default:\n" \
    "                     none (as computed). The full cache is never round-tripped.\n" \
    "  --json FILE        full results (summary rows and every answer) as JSON\n" \
    "  --plot FILE.png    accuracy and agreement vs ratio, one line per method\n" \
    "                     (runs gnuplot, pngcairo terminal)\n" \
    "  --model PATH|NAME  GGUF model, or a name fetched by scripts/fetch-model\n" \
    "                     (default: $KVZ_MODEL or %s)\n" \
    "  --device D         cpu (default), cuda (= cuda:0), cuda:K (GPU ordinal K) or\n" \
    "                     auto (cuda when a GPU is usable); docs/EVAL.md compares them\n" \
    "  --threads N        CPU threads (default: all cores)\n" \
    "  -q, --quiet        no progress on stderr\n" \
    "  -h, --help         this text\n" \
    "\n" \
    "Output: a markdown table on stdout (rows method x ratio), progress on stderr.\n" \
    "Exit status: 0 ok, 2 usage, 3 bad input file or document, 4 model problem,\n" \
    "6 file not found, 1 other errors (plot failure included).\n"

#define KVZ_EVAL_MD_USAGE \
    "usage: kvzip-eval --multidoc [options] --out RESULTS.jsonl FILE.jsonl\n" \
    "\n" \
    "Multi-document mode: questions asked over several documents composed into one\n" \
    "context. FILE.jsonl has one object per line:\n" \
    "  {\"id\": ID, \"kind\": \"long\"|\"retrieval\"|\"cross\", \"docs\": [DOC, ...],\n" \
    "   \"question\": ..., \"answer\": ..., \"accept\": [...], \"oracle\": ORACLE}\n" \
    "DOC is a file path relative to --root; a document longer than one part\n" \
    "(--part-tokens) is cut into parts as kvzip-ingest cuts it, and DOC means all of\n" \
    "its parts in order, DOC#N part N. ORACLE (optional) is the context that holds\n" \
    "the answer: a part number (of the one split document in docs), an id from docs,\n" \
    "or an array of ids from docs. \"accept\" as in the single-document mode.\n" \
    "\n" \
    "Each part is scored once with KVzip and kept in memory; per ratio each part is\n" \
    "selected on its own (global threshold over its layers x heads x tokens, as\n" \
    "kvzip-ingest stores it) and the selected caches are composed as kvz_docs_load\n" \
    "composes stored ones. Methods (each question is answered once per method and\n" \
    "ratio; greedy answer + teacher-forced NLL of the reference answer):\n" \
    "  sequential  all docs, each after the previous one (keys re-rotated by RoPE)\n" \
    "  parallel    all docs at their own positions after the prefix (APE style)\n" \
    "  oracle      only the oracle context (sequential if it is several parts/docs)\n" \
    "A composition of one part is the same cache in both placements, and the oracle\n" \
    "equal to docs is the sequential cache: such answers are computed once.\n" \
    "\n" \
    "Every answer is appended to RESULTS.jsonl as one line when it is measured\n" \
    "(id, kind, method, ratio, placement, answer, tokens, correct, nll, ...); a\n" \
    "rerun with the same --out skips what is recorded (an interrupted last line is\n" \
    "dropped), so a long run resumes. The file's first line binds it to the model,\n" \
    "--max-tokens, --key-scale and --part-tokens. At the end a markdown table per\n" \
    "kind is printed from all records of the selected questions: accuracy, correct\n" \
    "vs the oracle's, agreement with the oracle's answer, ΔNLL vs the oracle.\n" \
    "\n" \
    "Options:\n" \
    "  --out FILE         results, one JSON line per answer (required)\n" \
    "  --root DIR         folder the DOC paths are relative to (default: FILE's folder)\n" \
    "  --ratios LIST      comma-separated, in (0, 1], run in this order (default 1,0.3,0.2)\n" \
    "  --methods LIST     any of sequential,parallel,oracle (default all)\n" \
    "  --kinds LIST       any of long,retrieval,cross (default all)\n" \
    "  --ids LIST         only these question ids\n" \
    "  --limit N          only the first N questions (after --kinds/--ids)\n" \
    "  --max-tokens N     greedy answer length limit (default 48)\n" \
    "  --part-tokens N    split documents into parts of at most N tokens (default and\n" \
    "                     maximum: what kvzip-ingest uses for the model)\n" \
    "  --key-scale S      multiply every document key by S (APE-style attention\n" \
    "                     temperature 1/S; default 1 = off)\n" \
    "  --report           print the tables from --out without running the model\n" \
    "  --model, --device, --threads, -q/--quiet, -h/--help as in the single-document mode\n" \
    "\n" \
    "Exit status: 0 ok, 2 usage (also --out written with other settings), 3 bad\n" \
    "input line (malformed, a document named twice, a bad oracle, part out of\n" \
    "range) or results file, 4 model problem, 6 FILE or a document not found,\n" \
    "1 other errors.\n"

#endif
