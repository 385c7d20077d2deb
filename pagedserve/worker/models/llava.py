"""LLaVA (LlavaForConditionalGeneration, llava-1.5 style): our text model for text_config's architecture
(Llama, Mistral, Qwen2: LlamaForCausalLM), with a CLIP vision tower and the projector beside it
(worker/vision/clip.py).

The model is its text model with the tower and projector beside it (models/vision_language.py):
`encode_images` gives the images' embedding rows, which the model runner scatters over the placeholder
tokens' embeddings (worker/image_rows.py) and passes as `inputs_embeds` to the text model's forward.

Weights: transformers 5's names (`model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`, `lm_head.*`) and the hub's older llava-hf names (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`) both load. The text model is
sharded across tensor-parallel ranks as usual; the tower and projector are whole on every rank.
"""

from __future__ import annotations

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.models.vision_language import LLAVA_RENAMES, VisionLanguage, build
from pagedserve.worker.vision.clip import CLIPVisionTower, Projector


class Llava(VisionLanguage):
    TOWER, PROJECTOR = "vision_tower", "multi_modal_projector"
    RENAMES = LLAVA_RENAMES

    @staticmethod
    def parts(vision: dict, text_hidden: int):
        return CLIPVisionTower(vision), Projector(vision, text_hidden)


def LlavaForConditionalGeneration(cfg: ModelConfig, backend: AttentionBackend, max_positions: int):  # noqa: N802
    """The model for a LLaVA config (models.model_class's entry: called like a class); over a Pixtral tower,
    models/mistral3.py's."""
    if cfg.vision.get("family") == "pixtral":
        from pagedserve.worker.models.mistral3 import Mistral3ForConditionalGeneration
        return Mistral3ForConditionalGeneration(cfg, backend, max_positions)
    return build(Llava, cfg, backend, max_positions)
