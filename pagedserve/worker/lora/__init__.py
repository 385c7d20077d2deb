"""LoRA adapters in the worker: a grouped delta per linear layer (layers.py), adapter weights
read for this model and rank (weights.py), the bounded pools and a step's slots (manager.py)."""
