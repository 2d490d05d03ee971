/**
 * @file kvzip.h
 * @brief libkvzip: the public C API of kvzip — ingest long documents once into
 *        KVzip-compressed KV caches kept in an LMDB store, then answer questions
 *        from them with a bounded (LongFlow) output cache.
 *
 * The whole API in one picture:
 *
 *     kvzip_model_open()                  a model (GGUF file or synthetic), on a device
 *     kvzip_store_open()                  a store folder, read-only or read-write
 *     kvzip_ingest()                      document text -> compressed cache(s) in the store
 *     kvzip_session_open()                one stored document -> a KV cache in memory
 *     kvzip_session_open_text()           or: plain text prefilled into a full cache
 *     kvzip_session_open_chat()           or: no document at all (plain chat)
 *     kvzip_ask()                         a question -> streamed answer tokens + figures
 *     kvzip_batch_submit() / _step()      or: many sessions' questions decoded together
 *     kvzip_session_close() / kvzip_store_close() / kvzip_model_close()
 *
 * Example (errors abbreviated; examples/ask.c is the complete program):
 *
 *     kvzip_model *m; kvzip_store *s; kvzip_session *ss; char *answer;
 *     kvzip_model_open("SmolLM2-135M-Instruct.Q4_1.gguf", NULL, &m);
 *     kvzip_store_open("kvzip-store", KVZIP_STORE_CREATE, m, &s);
 *     kvzip_ingest(m, s, "manual.md", text, len, NULL, NULL);
 *     kvzip_session_open(m, s, "manual.md", NULL, &ss);
 *     kvzip_ask(ss, "What is the PIN?", NULL, NULL, &answer, NULL);
 *     kvzip_free(answer); kvzip_session_close(ss); kvzip_store_close(s); kvzip_model_close(m);
 *
 * ERRORS. Every function that can fail returns an int: 0 (KVZIP_OK) or a negative
 * KVZIP_ERR_* code; kvzip_strerror() names the code and kvzip_errdetail() gives
 * the detail of the last failure on the calling thread (which file, which id,
 * the LMDB/zstd/CUDA code, ...). The library never prints and never exits. Each
 * function lists the codes it returns; KVZIP_ERR_NOMEM can come from any function
 * that allocates and KVZIP_ERR_INTERNAL marks a bug. Passing NULL where a handle
 * or string is required returns KVZIP_ERR_ARG (never a crash).
 *
 * OWNERSHIP AND LIFETIME. Handles are opaque and owned by the caller, who closes
 * each exactly once. A session holds a reference on its model and on its store:
 * kvzip_model_close() / kvzip_store_close() while sessions are open release the
 * caller's handle at once but keep the object alive until the last of its
 * sessions is closed. Those sessions keep answering normally (a session needs
 * nothing from the store after it opened). In between, every call that passes
 * the closed handle (kvzip_session_open, kvzip_ingest, kvzip_store_open with it,
 * kvzip_store_has_doc, ...) returns KVZIP_ERR_CLOSED, and a second close returns
 * KVZIP_ERR_CLOSED. Once the last reference is gone the memory is freed: passing
 * the handle after that is undefined behaviour, as with free(). Strings returned
 * through `char **` are malloc'd: release them with kvzip_free().
 *
 * THREADING.
 *  - kvzip_model: may be shared by any number of threads, each with its own
 *    sessions. On the CPU, sessions on one model run truly in parallel (all
 *    mutable state — KV cache and work memory — belongs to the session; every
 *    session's forward pass uses the model's thread count through OpenMP). On
 *    CUDA the model owns one stream and one cuBLAS handle, so the library
 *    serialises device work per model with a lock: sessions on several threads
 *    are correct but take turns on the GPU (one model per GPU stream to overlap).
 *  - kvzip_store: may be shared by any number of threads (LMDB: readers never
 *    block; writers are serialised across threads and processes).
 *  - kvzip_session: one thread at a time (no internal lock); distinct sessions
 *    are independent.
 *  - kvzip_errdetail() is per thread. Opening and closing handles is
 *    thread-safe with respect to other handles' use; closing a handle while
 *    another thread is inside a call on that same handle is the caller's bug.
 *  - The token callback of kvzip_ask() runs on the calling thread; a batch's token and
 *    done callbacks run on the thread that calls kvzip_batch_step().
 *
 * DEVICES. KVZIP_DEVICE_CPU (fp32, OpenBLAS, OpenMP), KVZIP_DEVICE_CUDA (when the
 * library was built with CUDA and a GPU is usable), KVZIP_DEVICE_AUTO (CUDA when
 * usable, else CPU).
 *
 * Figures (kvzip_answer_stats, kvzip_session_info, kvzip_model_info) are plain
 * structs the call fills in; the library returns no pointers into its own memory
 * except the static strings of kvzip_strerror / kvzip_version and the per-thread
 * kvzip_errdetail.
 */
