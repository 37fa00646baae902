"""Stream a chat completion from a running deployment with the official openai client.

    python -m dynamo_pd.serve --prefill 1 --decode 1 &      # or ./dev.sh serve
    python examples/stream_chat.py "Why is the sky blue?"

OPENAI_BASE_URL and OPENAI_API_KEY point it elsewhere (the openai client reads them).
"""

import os
import sys

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                api_key=os.environ.get("OPENAI_API_KEY", "none"))
question = sys.argv[1] if len(sys.argv) > 1 else "Write a haiku about the sea."
stream = client.chat.completions.create(
    model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
    max_tokens=64, temperature=0, stream=True, stream_options={"include_usage": True})
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    elif chunk.usage:
        print(f"\n[{chunk.usage.prompt_tokens} prompt tokens, {chunk.usage.prompt_tokens_details.cached_tokens} "
              f"cached, {chunk.usage.completion_tokens} generated]")
