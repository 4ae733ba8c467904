"""Start `jax-engine serve` and talk to it with the official openai client."""

import subprocess
import sys
import time

import httpx
import openai

URL = "http://127.0.0.1:8765"
MODEL = "SmolLM2-135M-Instruct"
# `jax-engine serve ...`, run with this Python so that it finds the same packages
serve = [sys.executable, "-m", "jax_engine", "serve", "--port", "8765", "--api-key",
         "sk-local", "--max-model-len", "1024", "--log-level", "warning"]
server = subprocess.Popen(serve)
try:
    while True:  # start-up compiles (or, later, loads) every step shape first
        try:
            if httpx.get(f"{URL}/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.5)

    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="sk-local")
    print("models:", [m.id for m in client.models.list().data])

    prompt = "The capital of France is"
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                           temperature=0)
    print("completion:", repr(completion.choices[0].text),
          completion.usage.completion_tokens, "tokens")

    question = {"role": "user", "content": "What is the capital of France?"}
    stream = client.chat.completions.create(model=MODEL, messages=[question],
                                            max_tokens=16, temperature=0, stream=True)
    chunks = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    print("chat, streamed:", "|".join(chunks))

    beams = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=3,
                                      extra_body={"use_beam_search": True})
    print("beams:", [choice.text for choice in beams.choices])

    try:
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
        raise AssertionError("a negative temperature was accepted")
    except openai.BadRequestError as error:
        print("bad request:", error.status_code, error.body["message"])
finally:
    server.terminate()  # SIGTERM: in-flight requests finish, then the server exits
    server.wait()

assert "Paris" in completion.choices[0].text and "Paris" in "".join(chunks)
assert len({choice.text for choice in beams.choices}) == 3