#ifndef KVZIP_H
#define KVZIP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVZIP_VERSION_MAJOR 0
#define KVZIP_VERSION_MINOR 1
#define KVZIP_VERSION_PATCH 0

/** "MAJOR.MINOR.PATCH" of the library actually linked (static string). */
const char *kvzip_version(void);

/* ------------------------------------------------------------------------- */
/* Errors                                                                      */

/** Error codes: 0 ok, negative failure. The values are stable (same as the
 *  internal KVZ_ERR_* codes; docs/ERRORS.md maps them to the tools' exit codes). */
enum {
    KVZIP_OK = 0,
    KVZIP_ERR_NOMEM = -1,       /**< allocation failed */
    KVZIP_ERR_IO = -2,          /**< open/read/write/mmap failed (errno in the detail) */
    KVZIP_ERR_FORMAT = -3,      /**< bytes are not what the format says (corrupt file or record) */
    KVZIP_ERR_TRUNCATED = -4,   /**< input ends early */
    KVZIP_ERR_UNSUPPORTED = -5, /**< well-formed but not supported (architecture, tensor type) */
    KVZIP_ERR_ARG = -6,         /**< invalid argument (NULL, out of range, read-only store) */
    KVZIP_ERR_NOTFOUND = -7,    /**< document, file or store does not exist */
    KVZIP_ERR_CHECKSUM = -8,    /**< stored checksum does not match */
    KVZIP_ERR_MODEL = -9,       /**< store/cache made by another model (fingerprint mismatch) */
    KVZIP_ERR_VERSION = -10,    /**< format version this build cannot read */
    KVZIP_ERR_LMDB = -11,       /**< LMDB call failed (code in the detail) */
    KVZIP_ERR_ZSTD = -12,       /**< zstd call failed */
    KVZIP_ERR_CUDA = -13,       /**< CUDA / cuBLAS call failed */
    KVZIP_ERR_FULL = -14,       /**< store map or disk full (the store is unchanged) */
    KVZIP_ERR_CONTEXT = -15,    /**< longer than a limit: cache, output buffer, model context */
    KVZIP_ERR_EMPTY = -16,      /**< empty input where content is required */
    KVZIP_ERR_ENCODING = -17,   /**< text is not valid UTF-8 or contains NUL bytes */
    KVZIP_ERR_BUSY = -18,       /**< resource locked or full (store growth waited too long, retired
                                     store, a batch holding max_seqs answers, a session in a batch) */
    KVZIP_ERR_NODEV = -19,      /**< CUDA requested, no usable GPU (or built without CUDA) */
    KVZIP_ERR_INTERNAL = -20,   /**< a bug: an invariant did not hold */
    KVZIP_ERR_CLOSED = -40,     /**< the handle was closed (kept alive only by open sessions) */
    KVZIP_ERR_CANCELED = -41,   /**< the token callback returned nonzero */
};

/** Static text for a KVZIP_ERR_* code ("unknown error" for others). Never NULL. */
const char *kvzip_strerror(int err);

/** Detail of the last failure on this thread ("" if none): names the file, document,
 *  limit or underlying library code. Valid until the next kvzip call on this thread. */
const char *kvzip_errdetail(void);

/** Release a string the library returned (kvzip_ask's answer). NULL-safe. */
void kvzip_free(void *p);

/* ------------------------------------------------------------------------- */
/* Model                                                                       */

typedef struct kvzip_model kvzip_model;

enum { KVZIP_DEVICE_CPU = 0, KVZIP_DEVICE_CUDA = 1, KVZIP_DEVICE_AUTO = 2 };

typedef struct kvzip_model_opts {
    int32_t device;          /**< KVZIP_DEVICE_* (default AUTO) */
    int32_t n_threads;       /**< CPU threads per forward pass; 0 = all cores */
    const char *synthetic;   /**< non-NULL: random-weight model of this shape instead of a
                                  file ("smollm2-135m", "llama3-8b", "qwen2.5-7b", "tiny-llama",
                                  "tiny-qwen2", "tiny-qwen3"; byte-level tokenizer) */
    uint64_t seed;           /**< synthetic weights seed (0 = default) */
    int32_t pin_store_map;   /**< 1 (CUDA): sessions load documents straight from each store's
                                  map, which the store keeps pinned with the driver in 64 MiB
                                  pieces until it closes (for long-lived processes such as
                                  kvzip-serve: the first load of a region pays the pinning,
                                  about what a copy costs; later loads skip the host copy).
                                  0 (default): every load copies through pinned staging */
} kvzip_model_opts;

/** Defaults: AUTO device, all cores, no synthetic model. */
void kvzip_model_defaults(kvzip_model_opts *o);

