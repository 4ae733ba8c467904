"""Start `jax-engine serve` and talk to it with the official openai client, as any OpenAI user would."""

import subprocess
import sys
import time

import httpx
import openai

server = subprocess.Popen([sys.executable, "-m", "jax_engine", "serve", "--port", "8765", "--api-key", "sk-local",
                           "--max-model-len", "512", "--log-level", "warning"])
try:
    while True:  # loading the model and starting the engine loop take a few seconds
        try:
            if httpx.get("http://127.0.0.1:8765/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.5)

    client = openai.OpenAI(base_url="http://127.0.0.1:8765/v1", api_key="sk-local")
    print("models:", [m.id for m in client.models.list().data])

    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                           max_tokens=8, temperature=0)
    print("completion:", repr(completion.choices[0].text), completion.usage.completion_tokens, "tokens")

    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0, stream=True)
    print("chat, streamed:", "|".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))

    try:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", temperature=-1)
    except openai.BadRequestError as error:
        print("bad request:", error.status_code, error.body["message"])
finally:
    server.terminate()  # SIGTERM: in-flight requests finish, then the server exits
    server.wait()
