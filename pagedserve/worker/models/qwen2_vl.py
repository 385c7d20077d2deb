"""Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration): our Qwen2
text model (LlamaForCausalLM) with the vision tower, its PatchMerger included, beside it
(worker/vision/qwen2_vl.py), and M-RoPE (worker/mrope.py).

The model is its text model with the tower beside it (models/vision_language.py); `encode_images` gives each
image its own number of rows ((height / 28) * (width / 28) at the usual sizes), which the model runner
scatters over the placeholders (worker/image_rows.py). Rotary: a step without image placeholders passes
positions already shifted (InputBatch.rope_shift), where M-RoPE is plain rope, so such steps run as any
text model's (decode and mixed-step graphs included); a step with image placeholders runs eagerly and passes
`mrope_positions` [3, tokens] too: each rotary frequency of section s (mrope_section: temporal, height, width
counts, the same over both halves of the head, as transformers splits cos and sin) turns by position s.

Weights: the hub's transformers-4 names (`model.layers.*`, `model.embed_tokens.*`, `visual.*`, `lm_head.*`) and
transformers 5's (`model.language_model.*`, `model.visual.*`, `lm_head.*`) both load. The text model is
sharded across tensor-parallel ranks as usual; the tower is whole on every rank and stays float. Load time
builds it, the step thread runs it.
"""

from __future__ import annotations

import torch

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.models.vision_language import VisionLanguage, build
from pagedserve.worker.vision.qwen2_vl import Qwen2VLVisionTower


class Qwen2VL(VisionLanguage):
    TOWER, PROJECTOR = "visual", ""
    RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__(cfg, backend, max_positions)
        section = self.vision["mrope_section"]
        columns = torch.cat([torch.full((n,), s, dtype=torch.long) for s, n in enumerate(section)])
        # each rotary column's section (0 temporal, 1 height, 2 width), both halves alike
        self.register_buffer("mrope_columns", torch.cat([columns, columns]), persistent=False)

    @staticmethod
    def parts(vision: dict, text_hidden: int):
        return Qwen2VLVisionTower(vision), None

    def encode_images(self, images) -> list[torch.Tensor]:
        """ImageInputs -> each one's rows [its length, hidden] in the model's dtype (one pass of the tower)."""
        for image in images:
            rows = self.visual.rows_of(image)
            if image.length != rows:
                raise ValueError(f"an image over {image.length} placeholder tokens: this model encodes a "
                                 f"{image.height}x{image.width} image into {rows} rows")
        return [rows.to(self.embed_tokens.weight.dtype) for rows in self.visual(images)]

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None, mrope_positions=None):
        """mrope_positions: [3, tokens], a step with image placeholders' (else `positions`, shifted, is all)."""
        return super().forward(input_ids, positions if mrope_positions is None else mrope_positions, kv_caches,
                               meta, inputs_embeds)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        if positions.dim() == 1:
            return super().rope(positions, dtype)
        index = self.mrope_columns.expand(1, positions.shape[1], -1)
        cos = self.cos_table[positions].gather(0, index)[0]  # [tokens, head_dim]: each column its section's
        sin = self.sin_table[positions].gather(0, index)[0]
        return self.ops.rope(cos, sin, torch.arange(positions.shape[1], device=positions.device), dtype)


def Qwen2VLForConditionalGeneration(cfg: ModelConfig, backend: AttentionBackend, max_positions: int):  # noqa: N802
    """The model for a Qwen2-VL or Qwen2.5-VL config (models.model_class's entries: called like a class)."""
    return build(Qwen2VL, cfg, backend, max_positions)
