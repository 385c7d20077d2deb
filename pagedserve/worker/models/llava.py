"""LLaVA (LlavaForConditionalGeneration, llava-1.5 style): our text model for text_config's architecture
(Llama, Mistral, Qwen2: LlamaForCausalLM), with a CLIP vision tower and the projector beside it
(worker/vision/clip.py).

The model *is* its text model (a subclass made per text class), so everything that reads a model's
layers, embeddings, rotary tables or LM head (graphs, LoRA, profiling) sees the text model unchanged;
`encode_images` adds the images' embedding rows, which the model runner scatters over the placeholder
tokens' embeddings (worker/image_rows.py) and passes as `inputs_embeds` to the text model's forward.

Weights: transformers 5's names (`model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`, `lm_head.*`) and the hub's older llava-hf names (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`) both load. The text model is
sharded across tensor-parallel ranks as usual; the tower and projector are whole on every rank.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.vision.clip import CLIPVisionTower, Projector, normalized_pixels

# checkpoint prefix -> ours; the first that matches applies
RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
           ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
           ("model.multi_modal_projector.", "multi_modal_projector."))


class LlavaMixin:
    """Put ahead of a text model class: builds it from the text half of the config, adds the vision parts."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        vision = cfg.vision
        super().__init__(dataclasses.replace(cfg, architecture=vision["text_architecture"], vision=None),
                         backend, max_positions)
        self.vision = vision
        self.vision_tower = CLIPVisionTower(vision)
        self.multi_modal_projector = Projector(vision, cfg.hidden_size)
        self.requires_grad_(False)

    def encode_images(self, images) -> list[torch.Tensor]:
        """ImageInputs -> each one's embedding rows [its length, hidden], in the model's dtype (one batch
        through the tower)."""
        want = self.vision["num_image_tokens"]
        for image in images:
            if image.length != want:
                raise ValueError(f"an image over {image.length} placeholder tokens: this model encodes each "
                                 f"image into {want} rows")
        pixels = normalized_pixels(images, self.vision, self.embed_tokens.weight.device)
        rows = self.multi_modal_projector(self.vision_tower(pixels))
        return list(rows.to(self.embed_tokens.weight.dtype).unbind(0))

    def map_name(self, name: str) -> tuple[str, object] | None:
        for old, new in RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if name.startswith("vision_tower."):
            return self.vision_tower.map_name(name)
        if name.startswith("multi_modal_projector."):
            return name, 0
        return super().map_name(name)


@functools.cache
def _with_vision(text_class: type) -> type:
    return type(f"Llava{text_class.__name__}", (LlavaMixin, text_class), {})


def LlavaForConditionalGeneration(cfg: ModelConfig, backend: AttentionBackend, max_positions: int):  # noqa: N802
    """The model for a LLaVA config (models.model_class's entry: called like a class)."""
    from pagedserve.worker.models import model_class
    return _with_vision(model_class(cfg.vision["text_architecture"]))(cfg, backend, max_positions)
