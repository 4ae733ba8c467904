"""Constrain what the model writes: a JSON schema, a choice, a regex, a grammar."""

import json

from jax_engine import LLM, SamplingParams
from jax_engine.structured_output import StructuredOutputsParams

llm = LLM(max_model_len=1024)


def answer(question: str, constraint: StructuredOutputsParams, **sampling) -> str:
    prompt = [{"role": "user", "content": question}]
    params = SamplingParams(max_tokens=120, structured_outputs=constraint, **sampling)
    return llm.chat(prompt, params, use_tqdm=False)[0].outputs[0].text


city = {"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "country": {"type": "string", "maxLength": 20},
                       "population_millions": {"type": "number"},
                       "sights": {"type": "array", "items": {"type": "string",
                                                             "maxLength": 20},
                                  "maxItems": 3}},
        "required": ["name", "country", "population_millions", "sights"],
        "additionalProperties": False}
compact = StructuredOutputsParams(json=city, disable_any_whitespace=True)
text = answer("Describe Paris.", compact, temperature=0)
print(text)
print(json.loads(text)["country"])

print(answer("Is Paris in France?", StructuredOutputsParams(choice=["yes", "no"]),
             temperature=0))
print(answer("When was the Eiffel Tower built?",
             StructuredOutputsParams(regex=r"In (1[0-9]{3})\."), temperature=0))
arithmetic = """
start: expr " = " NUMBER
expr: NUMBER (" " OP " " NUMBER)+
OP: "+" | "-" | "*"
NUMBER: /[0-9]{1,3}/
"""
sums = StructuredOutputsParams(grammar=arithmetic)
print(answer("Write a sum.", sums, temperature=0))
# Sampled at temperature 1: the words change with the seed (and with the CPU's rounding,
# so they are not shown), the shape does not.
for seed in range(3):
    sample = answer("Describe a city.", StructuredOutputsParams(json=city), seed=seed)
    place = json.loads(sample)
    print(sorted(place), len(place["sights"]) <= 3)
