#!/usr/bin/env bash
# kvzip-serve over loopback on the real model (docs/SERVER.md):
#  (a) curl non-streaming and streaming (SSE chunks, usage, data: [DONE]); the same
#      greedy answer as kvzip-query for the same question and document
#  (e) every bad input gets its status and the OpenAI error shape while a concurrent
#      client keeps getting answers (malformed JSON, wrong types, unknown document,
#      too many documents, max_tokens over the limit, over-long question, invalid
#      UTF-8, body too large, no/wrong API key, unknown path, wrong method, slow client)
#  (c) load: 16 concurrent clients x 2 streaming requests, 0 errors, p50/p99 TTFT and
#      tokens/s printed, decoded sessions reused (cache hits); (d) kvzip-ingest re-writes
#      a document of the same store meanwhile, and afterwards that document answers with
#      its new content, not from its cached old session
#  client hang-up cancels the generation (/metrics kvzip_canceled_total); a full queue
#  answers 503 with Retry-After; (f) kill -9 and restart: serving resumes.
# KVZ_SERVE_BATCH=N (tests/cli/serve_batch.sh) runs every server with --max-batch N
# (the continuous-batching scheduler), KVZ_SERVE_LOAD="CLIENTS PER TOKENS" sizes the load.
source "$(dirname "$0")/lib.bash"
BATCH=${KVZ_SERVE_BATCH:-1}
read -r LC LP LT <<<"${KVZ_SERVE_LOAD:-16 2 8}"
EXTRA=()
[ "$BATCH" -gt 1 ] && EXTRA=(--max-batch "$BATCH")
SRV="$BIN/kvzip-serve"
[ -x "$SRV" ] || { echo "skip: kvzip-serve not built"; exit 77; }
command -v curl >/dev/null || { echo "skip: curl missing (scripts/setup installs it)"; exit 77; }
S="$T/store"
D="$T/docs"
KEY="test-key-$$"
mkdir -p "$D"
printf 'Facility notes. The north vault is opened with access code 7319. Visitors sign in at the front desk and wear a blue badge. The loading dock closes at 18:00.\n' >"$D/vault.txt"
printf 'Pump notes. Pump P-7 in bay 3 runs at 1450 rpm. The seal temperature is logged every four days by the duty engineer.\n' >"$D/pump.txt"
"$ING" --store "$S" --threads 1 "$D/vault.txt" >"$T/ing" 2>&1 || { cat "$T/ing"; bad "ingest"; finish; }
# pump.txt checks that a re-ingested version is served, not what compression keeps of a
# 30-token note: it is stored whole (at 0.3 SmolLM2's answer about the new version once
# lost the rpm figure while answering from the new content)
"$ING" --store "$S" --threads 1 --ratio 1.0 "$D/pump.txt" >>"$T/ing" 2>&1 || { cat "$T/ing"; bad "ingest"; finish; }

