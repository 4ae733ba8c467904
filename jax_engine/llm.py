"""LLM: offline batched generation, vLLM's front door. A thin loop over LLMEngine."""

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from jax_engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jax_engine.config import EngineArgs
from jax_engine.chat_content import resolve_content_format, template_messages, template_text
from jax_engine.chat_template import chat_prompt, check_has_template
from jax_engine.llm_engine import LLMEngine, Prompt
from jax_engine.lora.request import LoRARequest
from jax_engine.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from jax_engine.pooling_params import PoolingParams
from jax_engine.sampling_params import SamplingParams

Conversation = list[dict[str, str]]


def _as_prompt_list(prompts) -> list:
    """One prompt (a string, a dict, or a list of token ids) becomes a list of one."""
    single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
    return [prompts] if single else list(prompts)


def _per_prompt(value, count: int, name: str) -> list:
    """One value for every prompt, or a list of one per prompt (a ValueError if the count differs)."""
    values = value if isinstance(value, Sequence) else [value] * count
    if len(values) != count:
        raise ValueError(f"got {len(values)} {name} for {count} prompts")
    return list(values)


class LLM:
    """Generate text for many prompts at once, with continuous batching over a paged KV cache.

    Args:
        model: a .gguf file or HF checkpoint directory; None loads SmolLM2-135M-Instruct.
        **kwargs: any EngineArgs field (dtype, block_size, max_model_len, max_num_seqs, ...).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise ValueError(f"unknown engine arguments: {sorted(unknown)}")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an existing engine (for example one built from an already loaded checkpoint)."""
        llm = cls.__new__(cls)
        llm.llm_engine, llm._counter = engine, itertools.count()
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams generate() uses when given none: vLLM's defaults, or the model's generation
        config's (EngineArgs.generation_config)."""
        return self.llm_engine.get_default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's name): a workload run again then computes its prompts
        again, as the first time. False, and nothing forgotten, while a request holds blocks."""
        return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Complete every prompt; returns one RequestOutput per prompt, in input order.

        Args:
            prompts: a string, a list of strings, a list of token ids, or a list of token-id lists.
            sampling_params: one SamplingParams for all prompts, or one per prompt; None uses
                get_default_sampling_params().
            use_tqdm: show a progress bar with estimated input and output tokens per second.
            lora_request: the LoRA adapter of all prompts, or one per prompt (None: the base model); the
                engine needs enable_lora=True.
            priority: one per prompt, lowest served first, with scheduling_policy="priority" (vLLM's); None: 0.
        """
        sampling_params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        return self._add_and_run(prompts, sampling_params, "sampling_params", use_tqdm, lora_request, priority)

    def encode(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | Sequence[PoolingParams] | None
               = None, use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
               ) -> list[PoolingRequestOutput]:
        """Each prompt's vector (vLLM's LLM.encode) from an engine started with task="embed", in input order: the
        pooled hidden states of its tokens (EngineArgs.pooler_config). Arguments as generate's."""
        pooling_params = PoolingParams() if pooling_params is None else pooling_params
        return self._add_and_run(prompts, pooling_params, "pooling_params", use_tqdm, lora_request)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | Sequence[PoolingParams] | None
              = None, use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """encode's vectors as lists of floats (vLLM's LLM.embed): `outputs[i].outputs.embedding`."""
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(prompts, pooling_params, use_tqdm,
                                                                         lora_request)]

    def _add_and_run(self, prompts, params, name: str, use_tqdm: bool, lora_request, priority=None) -> list:
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(params, len(prompts), name)
        adapters = _per_prompt(lora_request, len(prompts), "lora_request")
        priorities = _per_prompt(0 if priority is None else priority, len(prompts), "priority")
        ids = [str(next(self._counter)) for _ in prompts]
        try:
            for request_id, prompt, p, adapter, rank in zip(ids, prompts, params, adapters, priorities):
                self.llm_engine.add_request(request_id, prompt, p, lora_request=adapter, priority=rank)
        except ValueError:
            self.llm_engine.abort_request(ids)  # a bad prompt must not leave the others queued
            self.llm_engine.step()  # hands back (and so drops) the aborted requests' final outputs
            raise
        return self._run_engine(ids, use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False, lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's LLM.beam_search): the best beams, best first.

        Beams of one prompt share KV blocks (forked, copy-on-write); pruned beams free theirs.
        """
        prompts = _as_prompt_list(prompts)
        outputs = self.generate(prompts, [params] * len(prompts), use_tqdm=use_tqdm, lora_request=lora_request)
        return [BeamSearchOutput([BeamSearchSequence(o.prompt_token_ids + c.token_ids, c.cumulative_logprob, c.text,
                                                     c.finish_reason) for c in o.outputs]) for o in outputs]

    def chat(self, messages: Conversation | Sequence[Conversation], sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, lora_request: LoRARequest | None = None,
             chat_template_kwargs: dict | None = None, *, chat_template: str | None = None,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate, as vLLM's LLM.chat.

        `chat_template`: a template's text, instead of the model's own (which a base model may lack).
        `chat_template_kwargs`: extra variables for the template (Qwen3's enable_thinking=False, say).
        `continue_final_message`: the model goes on writing the last message (with add_generation_prompt=False).
        `tools`: function definitions for templates that render them.
        `chat_template_content_format`: how each message's content (a string, or a list of text parts) reaches
        the template: "string", "openai" or "auto" (jax_engine/chat_content.py).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs the model's chat template and tokenizer, which skip_tokenizer_init=True "
                             "does not load: give token ids to generate instead")
        check_has_template(tokenizer, chat_template)
        content_format = resolve_content_format(chat_template_content_format,
                                                template_text(tokenizer, chat_template, tools))
        prompts = [chat_prompt(tokenizer, template_messages(c, content_format), add_generation_prompt, tools=tools,
                               chat_template_kwargs=chat_template_kwargs, chat_template=chat_template,
                               continue_final_message=continue_final_message)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput | PoolingRequestOutput]:
        engine, finished = self.llm_engine, {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        input_tokens = output_tokens = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if not output.finished:
                    continue
                finished[output.request_id] = output
                completions = output.outputs if isinstance(output, RequestOutput) else []  # none when pooled
                input_tokens += len(output.prompt_token_ids) * max(len(completions), 1)
                output_tokens += sum(len(c.token_ids) for c in completions)
                elapsed = bar.format_dict["elapsed"] or 1e-9
                bar.set_postfix_str(f"est. speed input: {input_tokens / elapsed:.2f} toks/s, "
                                    f"output: {output_tokens / elapsed:.2f} toks/s", refresh=False)
                bar.update(1)
        bar.close()
        return [finished[i] for i in ids]