/**
 * Load a GGUF model (llama / qwen2 / qwen3 architectures), or with
 * opts->synthetic a random-weight one (then @p path is ignored and may be NULL).
 * @param opts  NULL = kvzip_model_defaults().
 * @param out   out: the handle; release with kvzip_model_close().
 * @return 0; KVZIP_ERR_ARG (NULL out, NULL path without synthetic);
 *   KVZIP_ERR_NOTFOUND (no such file, unknown synthetic name, a tensor or key missing);
 *   KVZIP_ERR_IO; KVZIP_ERR_FORMAT / KVZIP_ERR_TRUNCATED (corrupt GGUF);
 *   KVZIP_ERR_UNSUPPORTED (architecture or tensor type); KVZIP_ERR_NODEV; KVZIP_ERR_CUDA;
 *   KVZIP_ERR_NOMEM.
 */
int kvzip_model_open(const char *path, const kvzip_model_opts *opts, kvzip_model **out);

/**
 * Release the caller's handle (see OWNERSHIP: deferred while sessions are open).
 * @return 0 (also for NULL); KVZIP_ERR_CLOSED (closed before, sessions still open).
 */
int kvzip_model_close(kvzip_model *m);

/** What kvzip_model_info() reports. */
typedef struct kvzip_model_info {
    char name[64];           /**< general.name of the GGUF or the synthetic shape */
    char arch[16];           /**< "llama", "qwen2", "qwen3" */
    char chat[16];           /**< chat layout from the GGUF template: "smollm", "qwen2.5",
                                  "llama3", "chatml" */
    int32_t device;          /**< KVZIP_DEVICE_CPU or KVZIP_DEVICE_CUDA (resolved) */
    int32_t n_layer, n_head, n_kv_head, head_dim, n_vocab;
    int32_t n_ctx;           /**< trained context length (tokens) */
    int32_t max_part_tokens; /**< context tokens one stored cache may hold; longer documents
                                  are ingested in parts ID#1, ID#2, ... */
    uint64_t weight_bytes;   /**< weights as held by the backend */
    double load_s;           /**< seconds kvzip_model_open took */
    uint8_t fingerprint[16]; /**< XXH3-128 of the GGUF (or synthetic spec + seed) */
} kvzip_model_info;

/** @return 0; KVZIP_ERR_ARG (NULL); KVZIP_ERR_CLOSED. */
int kvzip_model_info_get(const kvzip_model *m, kvzip_model_info *out);

typedef struct kvzip_store kvzip_store;

/**
 * Warm-up for a long-lived process (kvzip-serve calls it at start): on CUDA, size the
 * model's pinned load staging for the longest document of @p s (by tokens), as its
 * load would, so that a first load of any document up to that size allocates no
 * pinned memory on the request's path (~0.03 s for an 8K-token llama3-8b document
 * on an H200). Loads nothing; a no-op on the CPU or for an empty
 * store. @p doc_id (may be NULL): the document it sized for ("" when none);
 * @p seconds (may be NULL): the time it took.
 * @return 0; KVZIP_ERR_ARG; KVZIP_ERR_CLOSED; the store's and the loader's errors
 *   (KVZIP_ERR_FORMAT for a damaged META record, KVZIP_ERR_NOMEM, KVZIP_ERR_CUDA).
 */
int kvzip_model_prepare(kvzip_model *m, kvzip_store *s, char *doc_id, size_t doc_id_cap, double *seconds);

/**
 * Tokens a question takes in the output cache: the question text plus the chat
 * layout around it ("\n\nQuestion: " ... assistant-turn opener).
 * @return 0; KVZIP_ERR_ARG; KVZIP_ERR_CLOSED; KVZIP_ERR_NOMEM.
 */
int kvzip_question_tokens(const kvzip_model *m, const char *question, int32_t *n_tokens);

/* ------------------------------------------------------------------------- */
/* Store                                                                       */

enum {
    KVZIP_STORE_READONLY = 1u, /**< no writes (kvzip_ingest returns KVZIP_ERR_ARG) */
    KVZIP_STORE_CREATE = 2u,   /**< create the folder and databases when missing */
};

/**
 * Open the store in folder @p dir (see docs/FORMAT.md §6; several processes may
 * open one store; LMDB readers see a consistent snapshot while a writer runs).
 * @param flags  KVZIP_STORE_READONLY or KVZIP_STORE_CREATE (not both), or 0
 *               (read-write, must exist).
 * @param m      when not NULL, the store must hold this model's caches
 *               (else KVZIP_ERR_MODEL now); with NULL the check happens at
 *               kvzip_ingest / kvzip_session_open instead.
 * @return 0; KVZIP_ERR_ARG (NULL dir/out, both flags); KVZIP_ERR_CLOSED (m);
 *   KVZIP_ERR_NOTFOUND (no store there and no CREATE); KVZIP_ERR_IO;
 *   KVZIP_ERR_FORMAT (not a kvzip store / not LMDB); KVZIP_ERR_VERSION;
 *   KVZIP_ERR_MODEL; KVZIP_ERR_FULL; KVZIP_ERR_LMDB; KVZIP_ERR_NOMEM.
 */
