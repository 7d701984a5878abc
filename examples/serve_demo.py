"""Ask the second of two ``kvpool serve`` processes (on one kvpoold) for the prompt the first just answered.

    python3 examples/serve_demo.py --url http://127.0.0.1:8001 --prompt "the same words as before"

Uses the openai client; prints how many prompt tokens the pool already held
(the first server's prefill, found by the second through the daemon).
"""

import argparse

import openai

p = argparse.ArgumentParser()
p.add_argument("--url", required=True)
p.add_argument("--prompt", required=True, help="the prompt the first server answered")
p.add_argument("--name", default="serve-b")
args = p.parse_args()
client = openai.OpenAI(base_url=args.url + "/v1", api_key="none")
out = client.completions.create(model="tiny", prompt=args.prompt, max_tokens=8, temperature=0)
usage = out.usage
print(f"{args.name}: prompt {usage.prompt_tokens} tokens, {usage.prompt_tokens_details.cached_tokens} found in the "
      f"pool; answer: {out.choices[0].text!r}")
chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello world"}],
                                      max_tokens=6, temperature=0, stream=True)
print(f"{args.name}: chat, streamed: " + "".join(c.choices[0].delta.content or "" for c in chat if c.choices))
