/* kvz_shard.c — shard of a document id, shard spec from flags or the scheduler's
 * environment, corpus listing hash, device spec. */
#include "kvz_shard.h"

#include "kvz_error.h"
#include "kvz_model.h"
#include "kvz_store.h"
#include "kvz_store_merge.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

uint32_t kvz_shard_of(const char *id, uint32_t n)
{
    if (n <= 1) return 0;
    return (uint32_t)(XXH64(id, strlen(id), 0) % n);
}

/* A decimal in [0, max]; -1 when @p s is not one. */
static long parse_dec(const char *s, size_t len, long max)
{
    if (len == 0 || len > 9) return -1;
    long v = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (s[i] - '0');
    }
    return v > max ? -1 : v;
}

int kvz_shard_parse(const char *spec, kvz_shard *out)
{
    if (!spec || !out) return kvz_error_set(KVZ_ERR_ARG, "shard: NULL argument");
    memset(out, 0, sizeof *out);
    const char *slash = strchr(spec, '/');
    long i = slash ? parse_dec(spec, (size_t)(slash - spec), 999999999) : -1;
    long n = slash ? parse_dec(slash + 1, strlen(slash + 1), 999999999) : -1;
    if (i < 0 || n < 0)
        return kvz_error_set(KVZ_ERR_ARG, "expects I/N (shard I of N, 0 <= I < N), got '%s'", spec);
    if (n == 0 || n > (long)KVZ_SHARD_MAX)
        return kvz_error_set(KVZ_ERR_ARG, "'%s': the shard count must be 1..%u", spec, KVZ_SHARD_MAX);
    if (i >= n)
        return kvz_error_set(KVZ_ERR_ARG, "'%s': shard index %ld is out of range for %ld shards "
                             "(0..%ld; indices count from 0)", spec, i, n, n - 1);
    out->index = (uint32_t)i;
    out->n = (uint32_t)n;
    out->source = "--shard";
    return 0;
}

/* Index I and count N from their sources; builds "I/N" and parses it. */
static int from_parts(const char *iname, const char *ival, const char *nname, const char *nval,
                      kvz_shard *out)
{
    long i = parse_dec(ival, strlen(ival), 999999999);
    if (i < 0) return kvz_error_set(KVZ_ERR_ARG, "%s='%s' is not a shard index", iname, ival);
    long n = parse_dec(nval, strlen(nval), 999999999);
    if (n < 0) return kvz_error_set(KVZ_ERR_ARG, "%s='%s' is not a shard count", nname, nval);
    if (n == 0 || n > (long)KVZ_SHARD_MAX)
        return kvz_error_set(KVZ_ERR_ARG, "%s=%ld: the shard count must be 1..%u", nname, n,
                             KVZ_SHARD_MAX);
    if (i >= n)
        return kvz_error_set(KVZ_ERR_ARG, "%s=%ld is out of range for %ld shards (%s; indices count "
                             "from 0: submit the array as 0-%ld)", iname, i, n, nname, n - 1);
    out->index = (uint32_t)i;
    out->n = (uint32_t)n;
    out->source = iname;
    return 0;
}

int kvz_shard_resolve(const char *spec, long shards, char *(*getenv_fn)(const char *),
                      kvz_shard *out)
{
    if (!out || !getenv_fn) return kvz_error_set(KVZ_ERR_ARG, "shard: NULL argument");
    memset(out, 0, sizeof *out);
    if (shards < 0 || shards > (long)KVZ_SHARD_MAX)
        return kvz_error_set(KVZ_ERR_ARG, "--shards %ld: the shard count must be 1..%u", shards,
                             KVZ_SHARD_MAX);
    char nbuf[32];
    snprintf(nbuf, sizeof nbuf, "%ld", shards);
    if (spec) {
        int err = kvz_shard_parse(spec, out);
        if (err) {
            char d[256];
            snprintf(d, sizeof d, "%s", kvz_error_detail());
            return kvz_error_set(err, "--shard %s", d);
        }
        if (shards && (uint32_t)shards != out->n)
            return kvz_error_set(KVZ_ERR_ARG, "--shard %s and --shards %ld disagree on the shard count",
                                 spec, shards);
        return 0;
    }
    const char *sid = getenv_fn("SLURM_ARRAY_TASK_ID"), *scount = getenv_fn("SLURM_ARRAY_TASK_COUNT");
    const char *kidx = getenv_fn("JOB_COMPLETION_INDEX");
    if (sid && *sid) {
        if (shards) return from_parts("SLURM_ARRAY_TASK_ID", sid, "--shards", nbuf, out);
        if (!scount || !*scount)
            return kvz_error_set(KVZ_ERR_ARG, "SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT "
                                 "is not: give the shard count with --shards N");
        return from_parts("SLURM_ARRAY_TASK_ID", sid, "SLURM_ARRAY_TASK_COUNT", scount, out);
    }
    if (kidx && *kidx) {
        if (!shards)
            return kvz_error_set(KVZ_ERR_ARG, "JOB_COMPLETION_INDEX is set but --shards N is not "
                                 "(give the Job's completions count)");
        return from_parts("JOB_COMPLETION_INDEX", kidx, "--shards", nbuf, out);
    }
    if (scount && *scount)
        return kvz_error_set(KVZ_ERR_ARG, "SLURM_ARRAY_TASK_COUNT is set but SLURM_ARRAY_TASK_ID is "
                             "not: half a shard spec");
    if (shards)
        return kvz_error_set(KVZ_ERR_ARG, "--shards %ld needs a shard index: --shard I/N, "
                             "SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX", shards);
    return 0;
}

