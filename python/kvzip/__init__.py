"""kvzip: Python binding (ctypes) of libkvzip (include/kvzip.h).

Model, Store, ingest(), Session.ask(question, stream=...). Every library error
raises KvzipError(code, detail). The library is located at import time; see
_find_library() for the order.
"""
import codecs
import ctypes
import ctypes.util
import os
import subprocess
import sys

__all__ = ["Model", "Store", "Session", "ingest", "KvzipError", "library_path", "version"]

# error codes (kvzip.h)
_ERR_NAMES = {
    -1: "NOMEM", -2: "IO", -3: "FORMAT", -4: "TRUNCATED", -5: "UNSUPPORTED", -6: "ARG",
    -7: "NOTFOUND", -8: "CHECKSUM", -9: "MODEL", -10: "VERSION", -11: "LMDB", -12: "ZSTD",
    -13: "CUDA", -14: "FULL", -15: "CONTEXT", -16: "EMPTY", -17: "ENCODING", -18: "BUSY",
    -19: "NODEV", -20: "INTERNAL", -40: "CLOSED", -41: "CANCELED",
}
for _code, _name in _ERR_NAMES.items():
    globals()["ERR_" + _name] = _code

_DEVICES = {"cpu": 0, "cuda": 1, "auto": 2}
_MODES = {"global": 0, "uniform": 1}
_DTYPES = {"f32": 0, "f16": 1, "bf16": 2, "q8": 3, "q4": 4}  # kvzip.h KVZIP_KV_* (on-disk numbering)


