"""The engine in a process of its own (vLLM v1's engine core), driven over ZMQ by the API server's process."""
