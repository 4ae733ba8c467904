"""POST /v1/embeddings: OpenAI's embeddings, from a server started with --task embed (vLLM's pooling runner).

Each input is one engine request whose prompt is pooled into a vector (jax_engine/pooler.py); the inputs of a
request are queued together, as a completion's prompts are, and bounded the same way: at most
max_waiting_requests of them and max_request_tokens tokens in all. A server started for text answers with a 400
naming --task.
"""

import base64
import time

import numpy as np

from jax_engine.server.completions import prompt_list
from jax_engine.server.errors import bad_request
from jax_engine.server.protocol import EmbeddingRequest
from jax_engine.server.state import ServerState
from jax_engine.server.streams import add_streams, answer_id, collect


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: a list of floats, or base64 of its little-endian float32 bytes (what the
    official client asks for by default, and decodes with NumPy)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


class Embeddings:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: EmbeddingRequest, cache_salt: str | None = None, tenant: str | None = None,
                     header_id: str | None = None) -> dict:
        state = self.state
        state.check_fields(body)
        state.check_model(body.model)
        try:
            params = body.pooling_params()
        except ValueError as error:
            raise bad_request(error) from None
        inputs = prompt_list(body.input, "input")
        if any(isinstance(i, str) for i in inputs):
            state.require_tokenizer("input", "text")
        request_id = answer_id("embd", header_id, body.request_id)
        streams = await add_streams(state, request_id, inputs, params, cache_salt, tenant, body.model, "input",
                                    body.priority)
        finals = await collect(streams)
        data = [{"object": "embedding", "index": i, "embedding": encoded(o.outputs.data, body.encoding_format)}
                for i, o in enumerate(finals)]
        tokens = sum(len(o.prompt_token_ids) for o in finals)
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": state.served_name(body.model),
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
