"""Two API server processes on one engine core (`serve --api-server-count 2`)."""

import concurrent.futures
import subprocess
import sys
import time

import httpx
import openai

URL = "http://127.0.0.1:8766"
MODEL = "SmolLM2-135M-Instruct"
serve = [sys.executable, "-m", "jax_engine", "serve", "--port", "8766",
         "--api-server-count", "2", "--max-model-len", "1024",
         "--log-level", "warning"]
server = subprocess.Popen(serve)
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time",
           "Water boils at"]


def complete(prompt: str) -> str:  # a client of its own: a connection of its own
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="none")
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                       temperature=0)
    return answer.choices[0].text


try:
    while True:  # both API servers wait for the one engine core to be ready
        try:
            if httpx.get(f"{URL}/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.5)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        for prompt, text in zip(PROMPTS, pool.map(complete, PROMPTS)):
            print(f"{prompt!r} -> {text!r}")
    metrics = httpx.get(f"{URL}/metrics").text  # whichever API server answers: the sum
    tokens = [line for line in metrics.splitlines()
              if line.startswith("vllm:generation_tokens_total")]
    print(tokens[0].split("{")[0], tokens[0].split()[-1])
finally:
    server.terminate()  # SIGTERM: both API servers drain, then the core stops
    print("exit status:", server.wait())
