#!/usr/bin/env bash
# Build the CUDA kernels, the GPU kernel test and the GPU kernel bench WITHOUT the
# project's CMake (which needs LMDB/xxHash/OpenBLAS and every other module). Used on
# the lent GPU machine. Usage: tests/gpu/build_direct.sh OUTDIR [ARCH=90a]
# kernels/ is a standalone op library over common/ only: every kernels/*.cu builds
# here with -I kernels -I common. The kernel test's host reference conversions come
# from the runtime (runtime/kvz_quant.c, which picks its ISA through kvz_qdot.c).
set -euo pipefail
out=${1:?outdir}; arch=${2:-90a}
root=$(cd "$(dirname "$0")/../.." && pwd)
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
mkdir -p "$out/obj"
objs=()
for f in "$root"/kernels/*.cu; do
  o="$out/obj/$(basename "$f").o"
  "$NVCC" -std=c++17 -O3 -gencode=arch=compute_${arch},code=sm_${arch} -lineinfo \
    --expt-relaxed-constexpr -Xcompiler=-Wall,-Wextra -I"$root/kernels" -I"$root/common" -c "$f" -o "$o" &
  objs+=("$o")
done
wait
gcc -std=gnu11 -O2 -c "$root/common/kvz_error.c" -I"$root/common" -o "$out/obj/kvz_error.o"
for f in kvz_quant kvz_qdot; do   # the test's host reference (f16 conversions)
  gcc -std=gnu11 -O2 -D_GNU_SOURCE -c "$root/runtime/$f.c" -I"$root/runtime" -I"$root/common" -o "$out/obj/$f.o"
done
cinc=(-I"$root/tests" -I"$root/tests/gpu" -I"$root/kernels" -I"$root/common" -I/usr/local/cuda/include)
libs=(-L/usr/local/cuda/lib64 -lcublas -lcublasLt -lcudart -lstdc++ -lm -lpthread)
gcc -std=gnu11 -O2 -Wall -Wextra -Werror "${cinc[@]}" -I"$root/runtime" "$root/tests/gpu/test_kernels.c" \
  "${objs[@]}" "$out/obj/kvz_error.o" "$out/obj/kvz_quant.o" "$out/obj/kvz_qdot.o" "${libs[@]}" -o "$out/test_kernels"
if [ -f "$root/bench/gpu_kernels.c" ]; then
  gcc -std=gnu11 -O2 -Wall -Wextra -Werror "${cinc[@]}" "$root/bench/gpu_kernels.c" \
    "${objs[@]}" "$out/obj/kvz_error.o" "${libs[@]}" -o "$out/gpu_kernels"
fi
echo "built: $out/test_kernels${root:+ }$( [ -f "$root/bench/gpu_kernels.c" ] && echo "$out/gpu_kernels")"
