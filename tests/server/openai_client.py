#!/usr/bin/env python3
"""The official `openai` client against kvzip-serve (tests/cli/serve_openai.sh):
documents go in extra_body; a needle question, streaming and not, errors as the
client's exception classes. Exit 0 when every check passes."""
import sys
import openai

url, key, question, needle = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=240)
fails = 0

def check(desc, cond):
    global fails
    print(("ok    " if cond else "FAIL  ") + desc)
    fails += not cond

models = c.models.list()
check("models.list() names one model", len(models.data) == 1)
model = models.data[0].id
msgs = [{"role": "user", "content": question}]
r = c.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0,
                              extra_body={"documents": ["vault.txt"]})
answer = r.choices[0].message.content
print("answer:", answer)
check(f"non-streaming answer names {needle}", needle in answer)
check("usage filled in", r.usage.completion_tokens > 0 and r.usage.total_tokens ==
      r.usage.prompt_tokens + r.usage.completion_tokens)
s = c.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0, stream=True,
                              extra_body={"documents": ["vault.txt"]})
text, finish = "", None
for ch in s:
    if ch.choices:
        text += ch.choices[0].delta.content or ""
        finish = ch.choices[0].finish_reason or finish
check("streamed text equals the non-streaming answer", text == answer)
check("stream ends with a finish_reason", finish in ("stop", "length"))
try:
    c.chat.completions.create(model=model, messages=msgs, extra_body={"documents": ["missing-doc"]})
    check("unknown document raises NotFoundError", False)
except openai.NotFoundError as e:
    check("unknown document raises NotFoundError naming it", "missing-doc" in str(e))
try:
    c.chat.completions.create(model=model, messages=msgs, max_tokens=10**6)
    check("max_tokens over the limit raises BadRequestError", False)
except openai.BadRequestError:
    check("max_tokens over the limit raises BadRequestError", True)
try:
    openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    check("a wrong key raises AuthenticationError", False)
except openai.AuthenticationError:
    check("a wrong key raises AuthenticationError", True)
sys.exit(1 if fails else 0)
