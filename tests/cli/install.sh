#!/usr/bin/env bash
# The installed library, end to end, from a temporary prefix:
#   cmake --install -> libkvzip.so/.a, kvzip.h, kvzip.pc, the CLIs under the prefix;
#   the C example (examples/ask.c) compiled with pkg-config against the shared and
#   against the static library, each ingesting a sample and answering a question;
#   the Python package (python/) pip-installed into a venv (no network: the system's
#   setuptools) running examples/ask.py and the binding's tests, on the real model.
set -u
src=${KVZ_SOURCE_DIR:?}; bld=${KVZ_BINARY_DIR:?}; model=${KVZ_MODEL:?}
[ -f "$model" ] || { echo "skip: model $model missing"; exit 77; }
for t in cc pkg-config; do command -v $t >/dev/null || { echo "skip: no $t"; exit 77; }; done
# the system's Python (Debian python3-venv/-setuptools/-wheel: pip needs no network)
py=/usr/bin/python3; [ -x "$py" ] || py=$(command -v python3) || { echo "skip: no python3"; exit 77; }
"$py" -c 'import venv, ensurepip, setuptools, wheel' 2>/dev/null || { echo "skip: $py lacks venv/setuptools/wheel (scripts/setup)"; exit 77; }
pass=0; fail=0
ok() { pass=$((pass+1)); }
bad() { fail=$((fail+1)); echo "FAIL: $*" >&2; }
check() { local d=$1; shift; if "$@"; then ok; else bad "$d"; fi; }
T=$(mktemp -d "${TMPDIR:-/tmp}/kvz_install_XXXXXX"); trap 'rm -rf "$T"' EXIT
P=$T/prefix
doc=$src/samples/lab_b214_safety_sop.md
Q="Who is the lab manager?"

cmake --install "$bld" --prefix "$P" > "$T/install.log" 2>&1
rc=$?; check "cmake --install" test $rc -eq 0
for f in lib/libkvzip.so lib/libkvzip.a include/kvzip.h lib/pkgconfig/kvzip.pc bin/kvzip-query bin/kvzip-ingest; do
  check "installed $f" test -e "$P/$f"
done
# only the public API is exported
check "exports only kvzip_*" test "$(nm -D --defined-only "$P/lib/libkvzip.so" | awk '$2 == "T" && $3 !~ /^kvzip_/' | wc -l)" -eq 0
export PKG_CONFIG_PATH=$P/lib/pkgconfig
check "pkg-config finds kvzip" test "$(pkg-config --modversion kvzip)" = "$(sed -n 's/^#define KVZIP_VERSION_MAJOR //p' "$P/include/kvzip.h").$(sed -n 's/^#define KVZIP_VERSION_MINOR //p' "$P/include/kvzip.h").$(sed -n 's/^#define KVZIP_VERSION_PATCH //p' "$P/include/kvzip.h")"

# C example, shared library
cc -std=c11 -Wall -Wextra -Werror "$src/examples/ask.c" $(pkg-config --cflags --libs kvzip) \
   -Wl,-rpath,"$P/lib" -o "$T/ask" 2> "$T/cc.log"
check "compile examples/ask.c (shared): $(head -c 300 "$T/cc.log")" test -x "$T/ask"
"$T/ask" "$model" "$T/store" "$doc" "$Q" > "$T/c.out" 2> "$T/c.err"
rc=$?; check "C example runs: $(tail -c 300 "$T/c.err")" test $rc -eq 0
check "C example answers: $(cat "$T/c.out")" grep -q "Marwood" "$T/c.out"
check "C example ingested" grep -q "context KV pairs kept" "$T/c.err"
# C example, static library (same store: the document is unchanged, only answered)
cc -std=c11 "$src/examples/ask.c" $(pkg-config --cflags kvzip) "$P/lib/libkvzip.a" \
   $(pkg-config --static --libs kvzip | sed 's/-lkvzip//; s/-L[^ ]*//g') -o "$T/ask_static" 2> "$T/ccs.log"
check "compile examples/ask.c (static): $(head -c 300 "$T/ccs.log")" test -x "$T/ask_static"
check "static binary does not need libkvzip.so" bash -c "! ldd '$T/ask_static' | grep -q libkvzip"
"$T/ask_static" "$model" "$T/store" "$doc" "$Q" > "$T/cs.out" 2>/dev/null
check "static example gives the same answer" cmp -s "$T/c.out" "$T/cs.out"

# Python: venv + pip install ./python (offline), example and binding tests
"$py" -m venv --system-site-packages "$T/venv" > /dev/null 2>&1
check "venv" test -x "$T/venv/bin/python"
cp -r "$src/python" "$T/pysrc"   # build in a copy: the source tree stays clean
"$T/venv/bin/pip" install --no-index --no-build-isolation --quiet "$T/pysrc" > "$T/pip.log" 2>&1
rc=$?; check "pip install ./python: $(tail -c 400 "$T/pip.log")" test $rc -eq 0
cd "$T"   # import the installed package, not the source folder
KVZIP_PREFIX=$P "$T/venv/bin/python" "$src/examples/ask.py" --model "$model" --store "$T/pystore" "$doc" "$Q" > "$T/py.out" 2> "$T/py.err"
rc=$?; check "Python example runs: $(tail -c 400 "$T/py.err")" test $rc -eq 0
check "Python example answers as the C example" cmp -s "$T/c.out" "$T/py.out"
KVZIP_PREFIX=$P KVZ_MODEL=$model "$T/venv/bin/python" "$src/python/tests/test_kvzip.py" > "$T/pyt.out" 2>&1
rc=$?; check "Python binding tests: $(tail -c 600 "$T/pyt.out")" test $rc -eq 0
echo "answer: $(cat "$T/c.out")"
echo "python tests: $(tail -1 "$T/pyt.out")"
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
