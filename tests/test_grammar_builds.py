"""The engine core's grammar builds (jax_engine/engine_core/grammar_builds.py): a build pending when an API server's
tokenizer arrives (its "tokenizer" message: GrammarBuilds.prepare) still joins, in order, after the preparation."""

import threading
import time

from jax_engine.engine_core.grammar_builds import GrammarBuilds
from jax_engine.engine_core.messages import AddRequest


def test_a_build_pending_when_the_tokenizer_comes_is_kept_and_runs_after_it():
    order, release = [], threading.Event()

    def build(text):
        release.wait(10)
        order.append(text)
        return text

    builds = GrammarBuilds(build, lambda: order.append("prepared"))
    builds.submit(0, AddRequest("a", {"prompt_token_ids": [1]}, None, grammar_text="g-a"))
    builds.prepare()  # a second API server's tokenizer, while "a" builds
    builds.submit(1, AddRequest("b", {"prompt_token_ids": [1]}, None, grammar_text="g-b"))
    release.set()
    deadline, finished = time.monotonic() + 10, []
    while len(finished) < 2 and time.monotonic() < deadline:
        finished += builds.ready()
        time.sleep(0.01)
    assert [(server, request.request_id, build.result(), aborted) for server, request, build, aborted in finished] == [
        (0, "a", "g-a", False), (1, "b", "g-b", False)]
    assert order == ["prepared", "g-a", "prepared", "g-b"] and len(builds) == 0
