"""Vision encoders of vision-language models (clip.py: CLIP's vision tower, LLaVA's projector and the
image normalization; siglip.py: Idefics3 / SmolVLM's SigLIP tower and pixel-shuffle connector; qwen2_vl.py:
Qwen2-VL's and Qwen2.5-VL's dynamic-resolution towers, their patch mergers included), run by the models that
take images (worker/models/llava.py, worker/models/idefics3.py, worker/models/qwen2_vl.py)."""
