"""Linear layers: the matmul every projection and the LM head run (matmul.py), and the weight formats it reads
(quantization.py; GGUF's blocks: gguf_format.py, gguf_blocks.py).

Import the modules themselves: the loader reads gguf_format.py's NumPy block layout without importing JAX.
"""
