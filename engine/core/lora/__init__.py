"""LoRA adapters in the scheduler core: which adapter each lane of a job runs under, within the chip's slots."""