int kvzip_store_open(const char *dir, unsigned flags, const kvzip_model *m, kvzip_store **out);

/** Release the caller's handle (deferred while sessions opened from it are open).
 *  @return 0 (also for NULL); KVZIP_ERR_CLOSED (closed before, sessions still open). */
int kvzip_store_close(kvzip_store *s);

/** @return 1 if @p doc_id is stored, 0 if not; KVZIP_ERR_ARG; KVZIP_ERR_CLOSED;
 *  KVZIP_ERR_FORMAT (corrupt entry); KVZIP_ERR_LMDB. */
int kvzip_store_has_doc(kvzip_store *s, const char *doc_id);

/** One stored document as kvzip_store_list() reports it. */
typedef struct kvzip_doc_entry {
    const char *id;          /**< NUL-terminated doc id ("ID#N" for part N of a split document) */
    uint64_t tokens;         /**< prefix + context tokens */
    float ratio;             /**< kept ratio it was ingested with */
    uint32_t part;           /**< N for part N of a split document, else 0 */
    uint64_t bytes_stored;   /**< compressed bytes of its records */
    uint64_t bytes_kv_full;  /**< uncompressed KV bytes of the full cache */
    uint64_t bytes_kv_kept;  /**< uncompressed KV bytes of the kept pairs */
    int64_t ingest_time;     /**< unix seconds */
    const char *source_path; /**< recorded source path, may be "" */
    uint8_t hash[16];        /**< content hash of its cache: changes when it is re-ingested
                                  with other content */
} kvzip_doc_entry;

/** Called once per stored document, in id byte order; the entry is valid during the
 *  call only. Return 0 to go on, nonzero to stop (kvzip_store_list returns that value). */
typedef int (*kvzip_doc_fn)(void *user, const kvzip_doc_entry *doc);

/** List the stored documents in one consistent snapshot (one LMDB read transaction).
 *  @return 0, the callback's nonzero value; KVZIP_ERR_ARG; KVZIP_ERR_CLOSED;
 *  KVZIP_ERR_FORMAT (corrupt entry); KVZIP_ERR_LMDB. */
int kvzip_store_list(kvzip_store *s, kvzip_doc_fn cb, void *user);

/** The entry of one document, read in its own short read transaction (strings in
 *  @p out are valid until the next call on this thread). @return 0; KVZIP_ERR_ARG;
 *  KVZIP_ERR_CLOSED; KVZIP_ERR_NOTFOUND (no such id; a split document is found as
 *  "ID#1", ...); KVZIP_ERR_FORMAT; KVZIP_ERR_LMDB. */
int kvzip_store_doc(kvzip_store *s, const char *doc_id, kvzip_doc_entry *out);

/* ------------------------------------------------------------------------- */
/* Ingest                                                                      */

enum { KVZIP_EVICT_GLOBAL = 0, KVZIP_EVICT_UNIFORM = 1 };
/** Stored K/V row types: the on-disk numbering of the blob format (docs/FORMAT.md §4.1,
 *  common/kvz_kvdtype.h). q8 = int8 + one f16 scale per 32 values (the default);
 *  q4 = 4-bit + f16 scale and minimum per 32 values. */
enum { KVZIP_KV_F32 = 0, KVZIP_KV_F16 = 1, KVZIP_KV_BF16 = 2, KVZIP_KV_Q8 = 3, KVZIP_KV_Q4 = 4 };

typedef struct kvzip_ingest_opts {
    float ratio;             /**< fraction of context KV pairs kept, (0, 1] (default 0.3) */
    int32_t mode;            /**< KVZIP_EVICT_GLOBAL (one threshold, default) or _UNIFORM */
    int32_t kv_dtype;        /**< stored K/V type: KVZIP_KV_Q8 (default), _Q4, _F16, _BF16, _F32 */
    int32_t part_tokens;     /**< split longer documents into parts of at most this many
                                  tokens (0 = the model's maximum, kvzip_model_info) */
    const char *source_path; /**< recorded with the document (NULL = "") */
} kvzip_ingest_opts;

void kvzip_ingest_defaults(kvzip_ingest_opts *o);

