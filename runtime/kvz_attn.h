/**
 * @file kvz_attn.h
 * @brief Decode attention kernels (CPU): the scores of a few query rows against a
 *        run of cached keys, and the probability-weighted sum of the values.
 *
 * The CPU backend's decode attention (one query token; its grp = n_head/n_kv_head
 * query heads per KV head) splits each head's keys into fixed 256-key chunks,
 * runs one task per (KV head, chunk) on these kernels and merges the chunks'
 * partial softmaxes (kvz_cpu.c). OpenBLAS SGEMM spent most of its time packing
 * operands for these thin products (7 x 2048 x 64 for Qwen2.5-0.5B).
 *
 * A scalar reference (tests) and an AVX2+FMA path, chosen with the ISA of
 * kvz_qdot (KVZ_ISA_*; kvz_qdot_active_isa() in the runtime). Every output
 * element is computed from its own inputs only (no dependence on where a row sits
 * in a run or on the run's length), so a key gives the same score whether it
 * lies in the document region or in the output buffer.
 */
#ifndef KVZ_ATTN_H
#define KVZ_ATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** s[g·lds + t] = scale · (q_g · k_t) for g < grp, t < nt; q: (grp, hd)
 *  contiguous, k_t = k + t·ldk. */
void kvz_attn_scores(int isa, const float *q, int grp, int hd, const float *k, int64_t ldk, int64_t nt,
                     float scale, float *s, int64_t lds);

/** o[g·hd + d] += Σ_{t<nt} p[g·ldp + t] · v_t[d] for g < grp (t ascending);
 *  v_t = v + t·ldv. */
void kvz_attn_pv(int isa, const float *p, int64_t ldp, int grp, const float *v, int64_t ldv, int64_t nt,
                 int hd, float *o);

/*
 * Prefill attention (many queries), flash-style: one KV head's block of nq query
 * tokens, each with grp query heads (rows r = i*grp + g), against a run of keys
 * that is the document rows [0, n) followed by nout output-buffer slots (index n + j).
 * Query i sees document rows 0..vis[i]-1 and slot j when 0 <= opos[j] <= qpos[i].
 * Keys go in tiles of KVZ_ATTN_FLASH_KT (aligned on that index, so a key gives the
 * same arithmetic whether it is a document row or a slot): the scores of 6 rows x 16
 * keys at a time in registers (keys packed transposed per tile), an online softmax
 * per row (running max and sum, the output rescaled when the max grows), and the
 * probability-weighted values added in registers; a tile no row of a 6-row group
 * sees is skipped (the causal triangle). Nothing of size nq x keys is kept.
 *
 * o[i*ldo + g*hd + d] = sum_t softmax_t(scale * q_{i,g}.k_t) v_t[d] over the keys
 * query i sees (zeros when none); q_{i,g} = q + i*ldq + g*hd. fp32 throughout; the
 * scalar path walks the keys one at a time with the same online update.
 * work: kvz_attn_flash_work_floats(nq, grp, hd) floats, 32-byte aligned.
 */
#define KVZ_ATTN_FLASH_KT 64
typedef struct kvz_attn_keys {
    const float *k, *v; /* document rows: k + t*ld, t < n */
    int64_t ld, n;
    const float *ok, *ov; /* output slots: ok + j*old, j < nout (nout 0: none) */
    int64_t old, nout;
    const int32_t *opos; /* slot positions, -1 = empty */
} kvz_attn_keys;
size_t kvz_attn_flash_work_floats(int nq, int grp, int hd);
void kvz_attn_flash(int isa, const float *q, int64_t ldq, int nq, int grp, int hd, const kvz_attn_keys *keys,
                    const int64_t *vis, const int32_t *qpos, float scale, float *o, int64_t ldo, float *work);

#ifdef __cplusplus
}
#endif
#endif
