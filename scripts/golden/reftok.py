"""Reference tokenizer for SmolLM2 GGUF files, built with the `tokenizers` library.

transformers' GGUF -> tokenizer conversion for `gpt2`-type vocabularies applies only
the plain GPT-2 byte-level split and drops SmolLM's one-digit-per-token rule
(`tokenizer.ggml.pre = smollm`).  So we rebuild the tokenizer ourselves from the
GGUF's own vocab (tokenizer.ggml.tokens) and merges (tokenizer.ggml.merges):

    model         BPE(vocab, merges)  (no unk, no dropout, no prefixes/suffixes)
    pre_tokenizer Sequence([Digits(individual_digits=True),
                            ByteLevel(add_prefix_space=False, use_regex=True)])
    decoder       ByteLevel
    specials      every token with token_type == 3 (CONTROL) as a special AddedToken,
                  so "<|im_start|>" inside a string encodes to its single id when
                  encoding with add_special_tokens / specials enabled.

Self-check: "Hello world! 123" -> [19556, 905, 17, 216, 33, 34, 35].
"""
import os
import sys

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

EXPECT_HELLO = [19556, 905, 17, 216, 33, 34, 35]


def _field_strings(reader, name):
    f = reader.fields[name]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def _field_ints(reader, name):
    f = reader.fields[name]
    return [int(f.parts[i][0]) for i in f.data]


def build(path, check=True):
    """Return (tokenizer, info dict) built from the GGUF at `path`."""
    r = gguf.GGUFReader(path)
    tokens = _field_strings(r, "tokenizer.ggml.tokens")
    merges_s = _field_strings(r, "tokenizer.ggml.merges")
    ttype = _field_ints(r, "tokenizer.ggml.token_type")
    pre = bytes(r.fields["tokenizer.ggml.pre"].parts[-1]).decode() if "tokenizer.ggml.pre" in r.fields else None
    assert pre in (None, "smollm"), f"reftok only implements the smollm pre-tokenizer, GGUF says {pre!r}"
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate token strings in GGUF vocab"
    merges = []
    for m in merges_s:
        a, b = m.split(" ")
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(ttype) if t == 3]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for s in specials:
        assert tok.token_to_id(s) == vocab[s], f"special {s!r} got a new id"
    info = {"n_vocab": len(tokens), "n_merges": len(merges), "pre": pre, "specials": specials}
    if check:
        got = tok.encode("Hello world! 123", add_special_tokens=False).ids
        assert got == EXPECT_HELLO, f"tokenizer self-check failed: {got}"
        ims = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=True).ids
        assert ims[0] == vocab["<|im_start|>"] and ims[-1] == vocab["<|im_end|>"], ims
    return tok, info


def encode(tok, text, specials):
    """Encode `text` to ids (no BOS/EOS is ever added).  With `specials`, control-token
    strings such as "<|im_start|>" become their single ids.  Without, the text must not
    contain them (the `tokenizers` library always matches added tokens, so we assert
    their absence instead of encoding them literally)."""
    if not specials:
        for s in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
            assert s not in text, f"special token string {s!r} in text encoded without specials"
    return tok.encode(text, add_special_tokens=False).ids


# ---- shared paths and model loading for gen_logits_golden.py / gen_kvzip_golden.py ----
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL_DIR = os.path.join(ROOT, "models")
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_PATH = os.path.join(MODEL_DIR, MODEL_FILE)
GOLDEN_DIR = os.path.join(ROOT, "tests", "golden")


def load_model():
    """HF transformers LlamaForCausalLM from the GGUF (dequantized to fp32, CPU, eager
    attention), with the config facts the golden data relies on asserted."""
    import torch
    from transformers import AutoModelForCausalLM

    if not os.path.exists(MODEL_PATH):
        sys.exit(f"missing {MODEL_PATH}: run `bash scripts/fetch-model`")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        MODEL_DIR, gguf_file=MODEL_FILE, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    c = model.config
    # Verify what the golden data relies on.
    assert c.model_type == "llama", c.model_type
    assert c.num_hidden_layers == 30 and c.hidden_size == 576, c
    assert c.num_attention_heads == 9 and c.num_key_value_heads == 3, c
    assert getattr(c, "head_dim", 64) == 64 and c.intermediate_size == 1536, c
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": getattr(c, "rope_theta", None)}
    assert float(rope["rope_theta"]) == 100000.0, rope
    assert c.tie_word_embeddings and c.vocab_size == 49152, c
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32
    return model
