"""JSON output and tool calls through `jax-engine serve`, with the openai client."""

import json
import subprocess
import sys
import time

import httpx
import openai

URL = "http://127.0.0.1:8766"
MODEL = "SmolLM2-135M-Instruct"
serve = [sys.executable, "-m", "jax_engine", "serve", "--port", "8766",
         "--max-model-len", "1024", "--log-level", "warning"]
server = subprocess.Popen(serve)
weather = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
question = [{"role": "user", "content": "What is the weather like in Paris?"}]
try:
    while True:
        try:
            if httpx.get(f"{URL}/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.5)
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="none")

    reply = client.chat.completions.create(
        model=MODEL, messages=question, temperature=0, max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {
            "name": "weather", "schema": weather["function"]["parameters"]}})
    print("json_schema:", reply.choices[0].message.content)

    reply = client.chat.completions.create(
        model=MODEL, messages=question, temperature=0, max_tokens=100,
        tools=[weather], tool_choice="required")
    call = reply.choices[0].message.tool_calls[0]
    print("tool call:", call.function.name, call.function.arguments,
          reply.choices[0].finish_reason)

    # Run the tool, send its result back, and let the model answer in words.
    arguments = json.loads(call.function.arguments)
    result = f"18 degrees {arguments['unit']}, sunny"
    messages = [*question, reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": result}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=12,
        tools=[weather], tool_choice="none")
    print("answer:", reply.choices[0].message.content)

    try:
        client.chat.completions.create(
            model=MODEL, messages=question, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {
                "name": "broken", "schema": {"type": "nonsense"}}})
    except openai.BadRequestError as error:
        print("bad request:", error.body["param"])
finally:
    server.terminate()
    server.wait()