typedef struct kvzip_ingest_result {
    int32_t parts;           /**< caches stored: 1, or the number of parts ID#1..ID#parts */
    int32_t written;         /**< parts whose records were written */
    int32_t unchanged;       /**< parts already stored with this content (no model work) */
    int32_t linked;          /**< parts whose content was stored under another id (linked) */
    int64_t tokens;          /**< context tokens of the document */
    int64_t pairs_total, pairs_kept;  /**< context KV pairs (layers x KV heads x tokens) */
    uint64_t bytes_full;     /**< uncompressed KV of the full caches, stored dtype */
    uint64_t bytes_kept;     /**< uncompressed KV of the kept pairs */
    uint64_t bytes_stored;   /**< compressed bytes in the store */
    double seconds;
} kvzip_ingest_result;

/**
 * Ingest one document: tokenize @p text, prefill it, score every KV pair by
 * KVzip's reconstruction criterion, keep the top opts->ratio, and store the
 * cache under @p doc_id in one LMDB transaction per part. A document longer than
 * the part limit is stored as "doc_id#1", "doc_id#2", ... (near-equal parts;
 * parts of an older, longer version are removed). Same content under the same
 * id: nothing recomputed. Thread-safe per store; serialised per model on CUDA.
 * @param text  UTF-8, @p len bytes (no NUL bytes needed or allowed).
 * @param opts  NULL = kvzip_ingest_defaults().
 * @param res   out, may be NULL.
 * @return 0; KVZIP_ERR_ARG (NULL, bad ratio/mode/dtype, id empty or longer than 499 bytes,
 *   store opened read-only); KVZIP_ERR_CLOSED; KVZIP_ERR_EMPTY (no text);
 *   KVZIP_ERR_ENCODING; KVZIP_ERR_MODEL (the store holds another model's caches);
 *   KVZIP_ERR_FULL (store full: the failing part is not stored, earlier parts are);
 *   KVZIP_ERR_BUSY; KVZIP_ERR_LMDB; KVZIP_ERR_CUDA; KVZIP_ERR_NOMEM.
 */
int kvzip_ingest(kvzip_model *m, kvzip_store *s, const char *doc_id, const char *text, size_t len,
                 const kvzip_ingest_opts *opts, kvzip_ingest_result *res);

/* ------------------------------------------------------------------------- */
/* Sessions and questions                                                      */

typedef struct kvzip_session kvzip_session;

typedef struct kvzip_session_opts {
    int32_t budget;          /**< LongFlow output cache: question and answer tokens live in
                                  this many slots per layer, evicting the least-attended
                                  slot once full (default 1024; 0 = unbounded; else >= 16).
                                  A question must fit in budget - 8 slots. */
    int32_t max_tokens;      /**< answer tokens at most (default 256) */
    int32_t max_question_tokens; /**< with budget 0: rows reserved per question (default 512) */
    float temperature;       /**< 0 = greedy (default) */
    float top_p;             /**< nucleus mass (default 1 = off) */
    uint64_t seed;           /**< sampling seed, reset for every question (default 1) */
    const char *system;      /**< text sessions: system text (NULL = the model's default,
                                  "" = none). Stored documents keep the prefix they were
                                  ingested with. */
} kvzip_session_opts;

void kvzip_session_defaults(kvzip_session_opts *o);

/**
 * Open a session on the stored document @p doc_id: read, verify and decompress its
 * cache into memory (the store is not needed afterwards). Loading is pipelined
 * (records decompressed on a thread pool; on CUDA uploaded layer by layer while the
 * next ones decompress and converted on the GPU). The model keeps the caches of
 * closed sessions in a per-model document cache (least recently used out first,
 * 512 MiB by default, in device memory on CUDA; the environment variable
 * KVZIP_DOC_CACHE_MB read at kvzip_model_open sets its size, 0 = keep nothing):
 * a later session on the same document, with the same budget and question room,
 * reuses it without reading the store, as long as the store still maps @p doc_id
 * to the same content (checked on every open). Two open sessions on one document
 * never share a cache: the second gets its own copy.
 * @param opts  NULL = kvzip_session_defaults().
 * @return 0; KVZIP_ERR_ARG (NULL, budget 1..15 or negative, max_tokens < 1);
 *   KVZIP_ERR_CLOSED (m or s); KVZIP_ERR_NOTFOUND (no such id; a document stored in
 *   parts is found as "doc_id#1", ... — kvzip_store_has_doc tells);
 *   KVZIP_ERR_MODEL (cached by another model); KVZIP_ERR_CHECKSUM / KVZIP_ERR_FORMAT /
 *   KVZIP_ERR_TRUNCATED / KVZIP_ERR_VERSION (corrupt record); KVZIP_ERR_LMDB;
 *   KVZIP_ERR_CUDA; KVZIP_ERR_NOMEM.
 */
int kvzip_session_open(kvzip_model *m, kvzip_store *s, const char *doc_id,
                       const kvzip_session_opts *opts, kvzip_session **out);