static int cmp_id(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int kvz_corpus_hash(const char *const *ids, size_t n, uint64_t *out)
{
    if (!out || (n && !ids)) return kvz_error_set(KVZ_ERR_ARG, "corpus hash: NULL argument");
    const char **v = malloc((n ? n : 1) * sizeof *v);
    XXH64_state_t *st = XXH64_createState();
    if (!v || !st) {
        free(v);
        XXH64_freeState(st);
        return kvz_error_set(KVZ_ERR_NOMEM, "corpus hash");
    }
    if (n) memcpy(v, ids, n * sizeof *v);
    qsort(v, n, sizeof *v, cmp_id);
    XXH64_reset(st, 0);
    for (size_t i = 0; i < n; i++) XXH64_update(st, v[i], strlen(v[i]) + 1);
    *out = XXH64_digest(st);
    XXH64_freeState(st);
    free(v);
    return 0;
}

int kvz_device_parse(const char *spec, int32_t *device, int32_t *ordinal)
{
    if (!spec || !device || !ordinal) return kvz_error_set(KVZ_ERR_ARG, "device: NULL argument");
    *ordinal = -1;
    if (!strcmp(spec, "cpu")) { *device = KVZ_DEVICE_CPU; return 0; }
    if (!strcmp(spec, "auto")) { *device = KVZ_DEVICE_AUTO; return 0; }
    if (!strcmp(spec, "cuda")) { *device = KVZ_DEVICE_CUDA; *ordinal = 0; return 0; }
    if (!strncmp(spec, "cuda:", 5)) {
        long k = parse_dec(spec + 5, strlen(spec + 5), 1023);
        if (k < 0)
            return kvz_error_set(KVZ_ERR_ARG, "--device expects cpu, cuda, cuda:K (K = GPU ordinal "
                                 "0..1023) or auto, got '%s'", spec);
        *device = KVZ_DEVICE_CUDA;
        *ordinal = (int32_t)k;
        return 0;
    }
    return kvz_error_set(KVZ_ERR_ARG, "--device expects cpu, cuda, cuda:K or auto, got '%s'", spec);
}

int kvz_device_select(int32_t ordinal)
{
    if (ordinal < 0) return 0;
    const char *cur = getenv("CUDA_VISIBLE_DEVICES");
    char pick[256];
    if (cur && *cur) {
        /* the K-th comma-separated entry of the list the scheduler gave us */
        const char *p = cur;
        for (int32_t k = 0; k < ordinal && p; k++) {
            p = strchr(p, ',');
            if (p) p++;
        }
        if (!p || !*p)
            return kvz_error_set(KVZ_ERR_NODEV, "cuda:%d: CUDA_VISIBLE_DEVICES=%s lists fewer GPUs",
                                 ordinal, cur);
        size_t len = strcspn(p, ",");
        if (len == 0 || len >= sizeof pick)
            return kvz_error_set(KVZ_ERR_NODEV, "cuda:%d: bad CUDA_VISIBLE_DEVICES entry in '%s'",
                                 ordinal, cur);
        memcpy(pick, p, len);
        pick[len] = 0;
    } else {
        snprintf(pick, sizeof pick, "%d", ordinal);
    }
    if (setenv("CUDA_VISIBLE_DEVICES", pick, 1))
        return kvz_error_set(KVZ_ERR_NOMEM, "setenv CUDA_VISIBLE_DEVICES: %s", strerror(errno));
    return 0;
}

int kvz_shard_record(kvz_store *st, const kvz_shard *sh, uint64_t corpus_hash, size_t n_ids)
{
    if (!st || !sh || !sh->n) return kvz_error_set(KVZ_ERR_ARG, "shard record: bad arguments");
    char v[64];
    int n = snprintf(v, sizeof v, "%u/%u", sh->index, sh->n);
    int err = kvz_store_meta_set(st, KVZ_META_SHARD, v, (size_t)n);
    if (err) return err;
    n = snprintf(v, sizeof v, "%016llx %zu", (unsigned long long)corpus_hash, n_ids);
    return kvz_store_meta_set(st, KVZ_META_CORPUS, v, (size_t)n);
}
