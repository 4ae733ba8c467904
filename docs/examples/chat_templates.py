"""Chat with a template you give, and have the model finish a message you started."""

from jax_engine import LLM, SamplingParams

llm = LLM(max_model_len=512, enforce_eager=True)  # a few requests: compile on first use
greedy = SamplingParams(temperature=0, max_tokens=8)
question = [{"role": "user", "content": "What is the capital of France?"}]

# chat_template: your own template instead of the model's (a base model may have none).
plain = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"
[answer] = llm.chat(question, greedy, use_tqdm=False, chat_template=plain)
print(repr(answer.prompt), "->", repr(answer.outputs[0].text))

# continue_final_message: the model goes on writing the last message.
started = [*question, {"role": "assistant", "content": "The capital of France is"}]
[continued] = llm.chat(started, greedy, use_tqdm=False, add_generation_prompt=False,
                       continue_final_message=True)
print(repr(continued.prompt[-40:]), "->", repr(continued.outputs[0].text))
assert not continued.prompt.endswith("<|im_end|>\n")

# Content as OpenAI's list of text parts: SmolLM2's template prints a message's
# content, so "auto" (chat_template_content_format) gives it the parts' texts
# joined with newlines; a template that loops over the parts would get the list.
parts = [{"type": "text", "text": "Name the capital"},
         {"type": "text", "text": "of France."}]
[joined] = llm.chat([{"role": "user", "content": parts}], greedy, use_tqdm=False)
user_turn = joined.prompt.split("user\n")[-1].split("<|im_end|>")[0]
print(repr(user_turn), "->", repr(joined.outputs[0].text))