SPID=
start_server() { # ARGS...: start kvzip-serve on a free port; sets SPID and URL
  "$SRV" --store "$S" --port 0 --threads 1 "${EXTRA[@]}" "$@" 2>"$T/srvlog" &
  SPID=$!
  local i
  for i in $(seq 1 300); do
    URL=$(grep -o 'http://127.0.0.1:[0-9]*' "$T/srvlog" 2>/dev/null)
    [ -n "$URL" ] && return 0
    kill -0 "$SPID" 2>/dev/null || break
    sleep 0.2
  done
  bad "server did not start: $(cat "$T/srvlog")"
  finish
}
# post BODY [CURL ARGS...]: POST to /v1/chat/completions with the key; body in $T/body,
# prints the status code
# (AUTHH: the Authorization header's value; empty = none)
post() {
  local b=$1 a=${AUTHH-Bearer $KEY} h=(); shift
  [ -n "$a" ] && h=(-H "Authorization: $a")
  curl -s -o "$T/body" -w '%{http_code}' "${h[@]}" "$@" "$URL/v1/chat/completions" --data-binary "$b"
}
jget() { python3 -c 'import json,sys; o=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$@"; }
ask() { printf '{"messages":[{"role":"user","content":"%s"}],"documents":["%s"],"max_tokens":%d}' "$1" "$2" "${3:-24}"; }

start_server --workers 2 --max-queue 32 --api-key "$KEY" --max-tokens-limit 512 --budget 64 --timeout 240
echo "server at $URL (pid $SPID)"
Q="What is the access code of the north vault?"

# ---- (a) non-streaming, streaming, and kvzip-query's answer ----
code=$(post "$(ask "$Q" vault.txt)")
check "non-streaming: 200 (got $code: $(head -c 300 "$T/body"))" test "$code" = 200
cp "$T/body" "$T/answer.json"
A=$(jget "$T/answer.json" 'o["choices"][0]["message"]["content"]')
echo "answer: $A"
check "answer names the code 7319" grep -q 7319 <<<"$A"
check "usage: completion_tokens > 0 and total = prompt + completion" \
  jget "$T/answer.json" 'exit(0 if (lambda u: u["completion_tokens"] > 0 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"])(o["usage"]) else 1)'
"$QRY" --store "$S" --threads 1 --budget 64 --max-tokens 24 --json --doc vault.txt "$Q" >"$T/q.json" 2>"$T/q.err"
QA=$(jget "$T/q.json" 'o["answer"]')
check "kvzip-query gives the same greedy answer ('$QA' vs '$A')" test "$QA" = "$A"

curl -sN -H "Authorization: Bearer $KEY" "$URL/v1/chat/completions" \
  -d "$(ask "$Q" vault.txt | sed 's/}$/,"stream":true}/')" >"$T/sse"
check "stream ends with data: [DONE]" test "$(grep -v '^$' "$T/sse" | tail -1)" = "data: [DONE]"
SA=$(python3 - "$T/sse" <<'PY'
import json, sys
out, usage = "", None
for line in open(sys.argv[1]):
    if line.startswith("data: ") and line.strip() != "data: [DONE]":
        o = json.loads(line[6:])
        assert o["object"] == "chat.completion.chunk"
        out += o["choices"][0]["delta"].get("content", "")
        usage = o.get("usage", usage)
assert usage and usage["completion_tokens"] > 0, "no usage"
print(out)
PY
)
check "streamed text equals the non-streaming answer ('$SA')" test "$SA" = "$A"
check "plain chat without documents answers" test "$(post '{"messages":[{"role":"user","content":"Say hello."}],"max_tokens":8}')" = 200
curl -s -H "Authorization: Bearer $KEY" "$URL/v1/documents" >"$T/docs.json"
check "/v1/documents lists both with tokens and bytes" \
  jget "$T/docs.json" 'exit(0 if sorted(d["id"] for d in o["data"]) == ["pump.txt", "vault.txt"] and all(d["tokens"] > 0 and d["bytes"] > 0 for d in o["data"]) else 1)'
check "/v1/models" jget <(curl -s -H "Authorization: Bearer $KEY" "$URL/v1/models") 'exit(0 if o["data"][0]["object"] == "model" else 1)'
check "/health without a key" test "$(curl -s -o /dev/null -w '%{http_code}' "$URL/health")" = 200

# ---- (e) bad inputs while another client keeps asking ----
rm -f "$T/stop"
( for i in $(seq 1 40); do
    [ -e "$T/stop" ] && break
    curl -s -o /dev/null -w '%{http_code}\n' -H "Authorization: Bearer $KEY" "$URL/v1/chat/completions" \
      -d "$(ask "$Q" vault.txt 6)"
  done >"$T/side" ) &
SIDE=$!
exec 3<>"/dev/tcp/127.0.0.1/${URL##*:}"   # a slow client: half a body, then nothing
printf 'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{"messa' >&3
expect_status() { # DESC CODE BODY [CURL ARGS...]
  local d=$1 want=$2 b=$3; shift 3
  local got; got=$(post "$b" "$@")
  if [ "$got" != "$want" ]; then bad "$d: status $got, want $want: $(head -c 300 "$T/body")"; return; fi
  if ! jget "$T/body" 'exit(0 if isinstance(o["error"]["message"], str) and "type" in o["error"] else 1)' 2>/dev/null; then
    bad "$d: not the OpenAI error shape: $(head -c 300 "$T/body")"; return; fi
  ok; printf '  %-28s %s %s\n' "$d" "$got" "$(jget "$T/body" 'o["error"]["message"]')"
}
expect_status "malformed JSON" 400 '{"messages": ['
expect_status "not an object" 400 '[1,2]'
expect_status "messages wrong type" 400 '{"messages":"hi"}'
expect_status "content wrong type" 400 '{"messages":[{"role":"user","content":5}]}'
expect_status "last message not user" 400 '{"messages":[{"role":"assistant","content":"x"}]}'
expect_status "max_tokens wrong type" 400 '{"messages":[{"role":"user","content":"x"}],"max_tokens":"9"}'
expect_status "max_tokens over limit" 400 '{"messages":[{"role":"user","content":"x"}],"max_tokens":100000}'
expect_status "temperature out of range" 400 '{"messages":[{"role":"user","content":"x"}],"temperature":7}'
expect_status "documents wrong type" 400 '{"messages":[{"role":"user","content":"x"}],"documents":"vault.txt"}'
expect_status "unknown document" 404 '{"messages":[{"role":"user","content":"x"}],"documents":["no-such-doc"]}'
check "404 names the id" grep -q "no-such-doc" "$T/body"
expect_status "document named twice" 400 '{"messages":[{"role":"user","content":"x"}],"documents":["vault.txt","vault.txt"]}'
many=$(python3 -c 'import json; print(json.dumps({"messages":[{"role":"user","content":"x"}],"documents":["d%d" % i for i in range(17)]}))')
expect_status "too many documents" 400 "$many"
longq=$(python3 -c 'import json; print(json.dumps({"messages":[{"role":"user","content":"word " * 200}],"documents":["vault.txt"]}))')
expect_status "question over the budget" 400 "$longq"
expect_status "invalid UTF-8" 400 "$(printf '{"messages":[{"role":"user","content":"\xff\xfe"}]}')"
expect_status "path traversal id" 404 '{"messages":[{"role":"user","content":"x"}],"documents":["../../etc/passwd"]}'
head -c 1100000 /dev/zero | tr '\0' ' ' >"$T/big"
expect_status "body too large" 413 "@$T/big"
AUTHH= expect_status "no API key" 401 "$(ask "$Q" vault.txt)"
AUTHH="Bearer nope" expect_status "wrong API key" 401 "$(ask "$Q" vault.txt)"
check "unknown path: 404" test "$(curl -s -o /dev/null -w '%{http_code}' "$URL/v2/nothing")" = 404
check "GET on chat: 405" test "$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $KEY" "$URL/v1/chat/completions")" = 405
exec 3>&-
touch "$T/stop"
wait "$SIDE"
n_side=$(wc -l <"$T/side")
check "side client got answers during the bad inputs ($n_side, all 200)" \
  test "$n_side" -ge 1 -a "$(grep -cv '^200$' "$T/side")" = 0

