"""What this project does with tensor_parallel_size today: it refuses it."""

from jax_engine import LLM

try:
    LLM(tensor_parallel_size=2)  # vLLM's argument; checked before any model is loaded
except ValueError as error:
    print("ValueError:", error)
else:
    raise AssertionError("tensor_parallel_size was accepted")
