"""Vision encoders of vision-language models (clip.py: CLIP's vision tower, LLaVA's projector and the
image normalization; siglip.py: Idefics3 / SmolVLM's SigLIP tower and pixel-shuffle connector), run by the
models that take images (worker/models/llava.py, worker/models/idefics3.py)."""
