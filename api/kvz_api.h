/* Internals shared by the files of the public library (api/kvzip.c: handles,
 * sessions, kvzip_ask; api/kvzip_batch.c: the continuous-batching scheduler).
 * Not installed: callers see only include/kvzip.h. */
#ifndef KVZ_API_H
#define KVZ_API_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "kvzip.h"
#include "kvz_doc_cache.h"
#include "kvz_model.h"
#include "kvz_store.h"
#include "kvz_tokenizer.h"

#define QUESTION_SLACK 8    /* output slots kept free beyond the question (kvzip-query --budget) */

/* A reference-counted handle: the caller holds one reference until close; each
 * session (and each batch) holds one on its model, each session one on its store. */
typedef struct ref {
    pthread_mutex_t mu;
    int32_t refs;
    int32_t closed;   /* the caller's handle was closed */
} ref;

struct kvzip_model {
    ref r;
    kvz_model *m;
    pthread_mutex_t dev;  /* with dev_cv, dev_next, dev_serving: the FIFO lock that
                             serialises device work on CUDA (one stream + cuBLAS handle) */
    pthread_cond_t dev_cv;
    uint64_t dev_next, dev_serving;
    kvz_doc_cache *dc;    /* loaded stored documents (ingest/kvz_doc_cache.h): a second
                             session on one document pays no load; thread-safe itself */
    double load_s;
    int pin_map;          /* kvzip_model_opts.pin_store_map: loads take the direct route */
};

struct kvzip_store {
    ref r;
    kvz_store *s;
    unsigned flags;
};

struct kvzip_session {
    kvzip_model *model;
    kvzip_store *store;       /* NULL for text sessions */
    kvz_kv *kv;
    int borrowed;             /* kv is lent by the model's document cache */
    atomic_int in_batch;      /* 1 from kvzip_batch_submit until its done callback */
    kvzip_session_opts o;
    kvzip_session_info info;
    kvzip_docs_info docs;     /* multi-document sessions (kvzip_session_open_docs) */
};

/* Take (0) or refuse (KVZIP_ERR_CLOSED) a reference on an open model; drop one. */
int kvz_api_model_ref(kvzip_model *m);
void kvz_api_model_unref(kvzip_model *m);

/* The model's device lock (FIFO; a no-op on the CPU). */
void kvz_api_dev_lock(kvzip_model *m);
void kvz_api_dev_unlock(kvzip_model *m);

/* A question's tokens in the chat layout, checked against the session's output cache
 * exactly as kvzip_ask checks them: 0; KVZIP_ERR_EMPTY; KVZIP_ERR_CONTEXT;
 * KVZIP_ERR_NOMEM. @p q is emptied on an error. */
int kvz_api_question(const kvzip_session *ss, const char *question, kvz_tokens *q);

/* Text of token @p id into @p piece (256 bytes): its length, or a negative error. */
int kvz_api_piece(const kvz_tokenizer *tok, int32_t id, char piece[256]);

#endif
