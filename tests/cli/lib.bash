# Helpers sourced by the store/reliability CLI tests (tests/cli/store_*.sh).
# Needs KVZ_BIN (bin dir) and KVZ_MODEL; exits 77 (skip) when the tools or the
# model are missing. Every check counts; `finish` prints "N passed, N failed".
set -u
BIN=${KVZ_BIN:-}
MODEL=${KVZ_MODEL:-}
SRC=${KVZ_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
for t in kvzip-ingest kvzip-query kvzip-store; do
  [ -n "$BIN" ] && [ -x "$BIN/$t" ] || { echo "skip: $t not built (KVZ_BIN=$BIN)"; exit 77; }
done
[ -n "$MODEL" ] && [ -f "$MODEL" ] || { echo "skip: model $MODEL missing (scripts/fetch-model)"; exit 77; }
export KVZ_MODEL="$MODEL"
unset KVZ_STORE
T=$(mktemp -d "${TMPDIR:-/tmp}/kvz_cli_XXXXXX")
trap 'jobs -p | xargs -r kill -9 2>/dev/null; rm -rf "$T"' EXIT
pass=0
fail=0
ING="$BIN/kvzip-ingest"
QRY="$BIN/kvzip-query"
STO="$BIN/kvzip-store"

ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }
# check DESC CMD...: the command succeeds
check() { local d=$1; shift; if "$@"; then ok; else bad "$d"; fi; }
now() { date +%s.%N; }
# secs T0 T1 -> T1 - T0
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", b - a }'; }

# expect_err DESC CODE REGEX CMD...: CMD exits with CODE, prints nothing on
# stdout, and exactly one line on stderr, matching the extended REGEX.
expect_err() {
  local d=$1 code=$2 re=$3; shift 3
  "$@" >"$T/out" 2>"$T/err"
  local rc=$? nl
  nl=$(wc -l <"$T/err")
  if [ "$rc" -ne "$code" ]; then bad "$d: exit $rc, want $code; stderr: $(head -c 400 "$T/err")"; return; fi
  if [ "$nl" -ne 1 ]; then bad "$d: $nl stderr lines, want 1: $(head -c 600 "$T/err")"; return; fi
  if ! grep -Eq -- "$re" "$T/err"; then bad "$d: stderr '$(cat "$T/err")' does not match /$re/"; return; fi
  if [ -s "$T/out" ]; then bad "$d: unexpected stdout: $(head -c 200 "$T/out")"; return; fi
  ok
  printf '  %-34s exit %d  %s\n' "$d" "$rc" "$(cat "$T/err")"
}

# store_state DIR: what must not change when a command is rejected
store_state() { "$STO" --store "$1" ls --json; "$STO" --store "$1" stats --json | sed 's/"map_size": [0-9]*, //'; }
# verify_ok DESC DIR
verify_ok() {
  if "$STO" --store "$2" verify >"$T/vout" 2>"$T/verr"; then ok
  else bad "$1: kvzip-store verify failed: $(head -c 800 "$T/verr")"; fi
}
txnid() { "$STO" --store "$1" stats --json | sed -n 's/.*"last_txnid": \([0-9]*\).*/\1/p'; }
# docs_in_stats < STATS_JSON: the document count of a `kvzip-store stats --json` output
docs_in_stats() { sed -n 's/.*"docs": \([0-9]*\),.*/\1/p'; }
ndocs() { "$STO" --store "$1" stats --json | docs_in_stats; }
has_doc() { "$STO" --store "$1" show "$2" >/dev/null 2>&1; }

# tiny_docs DIR N [TAG]: N short synthetic documents (about 30 tokens each, ~2 s to ingest)
tiny_docs() {
  mkdir -p "$1"
  local i
  for i in $(seq 1 "$2"); do
    printf 'Record %d%s: pump P-%d in bay %d runs at %d rpm; the duty engineer checks it every %d days and logs the seal temperature.\n' \
      "$i" "${3:-}" "$i" "$((i + 2))" "$((i * 700 + 100))" "$((i + 3))" >"$1/doc$i.txt"
  done
}

# KVZB record offsets in a data.mdb (all, in file order)
kvzb_offsets() { grep -obUaP 'KVZB[\x01\x02]\x00' "$1" | cut -d: -f1; }
# flip_byte FILE OFFSET: xor one byte with 0x5a, in place
flip_byte() {
  local b
  b=$(od -An -tu1 -j "$2" -N1 "$1" | tr -d ' ')
  printf "$(printf '\\%03o' $((b ^ 0x5a)))" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}

finish() {
  echo "$pass passed, $fail failed"
  [ "$fail" -eq 0 ]
  exit
}
