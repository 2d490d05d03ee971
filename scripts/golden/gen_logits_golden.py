#!/usr/bin/env python3
"""Generate tests/golden/logits_smollm2.bin: reference logits from HF transformers.

Loads models/SmolLM2-135M-Instruct.Q4_1.gguf with transformers (GGUF dequantized to
fp32, CPU, eager attention), tokenizes 3 prompts with scripts/golden/reftok.py (our
own `tokenizers`-based rebuild of the GGUF tokenizer, SmolLM digit rule included),
and writes, little-endian:

    char  magic[4] = "KVZL"
    u32   version = 1
    u32   n_prompts
    u32   n_vocab
    per prompt:
        u32 n_tok
        u32 ids[n_tok]
        (u32 id, f32 logit)[n_tok][16]   top-16 per position, logit descending
                                          (ties: lower id first)
        f32 last_logits[n_vocab]          full logits of the last position
        u32 n_gen = 64
        u32 gen[64]                       greedy continuation (argmax each step,
                                          no stop at EOS; exactly 64 ids)

The ids are the model input as is (no BOS is added: the GGUF says
add_bos_token = false).  Logits at position p predict token p+1.
"""
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reftok  # noqa: E402

N_TOP = 16
N_GEN = 64

PROMPT_CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nRead the passage and answer the question.\n\n"
    "The pump station at Kessel Ridge lifts water 86 meters from the river intake to a "
    "reservoir that holds 12,500 cubic meters. It has three pumps; each delivers 140 liters "
    "per second at full speed and draws 165 kilowatts. Normally only two pumps run, and the "
    "third is kept as a standby. In July 2023 the station ran for 612 hours and used "
    "198,000 kilowatt-hours of electricity.\n\n"
    "Question: How long does it take two pumps at full speed to fill the empty reservoir, "
    "in hours?<|im_end|>\n<|im_start|>assistant\n"
)

PROMPT_PROSE = (
    "The lighthouse keeper's daughter had grown up with the sound of the sea in every room. "
    "In winter the storms came from the west, throwing spray against the windows of the kitchen "
    "until the glass was white with salt, and her father would climb the spiral stairs twice "
    "each night to trim the wick and wind the clockwork that turned the great lens. She learned "
    "to count the flashes before she learned to read: three short, one long, a pause of twelve "
    "heartbeats, and then again. Ships that passed the headland in the dark counted them too, "
    "and knew from that rhythm exactly where they were. When she was fourteen, the supply boat "
    "failed to arrive for nine days, and"
)

PROMPT_CODE = (
    "import math\n\n\n"
    "def is_prime(n: int) -> bool:\n"
    "    \"\"\"Return True if n is a prime number.\"\"\"\n"
    "    if n < 2:\n"
    "        return False\n"
    "    if n % 2 == 0:\n"
    "        return n == 2\n"
    "    limit = int(math.isqrt(n))\n"
    "    for d in range(3, limit + 1, 2):\n"
    "        if n % d == 0:\n"
    "            return False\n"
    "    return True\n\n\n"
    "def primes_below(limit: int) -> list[int]:\n"
    "    \"\"\"Return all primes smaller than limit, in increasing order.\"\"\"\n"
    "    return [n for n in range(limit) if is_prime(n)]\n\n\n"
    "def main() -> None:\n"
    "    primes = primes_below(100)\n"
    "    print(len(primes), sum(primes))\n"
)

PROMPTS = [("chat", PROMPT_CHAT, True), ("prose", PROMPT_PROSE, False), ("code", PROMPT_CODE, False)]


def greedy_manual(model, ids, n):
    """Plain argmax loop with a KV cache, to cross-check model.generate()."""
    out, gaps = [], []

    def pick(lg):
        top2 = torch.topk(lg, 2).values
        gaps.append(float(top2[0] - top2[1]))
        return int(torch.argmax(lg))

    with torch.no_grad():
        o = model(torch.tensor([ids]), use_cache=True)
        past = o.past_key_values
        nxt = pick(o.logits[0, -1])
        for _ in range(n):
            out.append(nxt)
            o = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = o.past_key_values
            nxt = pick(o.logits[0, -1])
    return out, gaps[:n]


def main():
    out_path = os.path.join(reftok.GOLDEN_DIR, "logits_smollm2.bin")
    tok, _ = reftok.build(reftok.MODEL_PATH)
    model = reftok.load_model()
    from transformers import GenerationConfig

    blobs = [b"KVZL", struct.pack("<III", 1, len(PROMPTS), model.config.vocab_size)]
    for name, text, specials in PROMPTS:
        ids = reftok.encode(tok, text, specials)
        n = len(ids)
        assert 110 <= n <= 200, (name, n)
        assert tok.decode(ids, skip_special_tokens=False) == text, name
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
        assert logits.shape == (n, model.config.vocab_size)
        # top-16 per position, logit descending, ties by lower id (stable sort on -logit)
        order = np.argsort(-logits, axis=1, kind="stable")[:, :N_TOP]
        top_logit = np.take_along_axis(logits, order, axis=1)
        top = np.empty((n, N_TOP), dtype=[("id", "<u4"), ("logit", "<f4")])
        top["id"] = order
        top["logit"] = top_logit
        last = logits[-1].astype("<f4")

        gcfg = GenerationConfig(do_sample=False, max_new_tokens=N_GEN, eos_token_id=None,
                                pad_token_id=2, bos_token_id=None)
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), generation_config=gcfg,
                               attention_mask=torch.ones(1, n, dtype=torch.long))
        gen = g[0, n:].tolist()
        assert len(gen) == N_GEN, len(gen)
        man, gaps = greedy_manual(model, ids, N_GEN)
        first_div = next((i for i in range(N_GEN) if gen[i] != man[i]), None)
        assert gen[0] == int(order[-1, 0]), "generate()'s first token != argmax of last logits"

        blobs += [struct.pack("<I", n), np.asarray(ids, "<u4").tobytes(), top.tobytes(),
                  last.tobytes(), struct.pack("<I", N_GEN), np.asarray(gen, "<u4").tobytes()]
        srt = np.sort(logits[-1])[::-1]
        print(f"[{name}] n_tok={n} max|logit|={np.abs(logits).max():.3f} "
              f"(last pos {np.abs(last).max():.3f}); last top1-top2 gap={srt[0]-srt[1]:.4f}; "
              f"min top1-top2 gap over positions={np.min(top_logit[:, 0]-top_logit[:, 1]):.5f}; "
              f"manual greedy {'agrees' if first_div is None else f'DIFFERS from step {first_div}'}; "
              f"min top1-top2 gap over the 64 greedy steps={min(gaps):.4f} (step {int(np.argmin(gaps))})")
        print(f"  gen ids: {gen}")
        print(f"  gen text: {tok.decode(gen, skip_special_tokens=False)!r}")
    data = b"".join(blobs)
    with open(out_path, "wb") as f:
        f.write(data)
    print(f"wrote {out_path} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