# ---- client hang-up cancels ----
c0=$(curl -s "$URL/metrics" | sed -n 's/^kvzip_canceled_total //p')
curl -sN --max-time 3 -o /dev/null -H "Authorization: Bearer $KEY" "$URL/v1/chat/completions" \
  -d '{"messages":[{"role":"user","content":"Write a very long story about the pump."}],"documents":["pump.txt"],"max_tokens":500,"stream":true}'
c1=$c0
for i in $(seq 1 100); do
  c1=$(curl -s "$URL/metrics" | sed -n 's/^kvzip_canceled_total //p')
  [ "$c1" -gt "$c0" ] && break
  sleep 0.2
done
check "hang-up canceled the generation (kvzip_canceled_total $c0 -> $c1)" test "$c1" -gt "$c0"

# ---- (c) load + (d) re-ingest meanwhile ----
PQ="At what speed in rpm does pump P-7 run?"
code=$(post "$(ask "$PQ" pump.txt)")
PA=$(jget "$T/body" 'o["choices"][0]["message"]["content"]')
echo "pump answer before re-ingest: $PA"
check "pump answer names 1450 before the re-ingest (its session is now cached)" grep -q 1450 <<<"$PA"
printf 'Pump notes. Pump P-7 in bay 3 runs at 2900 rpm. The seal temperature is logged every four days by the duty engineer.\n' >"$D/pump.txt"
( sleep 2; "$ING" --store "$S" --threads 1 --ratio 1.0 "$D/pump.txt" >"$T/ing2" 2>&1; echo $? >"$T/ing2.rc" ) &
ING2=$!
code=$(post "$(ask "$Q" vault.txt "$LT")")
LA=$(jget "$T/body" 'o["choices"][0]["message"]["content"]')
t0=$(now)
python3 "$SRC/tests/server/load.py" "$URL" "$KEY" vault.txt "$Q" "$LC" "$LP" "$LT" "$LA" >"$T/load.json"
t1=$(now)
wait "$ING2"
echo "load ($LC clients x $LP requests, $LT tokens, batch $BATCH, $(secs "$t0" "$t1") s): $(cat "$T/load.json")"
check "load: $((LC * LP)) answered, 0 errors" jget "$T/load.json" "exit(0 if o['ok'] == $((LC * LP)) and o['errors'] == 0 else 1)"
check "load: every answer is the one a request alone gets ('$LA')" jget "$T/load.json" 'exit(0 if o["mismatch"] == 0 else 1)'
check "re-ingest during the load succeeded ($(cat "$T/ing2" | tail -1))" test "$(cat "$T/ing2.rc")" = 0
code=$(post "$(ask "$PQ" pump.txt)")
PA=$(jget "$T/body" 'o["choices"][0]["message"]["content"]')
echo "pump answer after re-ingest: $PA"
check "re-ingested document answers with its new content (2900)" grep -q 2900 <<<"$PA"
check "... and not with the old one (1450)" bash -c '! grep -q 1450 <<<"$1"' _ "$PA"
curl -s "$URL/metrics" >"$T/metrics"
check "/metrics: TTFT histogram and token counter" grep -q '^kvzip_ttft_seconds_count [1-9]' "$T/metrics"
check "/metrics: queue depth gauge" grep -q '^kvzip_queue_depth 0' "$T/metrics"
echo "cache: $(grep -E '^kvzip_(cache|doc_loads)' "$T/metrics" | tr '\n' ' ')"
check "/metrics: the load reused decoded sessions (cache hits > 0)" grep -q '^kvzip_cache_hits_total [1-9]' "$T/metrics"
if [ "$BATCH" -gt 1 ]; then
  echo "batch: $(grep -E '^kvzip_batch_(steps_total|size_sum|size_count|step_seconds_sum|size_bucket\{le="1"\})' "$T/metrics" | tr '\n' ' ')"
  check "/metrics: decode steps of more than one request ran (kvzip_batch_size)" \
    awk '/^kvzip_batch_size_bucket\{le="1"\}/ {one = $2} /^kvzip_batch_size_count/ {n = $2} END {exit !(n > one && one >= 0)}' "$T/metrics"
  check "/metrics: batch gauges idle after the load" grep -q '^kvzip_batch_running 0' "$T/metrics"
