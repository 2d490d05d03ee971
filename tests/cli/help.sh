#!/usr/bin/env bash
# Every tool's --help (and -h) prints exactly its text file cli/help/<tool>.txt, with
# each placeholder @MACRO@ replaced by the string that macro is #defined to in the
# CLI headers (cli/*.h): the build turns the file into the program's text
# (CMakeLists.txt, kvz_cli_help), this test reads the file and the header itself.
# Exit 0, the text on stdout, nothing on stderr.
set -u
BIN=${KVZ_BIN:-}
SRC=${KVZ_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
T=$(mktemp -d "${TMPDIR:-/tmp}/kvz_help_XXXXXX")
trap 'rm -rf "$T"' EXIT
pass=0 fail=0 n=0
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }

# cli/help/<tool>.<mode>.txt is the text of `<tool> --<mode> --help`
for txt in "$SRC"/cli/help/*.txt; do
  tool=$(basename "$txt" .txt)
  mode=
  case $tool in *.*) mode=--${tool#*.}; tool=${tool%%.*} ;; esac
  n=$((n + 1))
  if [ ! -x "$BIN/$tool" ]; then bad "$tool: not built in KVZ_BIN=$BIN"; continue; fi
  cp "$txt" "$T/want"
  for m in $(grep -o '@[A-Z_][A-Z0-9_]*@' "$txt" | tr -d @ | sort -u); do
    v=$(sed -n "s/^#define $m \"\\(.*\\)\"\$/\\1/p" "$SRC"/cli/*.h)
    if [ -z "$v" ] || [ "$(printf '%s\n' "$v" | wc -l)" -ne 1 ]; then
      bad "$tool: placeholder @$m@ is not one string macro in cli/*.h"; continue 2
    fi
    M="$m" V="$v" perl -pi -e 's/\@\Q$ENV{M}\E\@/$ENV{V}/g' "$T/want"
  done
  for flag in --help -h; do
    "$BIN/$tool" $mode $flag >"$T/out" 2>"$T/err"
    rc=$?
    if [ $rc -ne 0 ]; then bad "$tool $mode $flag: exit $rc"
    elif [ -s "$T/err" ]; then bad "$tool $flag: stderr: $(head -c 300 "$T/err")"
    elif ! cmp -s "$T/want" "$T/out"; then bad "$tool $flag differs from cli/help/$tool.txt:"; diff "$T/want" "$T/out" | head -20 >&2
    else pass=$((pass + 1)); fi
  done
done
[ $n -gt 0 ] || bad "no cli/help/*.txt found under $SRC"
echo "help: $pass passed, $fail failed ($n tools)"
[ $fail -eq 0 ]
