"""The model runner and its device programs (vLLM v1's worker/gpu_model_runner and what it compiles): the runner
lays out and runs each step (model_runner.py); each device program is declared once (device_programs.py),
compiled or loaded before the first request (compile_shapes.py, executable_store.py) and held by a
bounded cache (program_cache.py). Before any of that, start-up checks the Pallas attention kernels against the
xla path on a step laid out as the runner lays one out (attention_self_test.py)."""
