"""The engine shares memory: a prefix-cache hit, parallel samples, beam search."""

from jax_engine import LLM, BeamSearchParams, SamplingParams

llm = LLM(num_gpu_blocks_override=64, max_model_len=256, max_num_seqs=8, block_size=16,
          enforce_eager=True)  # a few short requests: compile on first use
engine = llm.llm_engine
trace = engine.enable_trace()

system = ("You are a terse assistant. Answer in one short sentence, "
          "without any preamble at all. ")
greedy = SamplingParams(temperature=0, max_tokens=8)
for question in ["What is the capital of France?", "What is the capital of Italy?"]:
    [out] = llm.generate(system + question, greedy, use_tqdm=False)
    reused = out.num_cached_tokens
    print(f"{question!r}: {reused} prompt tokens reused from the prefix cache")

samples = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=6)
llm.generate("The sea is", samples, use_tqdm=False)
copies = sum(len(step.copies) for step in trace)
print(f"3 samples, prompt computed once, {copies} copy-on-write block copies so far")

[beams] = llm.beam_search("The sea is", BeamSearchParams(beam_width=3, max_tokens=6))
print(f"best beam: {beams.sequences[0].text!r}")

stats = engine.stats()
hits, queries = stats["prefix_cache_hits"], stats["prefix_cache_queries"]
print(f"prefix cache: {hits} of {queries} looked-up tokens hit; "
      f"{stats['num_free_blocks']} of {stats['num_blocks']} blocks free again")
misses = [reason for step in trace for _, reason in step.cache_misses]
print("cache misses:", misses[:2])
