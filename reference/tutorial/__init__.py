"""Tutorial support: code the tutorial runs that is not part of the serving loop.

`kv_memory` counts how much of a KV cache a request trace uses, contiguous against paged, for the
fragmentation figures of part 2; it is built on the oracle's scheduler but nothing in reference/ uses it.
`tiny_llama` is the random two-layer model the engine-loop and memory-bound examples run.
"""
