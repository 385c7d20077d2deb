"""Idefics3 and SmolVLM (Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration): our text model
for text_config's architecture (Llama: LlamaForCausalLM), with a SigLIP vision tower and the connector
(pixel shuffle, projection) beside it (worker/vision/siglip.py). The two architectures are one model in
transformers 5 (the same modules, names and numerics); only their processors differ, in the front end.

The model is its text model with the tower and connector beside it (models/vision_language.py, as
LLaVA's); each ImageInput is one tile: the processor's split tiles and global view each arrive as their
own ImageInput of image_size x image_size pixels, over num_image_tokens placeholders.

Weights: transformers 5's names, which are also the hub's (`model.text_model.*`, `model.vision_model.*`,
`model.connector.modality_projection.proj.weight`, `lm_head.weight`). The text model is sharded across
tensor-parallel ranks as usual; the tower and connector are whole on every rank and stay float.
"""

from __future__ import annotations

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.models.vision_language import VisionLanguage, build
from pagedserve.worker.vision.siglip import Connector, SiglipVisionTower


class Idefics3(VisionLanguage):
    TOWER, PROJECTOR = "vision_model", "connector"
    RENAMES = (("model.text_model.", "model."), ("model.vision_model.", "vision_model."),
               ("model.connector.", "connector."))

    @staticmethod
    def parts(vision: dict, text_hidden: int):
        return SiglipVisionTower(vision), Connector(vision, text_hidden)


def Idefics3ForConditionalGeneration(cfg: ModelConfig, backend: AttentionBackend,  # noqa: N802
                                     max_positions: int):
    """The model for an Idefics3 or SmolVLM config (models.model_class's entry: called like a class)."""
    return build(Idefics3, cfg, backend, max_positions)
