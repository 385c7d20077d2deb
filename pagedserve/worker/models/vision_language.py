"""What every vision-language model here shares (models/llava.py, models/idefics3.py): the model *is* its
text model (a subclass made per text class, VisionLanguage ahead of it), so everything that reads a
model's layers, embeddings, rotary tables or LM head (graphs, LoRA, profiling) sees the text model
unchanged; beside it a vision tower and a projector, whole and float on every rank, and `encode_images`,
which turns ImageInputs (each an image, or one tile of one, of the tower's size over num_image_tokens
placeholders) into embedding rows that the model runner scatters over the placeholders
(worker/image_rows.py).

Qwen2-VL (models/qwen2_vl.py) has no projector apart from its tower (PROJECTOR "": the merger is the
tower's) and overrides encode_images: its images have rows of their own number each. Pixtral / Mistral 3
(models/mistral3.py) overrides it too: an image's rows cover its whole span, the break and end tokens' rows
their text embeddings.

A family names its parts' attributes (the checkpoint's names after RENAMES), makes them (parts) and maps
its checkpoint's prefixes; load time builds it, the step thread encodes.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.vision.clip import normalized_pixels


# LLaVA's checkpoint prefixes (the hub's transformers-4 names and transformers 5's) -> ours; Mistral 3 shares them
LLAVA_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
                 ("model.multi_modal_projector.", "multi_modal_projector."))


class VisionLanguage:
    """Put ahead of a text model class (with_vision): builds it from the text half of the config, adds
    the family's tower and projector."""
    TOWER = PROJECTOR = ""  # the attributes (and checkpoint prefixes, after RENAMES) of the two parts
    RENAMES: tuple[tuple[str, str], ...] = ()  # checkpoint prefix -> ours; the first that matches applies

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        vision = cfg.vision
        super().__init__(dataclasses.replace(cfg, architecture=vision["text_architecture"], vision=None),
                         backend, max_positions)
        self.vision = vision
        tower, projector = self.parts(vision, cfg.hidden_size)
        setattr(self, self.TOWER, tower)
        if self.PROJECTOR:  # (Qwen2-VL's merger is the tower's own)
            setattr(self, self.PROJECTOR, projector)
        self.requires_grad_(False)

    @staticmethod
    def parts(vision: dict, text_hidden: int) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        raise NotImplementedError

    def encode_images(self, images) -> list[torch.Tensor]:
        """ImageInputs -> each one's embedding rows [its length, hidden], in the model's dtype (one batch
        through the tower)."""
        want = self.vision["num_image_tokens"]
        for image in images:
            if image.length != want:
                raise ValueError(f"an image over {image.length} placeholder tokens: this model encodes each "
                                 f"image into {want} rows")
        pixels = normalized_pixels(images, self.vision, self.embed_tokens.weight.device)
        rows = getattr(self, self.PROJECTOR)(getattr(self, self.TOWER)(pixels))
        return list(rows.to(self.embed_tokens.weight.dtype).unbind(0))

    def map_name(self, name: str) -> tuple[str, object] | None:
        for old, new in self.RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if name.startswith(self.TOWER + "."):
            return getattr(self, self.TOWER).map_name(name)
        if self.PROJECTOR and name.startswith(self.PROJECTOR + "."):
            return name, 0
        return super().map_name(name)


@functools.cache
def with_vision(family: type, text_class: type) -> type:
    return type(f"{family.__name__}{text_class.__name__}", (family, text_class), {})


def build(family: type, cfg: ModelConfig, backend: AttentionBackend, max_positions: int):
    """The model for a vision-language config (models.model_class's entries call this)."""
    from pagedserve.worker.models import model_class
    return with_vision(family, model_class(cfg.vision["text_architecture"]))(cfg, backend, max_positions)
