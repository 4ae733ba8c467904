"""llama.cpp as bench latency's peer, through llama-cpp-python on the same GGUF file.

LlamaCpp decodes B sequences together in one llama_batch through the C API, greedy, as the engine's batches run.
The binding drafts only in its one-sequence `Llama` API (`draft_model=LlamaPromptLookupDecoding(...)`, prompt
lookup), so `time_prompt_lookup` times that API at batch 1, plain and drafting, beside the engine's n-gram drafts.
"""

import os
import time

import numpy as np


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: B sequences decoded together in one llama_batch."""

    def __init__(self, gguf_path: str, max_batch: int, max_len: int) -> None:
        import llama_cpp as ll
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp logs every tensor it loads otherwise
        self.ll = ll
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(gguf_path.encode(), ll.llama_model_default_params())
        params = ll.llama_context_default_params()
        params.n_ctx = max_batch * -(-max_len // 256) * 256  # split evenly between the sequences
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = max_batch
        params.n_threads = params.n_threads_batch = os.cpu_count() or 1
        self.ctx = ll.llama_init_from_model(self.model, params)
        self.vocab_size = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.batch = ll.llama_batch_init(512, 0, 1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Run (token, position, sequence, wants logits) entries in chunks; the argmax of each wanted row."""
        ll, chosen = self.ll, []
        for first in range(0, len(entries), 512):
            chunk = entries[first : first + 512]
            self.batch.n_tokens = len(chunk)
            for i, (token, pos, seq, logits) in enumerate(chunk):
                self.batch.token[i], self.batch.pos[i], self.batch.n_seq_id[i] = token, pos, 1
                self.batch.seq_id[i][0], self.batch.logits[i] = seq, logits
            if ll.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, _, logits) in enumerate(chunk):
                if logits:
                    row = np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, i), shape=(self.vocab_size,))
                    chosen.append(int(row.argmax()))
        return chosen

    def time(self, batch: list[list[int]], output_len: int, stop_at_eos: bool = False) -> tuple[float, float]:
        ll = self.ll
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
        started = time.perf_counter()
        tokens = self._decode([(t, pos, seq, pos == len(ids) - 1) for seq, ids in enumerate(batch)
                               for pos, t in enumerate(ids)])
        ttft = time.perf_counter() - started
        eos = ll.llama_vocab_eos(ll.llama_model_get_vocab(self.model)) if stop_at_eos else None
        live, produced = {seq: t for seq, t in enumerate(tokens) if t != eos}, 0  # sequence: its last token
        started = time.perf_counter()
        for step in range(output_len - 1):
            if not live:
                break
            chosen = self._decode([(t, len(batch[seq]) + step, seq, True) for seq, t in live.items()])
            produced += len(chosen)
            live = {seq: t for seq, t in zip(live, chosen) if t != eos}
        return ttft, produced / (time.perf_counter() - started)


def time_prompt_lookup(gguf_path: str, prompt: list[int], output_len: int, max_len: int,
                       drafts: tuple[int, int] | None) -> tuple[float, float, list[int]]:
    """(TTFT s, decode tokens/s, tokens) of one greedy request through llama-cpp-python's `Llama` API, stopping at
    EOS; `drafts` (k, longest n-gram) turns on its prompt-lookup drafter, None decodes plainly."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = None if drafts is None else LlamaPromptLookupDecoding(max_ngram_size=drafts[1], num_pred_tokens=drafts[0])
    threads = os.cpu_count() or 1
    llm = Llama(gguf_path, n_ctx=max_len, n_threads=threads, n_threads_batch=threads, verbose=False,
                draft_model=draft)
    list(zip(range(2), llm.generate(prompt[::-1], top_k=1, temp=0.0)))  # warm-up on another prompt
    llm.reset()  # so the timed prompt is computed, not found in the context
    started, first, tokens = time.perf_counter(), None, []
    for token in llm.generate(prompt, top_k=1, temp=0.0):
        first = first or time.perf_counter()
        if token == llm.token_eos() or len(tokens) == output_len:
            break
        tokens.append(token)
    return first - started, (len(tokens) - 1) / max(time.perf_counter() - first, 1e-9), tokens
