#!/usr/bin/env bash
# tests/cli/serve.sh again with every server on the continuous-batching scheduler
# (kvzip-serve --max-batch 4; on the CPU a step decodes the 4 requests one after
# another), and the issue's load: 16 concurrent clients x 50 streaming requests (4
# tokens each, to keep the test within minutes on 2 cores), 0 errors, every answer
# equal to the one a request alone gets, p50/p99 TTFT and tokens/s printed.
# Then --synthetic (the benchmark route): a store ingested with the synthetic
# tiny-llama is served by kvzip-serve --synthetic tiny-llama --max-batch 4; 8
# concurrent requests all answer, with the same greedy text, and batched steps ran.
KVZ_SERVE_BATCH=4 KVZ_SERVE_LOAD="16 50 4" bash "$(dirname "$0")/serve.sh"
src=$?
source "$(dirname "$0")/lib.bash"
[ "$src" -eq 0 ] && ok || bad "serve.sh with --max-batch 4 (exit $src)"
SRV="$BIN/kvzip-serve"
printf 'The north vault is opened with access code 7319. The dock closes at 18:00.\n' >"$T/v.txt"
"$ING" --synthetic tiny-llama --store "$T/syn" "$T/v.txt" >"$T/ing" 2>&1 || { cat "$T/ing"; bad "synthetic ingest"; finish; }
"$SRV" --synthetic tiny-llama --store "$T/syn" --port 0 --threads 1 --max-batch 4 2>"$T/srvlog" &
SPID=$!
for i in $(seq 1 100); do
  URL=$(grep -o 'http://127.0.0.1:[0-9]*' "$T/srvlog" 2>/dev/null)
  [ -n "$URL" ] && break
  sleep 0.2
done
check "--synthetic tiny-llama --max-batch 4 starts ($(head -1 "$T/srvlog"))" test -n "$URL"
body='{"messages":[{"role":"user","content":"What is the access code?"}],"documents":["v.txt"],"max_tokens":16}'
for i in $(seq 1 8); do
  curl -s -o "$T/a$i" -w '%{http_code}\n' "$URL/v1/chat/completions" -d "$body" >"$T/s$i" &
done
wait $(jobs -p | grep -v "^$SPID\$")
check "8 concurrent requests on the synthetic model: all 200" test "$(cat "$T"/s[1-8] | sort -u)" = 200
texts=$(for i in $(seq 1 8); do python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["message"]["content"].encode().hex())' "$T/a$i"; done | sort -u | wc -l)
check "... with one greedy answer among them ($texts distinct)" test "$texts" = 1
curl -s "$URL/metrics" >"$T/m"
check "... decoded in batched steps" awk '/^kvzip_batch_size_bucket\{le="1"\}/ {one = $2} /^kvzip_batch_size_count/ {n = $2} END {exit !(n > one)}' "$T/m"
kill "$SPID"; wait "$SPID"
check "SIGTERM: clean exit 0" test $? = 0
finish
