#!/usr/bin/env bash
# The official `openai` Python client (pip install openai into a venv, from PyPI)
# against kvzip-serve on the real model: extra_body={"documents": [...]} answers a
# needle question, streaming and not; errors arrive as the client's exceptions.
source "$(dirname "$0")/lib.bash"
SRV="$BIN/kvzip-serve"
[ -x "$SRV" ] || { echo "skip: kvzip-serve not built"; exit 77; }
python3 -m venv "$T/venv" || { echo "skip: python3 -m venv failed (python3-venv)"; exit 77; }
if ! "$T/venv/bin/pip" install -q --disable-pip-version-check openai >"$T/pip" 2>&1; then
  echo "skip: pip install openai failed (needs PyPI): $(tail -2 "$T/pip")"; exit 77
fi
"$T/venv/bin/python" -c 'import openai; print("openai", openai.__version__)'
S="$T/store"
KEY="k-$$"
printf 'Facility notes. The north vault is opened with access code 7319. Visitors sign in at the front desk and wear a blue badge. The loading dock closes at 18:00.\n' >"$T/vault.txt"
"$ING" --store "$S" --threads 1 "$T/vault.txt" >"$T/ing" 2>&1 || { cat "$T/ing"; bad "ingest"; finish; }
"$SRV" --store "$S" --port 0 --threads 1 --workers 2 --api-key "$KEY" --budget 64 2>"$T/srvlog" &
SPID=$!
URL=
for i in $(seq 1 300); do
  URL=$(grep -o 'http://127.0.0.1:[0-9]*' "$T/srvlog" 2>/dev/null)
  [ -n "$URL" ] && break
  kill -0 "$SPID" 2>/dev/null || break
  sleep 0.2
done
[ -n "$URL" ] || { bad "server did not start: $(cat "$T/srvlog")"; finish; }
check "openai client checks" "$T/venv/bin/python" "$SRC/tests/server/openai_client.py" "$URL" "$KEY" \
  "What is the access code of the north vault?" 7319
kill "$SPID"; wait "$SPID"
check "server stopped cleanly" test $? = 0
finish