/**
 * Open a session on plain text: prefill it (after the chat prefix) into a full,
 * uncompressed cache — the reference KVzip compresses.
 * @return 0; KVZIP_ERR_ARG; KVZIP_ERR_CLOSED; KVZIP_ERR_EMPTY; KVZIP_ERR_ENCODING;
 *   KVZIP_ERR_CUDA; KVZIP_ERR_NOMEM.
 */
int kvzip_session_open_text(kvzip_model *m, const char *text, size_t len,
                            const kvzip_session_opts *opts, kvzip_session **out);

/**
 * Open a session with no document: only the chat prefix (the system text of
 * @p opts, or the model's) is prefilled, and questions are answered from what the
 * model knows — a plain chat, as kvzip-serve answers a request without
 * "documents". kvzip_session_info's doc_tokens == prefix_tokens.
 * @return 0; KVZIP_ERR_ARG; KVZIP_ERR_CLOSED; KVZIP_ERR_CUDA; KVZIP_ERR_NOMEM.
 */
int kvzip_session_open_chat(kvzip_model *m, const kvzip_session_opts *opts, kvzip_session **out);

/** Close the session and drop its references (the model or store may be freed here if
 *  their handles were closed already). @return 0 (also for NULL); KVZIP_ERR_BUSY (the
 *  session is answering in a batch: nothing is closed; close it after its done callback). */
int kvzip_session_close(kvzip_session *ss);

/** The document a session answers from. */
typedef struct kvzip_session_info {
    int32_t doc_tokens;      /**< prefix + context tokens: questions start at this position */
    int32_t prefix_tokens;   /**< chat prefix tokens (system + instruction) */
    int32_t from_store;      /**< 1: a stored cache, 0: prefilled text */
    float ratio;             /**< kept ratio it was ingested with (1 for text) */
    uint64_t rows_kept;      /**< KV rows held, over all layers and KV heads */
    uint64_t rows_full;      /**< rows of the uncompressed cache (doc_tokens x layers x KV heads) */
    double load_s;           /**< store: read + verify + decompress + place (a reused
                                  cache: the time to find it); text: prefill */
} kvzip_session_info;

/** @return 0; KVZIP_ERR_ARG. */
int kvzip_session_info_get(const kvzip_session *ss, kvzip_session_info *out);

/**
 * Called with each answer token as it is decoded: @p piece holds its @p len bytes
 * (UTF-8, but one character may be split over two tokens; not NUL-terminated, valid
 * during the call). Return 0 to go on, nonzero to stop: kvzip_ask then returns
 * KVZIP_ERR_CANCELED (the session stays usable).
 */
typedef int (*kvzip_token_fn)(void *user, const char *piece, size_t len, int32_t token);

/** Figures of one answer (all that `kvzip-query --stats` prints). */
typedef struct kvzip_answer_stats {
    int32_t prompt_tokens;   /**< question tokens incl. the chat layout */
    int32_t answer_tokens;   /**< generated tokens (the stop token not counted) */
    int32_t stopped;         /**< 1: a stop token ended the answer; 0: max_tokens */
    double ttft_s;           /**< question prefill = time to first token */
    double decode_s;         /**< all later steps */
    double decode_tok_s;     /**< (answer_tokens - 1) / decode_s, 0 when undefined */
    uint64_t kv_bytes_held;  /**< K/V bytes in live rows (document + output cache) at the end */
    int64_t kv_doc_rows;     /**< document rows held, over layers and KV heads */
    int64_t out_used;        /**< output-cache slots in use (max over layers) */
    int64_t out_slots;       /**< output-cache slots per layer (the budget) */
    int64_t evictions;       /**< output-cache overwrites for this answer */
} kvzip_answer_stats;

/**
 * Answer @p question from the session's document. Every question starts from the
 * document alone (earlier questions and answers are forgotten).
 * @param cb      streaming callback, may be NULL.
 * @param answer  out, may be NULL: the whole answer, NUL-terminated, malloc'd
 *                (kvzip_free); set also when the callback stopped the answer.
 * @param st      out, may be NULL.
 * @return 0; KVZIP_ERR_ARG (NULL session/question); KVZIP_ERR_EMPTY (empty question);
 *   KVZIP_ERR_CONTEXT (the question does not fit in budget - 8 slots, or with budget 0
 *   exceeds max_question_tokens); KVZIP_ERR_CANCELED; KVZIP_ERR_BUSY (the session is
 *   answering in a batch); KVZIP_ERR_CUDA; KVZIP_ERR_NOMEM.
 */
int kvzip_ask(kvzip_session *ss, const char *question, kvzip_token_fn cb, void *user,
              char **answer, kvzip_answer_stats *st);

/* ------------------------------------------------------------------------- */
/* Continuous batching: many sessions' answers decoded together                */