fi

# ---- (f) kill -9 and restart ----
kill -9 "$SPID"; wait "$SPID" 2>/dev/null
start_server --workers 2 --max-queue 32 --api-key "$KEY" --max-tokens-limit 512 --budget 64
code=$(post "$(ask "$Q" vault.txt)")
check "after kill -9 + restart: same answer" test "$code" = 200 -a "$(jget "$T/body" 'o["choices"][0]["message"]["content"]')" = "$A"
kill "$SPID"; wait "$SPID"
check "SIGTERM: clean exit 0" test $? = 0

# ---- a full queue: 503 + Retry-After ----
start_server --workers 1 --max-queue 1 --budget 64
NF=$((BATCH + 4))   # more than the answering slots (1 worker, or the batch) + the queue of 1
for i in $(seq 1 $NF); do
  curl -s -D "$T/h$i" -o /dev/null -w '%{http_code}\n' "$URL/v1/chat/completions" -d "$(ask "$Q" vault.txt 40)" >"$T/c$i" &
done
wait $(jobs -p | grep -v "^$SPID\$")
codes=$(cat "$T"/c[0-9]* | sort | uniq -c | tr '\n' ' ')
echo "$NF at once on 1 worker (batch $BATCH) + queue 1: $codes"
check "some answered 200, the rest 503" test -z "$(cat "$T"/c[0-9]* | grep -v '^200$' | grep -v '^503$')" -a "$(grep -l '^200$' "$T"/c[0-9]* | wc -l)" -ge 1
check "at least one 503 with Retry-After" grep -qi '^retry-after: 1' $(grep -l '^503$' "$T"/c[0-9]* | sed 's/c\([0-9]*\)$/h\1/' | head -1) /dev/null
kill "$SPID"; wait "$SPID"
finish
