"""Multi-LoRA serving: many adapters of one base model in one batch (see docs/lora.md)."""
