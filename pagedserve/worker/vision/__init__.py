"""Vision encoders of vision-language models (clip.py: CLIP's vision tower, LLaVA's projector and the
image normalization), run by the models that take images (worker/models/llava.py)."""
