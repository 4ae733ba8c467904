"""Data-parallel replicas as `jax-engine serve` builds them: every step shape compiled (or loaded) at start-up,
in a process of their own. A stored program keyed without its device once made replica 1 load replica 0's
programs and run every step on replica 0's device.

Its own module, so its own process (tests/test_multi_device.py): in a process that had first loaded the same
program for device 0 from JAX's disk cache, compiling it for device 1 failed in XLA's CPU runtime
("Function ... not found"); serve builds its replicas in a fresh process, as here.
"""

import jax

from jax_engine import LLM, EngineArgs, SamplingParams
from jax_engine.server.data_parallel import DataParallelEngine
from tests.multi_device.test_data_parallel import ENGINE_ARGS, MAX_TOKENS, PROMPTS, devices_of


def test_replicas_compiled_at_start_up_step_on_their_own_devices(default_checkpoint, tmp_path):
    args = EngineArgs(data_parallel_size=2, **{**ENGINE_ARGS, "enforce_eager": False},
                      compilation_cache_dir=str(tmp_path))
    engine = DataParallelEngine.from_engine_args(args, checkpoint=default_checkpoint)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = [[o.outputs[0].text for o in LLM.from_engine(replica.engine).generate(PROMPTS[:2], params, use_tqdm=False)]
             for replica in engine.replicas]
    assert texts[0] == texts[1] and all(texts[0])
    assert [devices_of(replica) for replica in engine.replicas] == [{jax.devices()[0]}, {jax.devices()[1]}]