def _find_library():
    """Path of libkvzip.so: $KVZIP_LIBRARY, $KVZIP_PREFIX/lib, pkg-config, the linker path,
    sys.prefix/lib."""
    env = os.environ.get("KVZIP_LIBRARY")
    if env:
        return env
    dirs = []
    if os.environ.get("KVZIP_PREFIX"):
        p = os.environ["KVZIP_PREFIX"]
        dirs += [os.path.join(p, "lib"), os.path.join(p, "lib64")]
    try:
        out = subprocess.run(["pkg-config", "--variable=libdir", "kvzip"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            dirs.append(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    for d in dirs:
        for name in ("libkvzip.so", "libkvzip.so.0"):
            if os.path.exists(os.path.join(d, name)):
                return os.path.join(d, name)
    found = ctypes.util.find_library("kvzip")
    if found:
        return found
    p = os.path.join(sys.prefix, "lib", "libkvzip.so")
    if os.path.exists(p):
        return p
    raise ImportError("libkvzip.so not found: set KVZIP_LIBRARY=/path/libkvzip.so or "
                      "KVZIP_PREFIX=<cmake install prefix>, or put its kvzip.pc on PKG_CONFIG_PATH")


library_path = _find_library()
_lib = ctypes.CDLL(library_path)

c_int, c_i32, c_i64, c_u64 = ctypes.c_int, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
c_float, c_double, c_char_p, c_void_p, c_size_t = (ctypes.c_float, ctypes.c_double,
                                                    ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t)


class _ModelOpts(ctypes.Structure):
    _fields_ = [("device", c_i32), ("n_threads", c_i32), ("synthetic", c_char_p), ("seed", c_u64),
                ("pin_store_map", c_i32)]


class _ModelInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 64), ("arch", ctypes.c_char * 16), ("chat", ctypes.c_char * 16),
                ("device", c_i32), ("n_layer", c_i32), ("n_head", c_i32), ("n_kv_head", c_i32),
                ("head_dim", c_i32), ("n_vocab", c_i32), ("n_ctx", c_i32), ("max_part_tokens", c_i32),
                ("weight_bytes", c_u64), ("load_s", c_double), ("fingerprint", ctypes.c_uint8 * 16)]


class _IngestOpts(ctypes.Structure):
    _fields_ = [("ratio", c_float), ("mode", c_i32), ("kv_dtype", c_i32), ("part_tokens", c_i32),
                ("source_path", c_char_p)]


class _IngestResult(ctypes.Structure):
    _fields_ = [("parts", c_i32), ("written", c_i32), ("unchanged", c_i32), ("linked", c_i32),
                ("tokens", c_i64), ("pairs_total", c_i64), ("pairs_kept", c_i64),
                ("bytes_full", c_u64), ("bytes_kept", c_u64), ("bytes_stored", c_u64),
                ("seconds", c_double)]


class _SessionOpts(ctypes.Structure):
    _fields_ = [("budget", c_i32), ("max_tokens", c_i32), ("max_question_tokens", c_i32),
                ("temperature", c_float), ("top_p", c_float), ("seed", c_u64), ("system", c_char_p)]


class _SessionInfo(ctypes.Structure):
    _fields_ = [("doc_tokens", c_i32), ("prefix_tokens", c_i32), ("from_store", c_i32),
                ("ratio", c_float), ("rows_kept", c_u64), ("rows_full", c_u64), ("load_s", c_double)]


class _AnswerStats(ctypes.Structure):
    _fields_ = [("prompt_tokens", c_i32), ("answer_tokens", c_i32), ("stopped", c_i32),
                ("ttft_s", c_double), ("decode_s", c_double), ("decode_tok_s", c_double),
                ("kv_bytes_held", c_u64), ("kv_doc_rows", c_i64), ("out_used", c_i64),
                ("out_slots", c_i64), ("evictions", c_i64)]


_TOKEN_FN = ctypes.CFUNCTYPE(c_int, c_void_p, ctypes.POINTER(ctypes.c_char), c_size_t, c_i32)

P = ctypes.POINTER


def _proto(name, restype, *args):
    f = getattr(_lib, name)
    f.restype = restype
    f.argtypes = list(args)
    return f


_version = _proto("kvzip_version", c_char_p)
_strerror = _proto("kvzip_strerror", c_char_p, c_int)
_errdetail = _proto("kvzip_errdetail", c_char_p)
_free = _proto("kvzip_free", None, c_void_p)
_model_defaults = _proto("kvzip_model_defaults", None, P(_ModelOpts))
_model_open = _proto("kvzip_model_open", c_int, c_char_p, P(_ModelOpts), P(c_void_p))
_model_close = _proto("kvzip_model_close", c_int, c_void_p)
_model_info = _proto("kvzip_model_info_get", c_int, c_void_p, P(_ModelInfo))
_store_open = _proto("kvzip_store_open", c_int, c_char_p, ctypes.c_uint, c_void_p, P(c_void_p))
_store_close = _proto("kvzip_store_close", c_int, c_void_p)
_store_has = _proto("kvzip_store_has_doc", c_int, c_void_p, c_char_p)
_ingest_defaults = _proto("kvzip_ingest_defaults", None, P(_IngestOpts))
_ingest = _proto("kvzip_ingest", c_int, c_void_p, c_void_p, c_char_p, c_char_p, c_size_t,
                 P(_IngestOpts), P(_IngestResult))
_session_defaults = _proto("kvzip_session_defaults", None, P(_SessionOpts))
_session_open = _proto("kvzip_session_open", c_int, c_void_p, c_void_p, c_char_p, P(_SessionOpts),
                       P(c_void_p))
_session_open_text = _proto("kvzip_session_open_text", c_int, c_void_p, c_char_p, c_size_t,
                            P(_SessionOpts), P(c_void_p))
_session_open_chat = _proto("kvzip_session_open_chat", c_int, c_void_p, P(_SessionOpts), P(c_void_p))
_session_close = _proto("kvzip_session_close", c_int, c_void_p)
_session_info = _proto("kvzip_session_info_get", c_int, c_void_p, P(_SessionInfo))
_ask = _proto("kvzip_ask", c_int, c_void_p, c_char_p, _TOKEN_FN, c_void_p, P(c_void_p),
              P(_AnswerStats))


def version():
    return _version().decode()


class KvzipError(Exception):
    """A libkvzip error: .code (negative KVZIP_ERR_*), .name ("NOTFOUND", ...), .detail."""

    def __init__(self, code, detail=""):
        self.code = code
        self.name = _ERR_NAMES.get(code, str(code))
        self.detail = detail
        msg = _strerror(code).decode(errors="replace")
        super().__init__(f"{msg}: {detail}" if detail else msg)


def _check(rc):
    if rc < 0:
        raise KvzipError(rc, _errdetail().decode(errors="replace"))
    return rc


def _b(s):
    return None if s is None else (s.encode() if isinstance(s, str) else bytes(s))


def _as_dict(st):
    return {name: getattr(st, name) for name, _ in st._fields_}


class _Handle:
    _close = None

    def close(self):
        if self._h:
            h, self._h = self._h, None
            _check(type(self)._close(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _handle(self):
        if not self._h:
            raise KvzipError(ERR_CLOSED, f"{type(self).__name__} is closed")  # noqa: F821
        return self._h


class Model(_Handle):
    """A model: Model(path) for a GGUF file or Model(synthetic="tiny-llama");
    device "cpu", "cuda" or "auto"; threads 0 = all cores."""
    _close = staticmethod(_model_close)

    def __init__(self, path=None, device="auto", threads=0, synthetic=None, seed=0):
        self._h = None
        if device not in _DEVICES:
            raise ValueError(f"device must be one of {sorted(_DEVICES)}")
        o = _ModelOpts()
        _model_defaults(ctypes.byref(o))
        o.device, o.n_threads, o.synthetic, o.seed = _DEVICES[device], threads, _b(synthetic), seed
        h = c_void_p()
        _check(_model_open(_b(os.fspath(path)) if path is not None else None, ctypes.byref(o),
                           ctypes.byref(h)))
        self._h = h.value

    @property
    def info(self):
        i = _ModelInfo()
        _check(_model_info(self._handle(), ctypes.byref(i)))
        d = _as_dict(i)
        for k in ("name", "arch", "chat"):
            d[k] = d[k].decode(errors="replace")
        d["fingerprint"] = bytes(i.fingerprint).hex()
        d["device"] = {0: "cpu", 1: "cuda"}.get(i.device, str(i.device))
        return d


class Store(_Handle):
    """A store folder. mode "r" read-only, "w" read-write (must exist), "c" create when
    missing. With model=, a store of another model is refused at open."""
    _close = staticmethod(_store_close)

    def __init__(self, path, mode="r", model=None):
        self._h = None
        flags = {"r": 1, "w": 0, "c": 2}.get(mode)
        if flags is None:
            raise ValueError('mode must be "r", "w" or "c"')
        h = c_void_p()
        _check(_store_open(_b(os.fspath(path)), flags, model._handle() if model else None,
                           ctypes.byref(h)))
        self._h = h.value

    def __contains__(self, doc_id):
        return _check(_store_has(self._handle(), _b(doc_id))) == 1


def ingest(model, store, doc_id, text, ratio=0.3, mode="global", kv_dtype="q8", part_tokens=0,
           source_path=None):
    """Compress @text with KVzip and store it under @doc_id (parts doc_id#1.. when longer
    than the model allows). Returns the figures as a dict."""
    o = _IngestOpts()
    _ingest_defaults(ctypes.byref(o))
    if mode not in _MODES or kv_dtype not in _DTYPES:
        raise ValueError("mode: global|uniform, kv_dtype: q8|q4|f16|bf16|f32")
    o.ratio, o.mode, o.kv_dtype, o.part_tokens = ratio, _MODES[mode], _DTYPES[kv_dtype], part_tokens
    o.source_path = _b(source_path)
    data = _b(text)
    r = _IngestResult()
    _check(_ingest(model._handle(), store._handle(), _b(doc_id), data, len(data), ctypes.byref(o),
                   ctypes.byref(r)))
    return _as_dict(r)


class Session(_Handle):
    """Questions against one document: Session(model, store, doc_id) loads a stored
    cache; Session(model, text=...) prefills plain text into a full cache;
    Session(model, chat=True) has no document (a plain chat on the chat prefix)."""
    _close = staticmethod(_session_close)

    def __init__(self, model, store=None, doc_id=None, text=None, budget=1024, max_tokens=256,
                 temperature=0.0, top_p=1.0, seed=1, max_question_tokens=512, system=None, chat=False):
        self._h = None
        if (doc_id is not None) + (text is not None) + bool(chat) != 1:
            raise ValueError("give doc_id (with store), text, or chat=True")
        o = _SessionOpts()
        _session_defaults(ctypes.byref(o))
        o.budget, o.max_tokens, o.max_question_tokens = budget, max_tokens, max_question_tokens
        o.temperature, o.top_p, o.seed, o.system = temperature, top_p, seed, _b(system)
        h = c_void_p()
        if doc_id is not None:
            if store is None:
                raise ValueError("doc_id needs a store")
            _check(_session_open(model._handle(), store._handle(), _b(doc_id), ctypes.byref(o),
                                 ctypes.byref(h)))
        elif chat:
            _check(_session_open_chat(model._handle(), ctypes.byref(o), ctypes.byref(h)))
        else:
            data = _b(text)
            _check(_session_open_text(model._handle(), data, len(data), ctypes.byref(o),
                                      ctypes.byref(h)))
        self._h = h.value
        self.last_stats = None

    @property
    def info(self):
        i = _SessionInfo()
        _check(_session_info(self._handle(), ctypes.byref(i)))
        return _as_dict(i)

    def ask(self, question, stream=None):
        """Answer @question; @stream, when given, is called with each piece of text as it
        is decoded (return True from it to stop early). Returns the whole answer. The
        figures of this answer are in self.last_stats."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        failure = []

        def on_token(_user, piece, n, _tok):
            if stream is None:
                return 0
            try:
                text = dec.decode(ctypes.string_at(piece, n))
                return 1 if (text and stream(text)) else 0
            except BaseException as e:  # re-raised after the call
                failure.append(e)
                return 1

        cb = _TOKEN_FN(on_token)
        ans = c_void_p()
        st = _AnswerStats()
        rc = _ask(self._handle(), _b(question), cb, None, ctypes.byref(ans), ctypes.byref(st))
        text = ""
        if ans.value:
            text = ctypes.string_at(ans.value).decode(errors="replace")
            _free(ans)
        if failure:
            raise failure[0]
        if stream is not None:
            tail = dec.decode(b"", final=True)
            if tail:
                stream(tail)
        if rc == ERR_CANCELED:  # noqa: F821  (stopped by the stream callback: partial answer)
            self.last_stats = _as_dict(st)
            return text
        _check(rc)
        self.last_stats = _as_dict(st)
        return text