/**
 * A batch decodes the answers of many sessions together: every step runs one decode
 * token for each answering session in one pass over the weights (on CUDA one batched
 * forward pass over all their per-head, ragged caches; on the CPU the step runs the
 * sessions one after another, each exactly as kvzip_ask would). Sessions join with
 * kvzip_batch_submit() from any thread and leave when their answer ends; ONE
 * scheduler thread calls kvzip_batch_step() in a loop (kvzip_batch_wait() while idle).
 *
 * A step: (1) admits waiting questions in submission order: each one's question
 * prefill runs and its first token is sampled and passed to its token callback; at
 * most max_admit questions and max_admit_tokens question tokens per step (the first
 * waiting question is always admitted), so the running answers get their next token
 * after a bounded prefill; (2) one decode step for every admitted answer, each sampled
 * with its own session's temperature, top_p and seed. An answer ends at a stop token,
 * at its session's max_tokens, when its token callback returns nonzero
 * (KVZIP_ERR_CANCELED), or on an error; its session is then rolled back to its
 * document exactly as after kvzip_ask, and its done callback is called. For the same
 * session, question and options the answer is token for token kvzip_ask's on the CPU.
 * On CUDA the device lock is taken per prefill and per decode step (FIFO: sessions
 * loading on other threads take turns with the steps).
 */
typedef struct kvzip_batch kvzip_batch;

typedef struct kvzip_batch_opts {
    int32_t max_seqs;         /**< answers waiting + running at most (default 32; 1..4096) */
    int32_t max_admit;        /**< question prefills per step at most (default 4; >= 1) */
    int32_t max_admit_tokens; /**< question tokens prefilled per step at most, beyond the first
                                   question (default 1024; >= 1) */
} kvzip_batch_opts;

void kvzip_batch_defaults(kvzip_batch_opts *o);

/**
 * Open a batch on model @p m (it holds a reference on the model until closed).
 * @param opts  NULL = kvzip_batch_defaults().
 * @return 0; KVZIP_ERR_ARG (NULL, options out of range); KVZIP_ERR_CLOSED; KVZIP_ERR_NOMEM.
 */
int kvzip_batch_open(kvzip_model *m, const kvzip_batch_opts *opts, kvzip_batch **out);

/**
 * Called once per submitted answer when it ends, on the stepping thread, after its
 * session was rolled back: the session is free again (ask, submit or close it, also
 * from inside this callback). @p rc: 0; KVZIP_ERR_CANCELED (the token callback returned
 * nonzero); KVZIP_ERR_CLOSED (kvzip_batch_close ended it); or the step's error
 * (KVZIP_ERR_CUDA, KVZIP_ERR_CONTEXT, KVZIP_ERR_NOMEM) — kvzip_errdetail() on this
 * thread has the detail during the call. @p st: the answer's figures as kvzip_ask
 * fills them, except ttft_s = kvzip_batch_submit -> first token (waiting for admission
 * included) and decode_s = first token -> last token (steps shared with the others).
 */
typedef void (*kvzip_done_fn)(void *user, int rc, const kvzip_answer_stats *st);

/**
 * Queue @p question on session @p ss (thread-safe, cheap: tokenizes and checks, no
 * model work). The session must not be used otherwise until @p done is called; the
 * answer streams through @p cb (may be NULL) as with kvzip_ask.
 * @param done  required: called exactly once, unless this call returns an error.
 * @return 0; KVZIP_ERR_ARG (NULL b/ss/question/done, a session of another model);
 *   KVZIP_ERR_EMPTY; KVZIP_ERR_CONTEXT (as kvzip_ask); KVZIP_ERR_BUSY (max_seqs answers
 *   are waiting or running, or the session is already in a batch); KVZIP_ERR_NOMEM.
 */
int kvzip_batch_submit(kvzip_batch *b, kvzip_session *ss, const char *question, kvzip_token_fn cb,
                       kvzip_done_fn done, void *user);

/**
 * One scheduling step (from one thread at a time): admissions, then one decode step
 * over all running answers; callbacks run inside. An error of one question's prefill
 * ends that answer alone; an error of the shared decode step ends every answer of that
 * step (each gets its done callback with the error) and is returned.
 * @return answers still waiting or running (>= 0), 0 when there was nothing to do;
 *   KVZIP_ERR_ARG (NULL); the decode step's error (KVZIP_ERR_CUDA, ...).
 */
int kvzip_batch_step(kvzip_batch *b);

/**
 * Block until an answer is waiting or running, or @p timeout_s seconds pass (<= 0: do
 * not block). @return answers waiting or running (0 on a timeout); KVZIP_ERR_ARG.
 */
int kvzip_batch_wait(kvzip_batch *b, double timeout_s);

