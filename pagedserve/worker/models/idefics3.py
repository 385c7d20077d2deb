"""Idefics3 and SmolVLM (Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration): our text model
for text_config's architecture (Llama: LlamaForCausalLM), with a SigLIP vision tower and the connector
(pixel shuffle, projection) beside it (worker/vision/siglip.py). The two architectures are one model in
transformers 5 (the same modules, names and numerics); only their processors differ, in the front end.

As LLaVA's (models/llava.py), the model *is* its text model (a subclass made per text class), so graphs,
LoRA and profiling see the text model unchanged; `encode_images` turns ImageInputs (each one tile: the
processor's split tiles and global view each arrive as their own ImageInput of image_size x image_size
pixels, over num_image_tokens placeholders) into embedding rows, which the model runner scatters over the
placeholders (worker/image_rows.py).

Weights: transformers 5's names, which are also the hub's (`model.text_model.*`, `model.vision_model.*`,
`model.connector.modality_projection.proj.weight`, `lm_head.weight`). The text model is sharded across
tensor-parallel ranks as usual; the tower and connector are whole on every rank and stay float.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.vision.clip import normalized_pixels
from pagedserve.worker.vision.siglip import Connector, SiglipVisionTower

# checkpoint prefix -> ours; the first that matches applies
RENAMES = (("model.text_model.", "model."), ("model.vision_model.", "vision_model."),
           ("model.connector.", "connector."))


class Idefics3Mixin:
    """Put ahead of a text model class: builds it from the text half of the config, adds the vision parts."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        vision = cfg.vision
        super().__init__(dataclasses.replace(cfg, architecture=vision["text_architecture"], vision=None),
                         backend, max_positions)
        self.vision = vision
        self.vision_model = SiglipVisionTower(vision)
        self.connector = Connector(vision, cfg.hidden_size)
        self.requires_grad_(False)

    def encode_images(self, images) -> list[torch.Tensor]:
        """ImageInputs (tiles) -> each one's embedding rows [its length, hidden], in the model's dtype (one
        batch through the tower)."""
        want = self.vision["num_image_tokens"]
        for image in images:
            if image.length != want:
                raise ValueError(f"an image over {image.length} placeholder tokens: this model encodes each "
                                 f"tile into {want} rows")
        pixels = normalized_pixels(images, self.vision, self.embed_tokens.weight.device)
        rows = self.connector(self.vision_model(pixels))
        return list(rows.to(self.embed_tokens.weight.dtype).unbind(0))

    def map_name(self, name: str) -> tuple[str, object] | None:
        for old, new in RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if name.startswith("vision_model."):
            return self.vision_model.map_name(name)
        if name.startswith("connector."):
            return name, 0
        return super().map_name(name)


@functools.cache
def _with_vision(text_class: type) -> type:
    return type(f"Idefics3{text_class.__name__}", (Idefics3Mixin, text_class), {})


def Idefics3ForConditionalGeneration(cfg: ModelConfig, backend: AttentionBackend,  # noqa: N802
                                     max_positions: int):
    """The model for an Idefics3 or SmolVLM config (models.model_class's entry: called like a class)."""
    from pagedserve.worker.models import model_class
    return _with_vision(model_class(cfg.vision["text_architecture"]))(cfg, backend, max_positions)
