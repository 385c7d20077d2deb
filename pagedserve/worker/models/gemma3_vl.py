"""Gemma 3 with images (Gemma3ForConditionalGeneration: gemma-3-4b/12b/27b-it): our Gemma3ForCausalLM text model,
with a SigLIP vision tower (worker/vision/siglip.py, position ids 0..N-1) and Gemma3MultiModalProjector beside
it (models/vision_language.py, as LLaVA's and Idefics3's).

Numerics follow transformers' Gemma3Model:
- the projector: the tower's last_hidden_state [images, side^2, hidden] as a side x side grid, average-pooled
  (kernel = stride = side / sqrt(mm_tokens_per_image)) to mm_tokens_per_image rows, row-major; the
  soft-embedding RMSNorm (Gemma's zero-centred (1 + w), in float32, then cast); a plain matmul by
  mm_input_projection_weight [vision hidden, text hidden]; cast back to the tower's dtype;
- image rows replace the *scaled* token embeddings: the text model's sqrt(hidden_size) applies to text
  tokens only (the placeholders' rows are the projector's, unscaled);
- an image's placeholders attend to each other both ways (token_type_ids' blocks); text stays causal and
  sliding layers keep their window. The model runner hands such steps AttentionMetadata.key_limits
  (worker/image_rows.key_limits); the scheduler never splits an image across steps (image_chunks.py).

Weights: transformers 5's names (`model.language_model.*`, `model.vision_tower[.vision_model].*`,
`model.multi_modal_projector.*`, `lm_head.weight`), the hub's 4.x names (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`) and what transformers 5.25
saves (the 4.x names, the tower's without `vision_model.`) all load. The tower and
projector are whole on every tensor-parallel rank and stay float. Load time and the step thread only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.models.gemma3 import GemmaRMSNorm
from pagedserve.worker.models.vision_language import VisionLanguage, build
from pagedserve.worker.vision.clip import _param
from pagedserve.worker.vision.siglip import SiglipVisionTower


class Gemma3Projector(nn.Module):
    """Gemma3MultiModalProjector: [images, side^2, hidden] -> [images, mm_tokens_per_image, text hidden]."""

    def __init__(self, vision: dict, text_hidden: int) -> None:
        super().__init__()
        hidden = vision["hidden_size"]
        self.side = vision["image_size"] // vision["patch_size"]
        self.kernel = self.side // int(round(vision["num_image_tokens"] ** 0.5))
        self.mm_input_projection_weight = _param(hidden, text_hidden)
        self.mm_soft_emb_norm = GemmaRMSNorm(hidden, vision["layer_norm_eps"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, hidden = x.shape
        grid = x.transpose(1, 2).reshape(batch, hidden, self.side, self.side).contiguous()
        pooled = F.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3Tower(SiglipVisionTower):
    def map_name(self, name: str) -> tuple[str, int] | None:
        """The pooling head (vision_use_head, never read by Gemma 3) and position_ids are not ours."""
        return None if name.startswith("vision_tower.head.") else super().map_name(name)


class Gemma3Vision(VisionLanguage):
    TOWER, PROJECTOR = "vision_tower", "multi_modal_projector"
    RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
               ("language_model.lm_head.", "lm_head."), ("model.vision_tower.vision_model.", "vision_tower."),
               ("model.vision_tower.", "vision_tower."), ("vision_tower.vision_model.", "vision_tower."),
               ("model.multi_modal_projector.", "multi_modal_projector."))

    @staticmethod
    def parts(vision: dict, text_hidden: int):
        return Gemma3Tower(vision), Gemma3Projector(vision, text_hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds (image_rows.step_embeddings: input_ids' plain embeddings with the image rows in place):
        the text rows scaled as the text model scales its embeddings, the image rows as they are."""
        if inputs_embeds is not None:
            text = (input_ids != self.vision["image_token_id"])[:, None]
            inputs_embeds = torch.where(text, self.scale_embeddings(inputs_embeds), inputs_embeds)
        return super().forward(input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds)


def Gemma3ForConditionalGeneration(cfg: ModelConfig, backend: AttentionBackend,  # noqa: N802
                                   max_positions: int):
    """The model for a Gemma 3 config with images (models.model_class's entry: called like a class)."""
    return build(Gemma3Vision, cfg, backend, max_positions)