/** What kvzip_batch_info_get reports. */
typedef struct kvzip_batch_info {
    int32_t running;          /**< answers admitted and decoding */
    int32_t waiting;          /**< submitted, not admitted yet */
    int32_t last_step_size;   /**< answers in the last decode step (0: it had none) */
    double last_step_s;       /**< seconds of the last decode step's forward pass (from holding
                                   the device lock to the results on the host) */
    double last_admit_s;      /**< seconds of the last step's question prefills */
    int32_t last_admitted;    /**< questions admitted in the last step */
    uint64_t steps;           /**< decode steps run */
    uint64_t tokens;          /**< tokens generated, over all answers */
    /* how the decode steps ran (they add up to the steps that did not fail): */
    uint64_t steps_replayed;  /**< batched pass replayed from a kept CUDA graph */
    uint64_t steps_captured;  /**< batched pass captured into a new CUDA graph (then launched) */
    uint64_t steps_eager;     /**< batched pass launched kernel by kernel (a shape's first step,
                                   or graphs off) */
    uint64_t steps_passes;    /**< one single-answer pass per answer (CPU; one answer; caches
                                   the batched pass does not take) */
    uint64_t rows_logits;     /**< answer-steps whose logits row came back to the host (sampling
                                   answers); a greedy answer gets its argmax id alone */
} kvzip_batch_info;

/** @return 0; KVZIP_ERR_ARG (NULL). Thread-safe. */
int kvzip_batch_info_get(kvzip_batch *b, kvzip_batch_info *out);

/**
 * End every waiting and running answer (done callback with KVZIP_ERR_CLOSED, sessions
 * rolled back), drop the model reference and free the batch. No other thread may be
 * inside a call on @p b. @return 0 (also for NULL).
 */
int kvzip_batch_close(kvzip_batch *b);

/* ------------------------------------------------------------------------- */
/* Multi-document sessions: several stored caches composed into one context     */

/** Where the composed documents' positions go (docs/MULTIDOC.md). */
enum {
    KVZIP_PLACE_AUTO = 0,       /**< sequential when the span fits the model's context, else parallel */
    KVZIP_PLACE_SEQUENTIAL = 1, /**< document i after document i-1; keys re-rotated by the offset */
    KVZIP_PLACE_PARALLEL = 2,   /**< every document at its ingest positions, right after the prefix */
};

typedef struct kvzip_docs_opts {
    int32_t placement;   /**< KVZIP_PLACE_* (default AUTO) */
    float key_scale;     /**< multiplies document keys (an APE-style attention temperature
                              1/key_scale on document tokens); 0 or 1 = off (default) */
} kvzip_docs_opts;

void kvzip_docs_defaults(kvzip_docs_opts *o);

/**
 * Open a session on several stored documents composed into one context, in the
 * order given. An id stored in parts ("ID#1", "ID#2", ...) means all of its parts
 * in order; "ID#N" names one part. The system prefix appears once (every document
 * must have been ingested with the same one). Auto placement is sequential when
 * prefix + all documents + max_question_tokens + max_tokens fit the model's trained
 * context (kvzip_model_info.n_ctx), else parallel. kvzip_session_info then describes
 * the composition: doc_tokens = where questions start, ratio = the lowest ratio.
 * @param dopts  NULL = kvzip_docs_defaults().
 * @return 0; KVZIP_ERR_ARG (NULL, n < 1 or > 256 documents after expansion, an empty
 *   id, a document named twice — also once as ID and once as ID#N — unknown
 *   placement); KVZIP_ERR_NOTFOUND (an unknown id); KVZIP_ERR_FORMAT (documents
 *   stored with different system prefixes); KVZIP_ERR_CONTEXT (positions past the
 *   format's limit); KVZIP_ERR_NOMEM (the composed rows do not fit in memory);
 *   and kvzip_session_open's errors. Every error's detail names the document.
 */
int kvzip_session_open_docs(kvzip_model *m, kvzip_store *s, const char *const *doc_ids, int32_t n,
                            const kvzip_session_opts *opts, const kvzip_docs_opts *dopts,
                            kvzip_session **out);

/** What a multi-document session composed. */
typedef struct kvzip_docs_info {
    int32_t n_docs;      /**< documents after expanding split ids (1 for other sessions) */
    int32_t placement;   /**< KVZIP_PLACE_SEQUENTIAL or KVZIP_PLACE_PARALLEL (0 for other sessions) */
    int64_t span;        /**< prefix + every document's tokens: the sequential span */
    int32_t max_doc_tokens; /**< the longest document's context tokens */
} kvzip_docs_info;

/** @return 0; KVZIP_ERR_ARG. */
int kvzip_session_docs_info(const kvzip_session *ss, kvzip_docs_info *out);

#ifdef __cplusplus
}
#endif
#endif /* KVZIP_H */
