"""Mistral 3 (Mistral3ForConditionalGeneration: Mistral-Small-3.1 / 3.2) and Pixtral-in-LLaVA
(LlavaForConditionalGeneration whose vision_config.model_type is "pixtral": pixtral-12b): our Mistral text
model (LlamaForCausalLM) with the Pixtral tower and the family's projector beside it (worker/vision/pixtral.py;
Mistral3's RMSNorm, patch merger and MLP, or LLaVA's MLP).

An image's ImageInput covers its whole placeholder span (common/pixtral_config.py): rows of `cols` [IMG]
tokens, each row ended by [IMG_BREAK], the last by [IMG_END]. `encode_images` gives one row per span position,
as vLLM's embed_is_patch does: the projected tower rows at the [IMG] positions (row-major over the merged
patches), and at the break and end positions the text model's own embedding of that token (what transformers
embeds there). The model runner scatters them like any image's rows (worker/image_rows.py), so chunked prefill
and prefix-cache hits inside an image need nothing more. The embedding lookup of the two tokens runs on every
tensor-parallel rank in the same step (all ranks encode the same images).

Weights: the hub's transformers-4 names (`language_model.model.*`, `language_model.lm_head.*`,
`vision_tower.*`, `multi_modal_projector.*`) and transformers 5's (`model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.*`) both load. Load time builds it, the
step thread encodes.
"""

from __future__ import annotations

import torch

from pagedserve.common.model_config import ModelConfig
from pagedserve.common.pixtral_config import pixtral_grid
from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.models.vision_language import LLAVA_RENAMES, VisionLanguage, build
from pagedserve.worker.vision.clip import Projector
from pagedserve.worker.vision.pixtral import Mistral3Projector, PixtralVisionTower


class Pixtral(VisionLanguage):
    """The Pixtral family: LLaVA's parts' names and checkpoint renames (models/llava.py), its own tower and
    span rows."""
    TOWER, PROJECTOR, RENAMES = "vision_tower", "multi_modal_projector", LLAVA_RENAMES

    @staticmethod
    def parts(vision: dict, text_hidden: int):
        projector = Mistral3Projector if vision["projector"] == "mistral3" else Projector
        return PixtralVisionTower(vision), projector(vision, text_hidden)

    def span_index(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """Each span position's source in [tower rows..., break, end]: the image rows in order, then the two
        tokens' embeddings."""
        n = rows * cols
        grid = torch.arange(n, device=device).view(rows, cols)
        index = torch.cat([grid, torch.full((rows, 1), n, device=device)], dim=1).reshape(-1)
        index[-1] = n + 1
        return index

    def encode_images(self, images) -> list[torch.Tensor]:
        """ImageInputs -> each one's span rows [its length, hidden] in the model's dtype (one tower pass)."""
        v = self.vision
        grids = [pixtral_grid(image.height, image.width, v) for image in images]
        for image, (rows, cols) in zip(images, grids):
            if image.length != rows * (cols + 1):
                raise ValueError(f"an image over {image.length} placeholder tokens: this model's {image.height}x"
                                 f"{image.width} image spans {rows * (cols + 1)}")
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        ends = self.embed_tokens(torch.tensor([v["image_break_token_id"], v["image_end_token_id"]],
                                              device=device)).to(dtype)
        out = []
        m = v["merge_size"]
        for features, (rows, cols) in zip(self.vision_tower(images), grids):
            if v["projector"] == "mistral3":
                projected = self.multi_modal_projector(features, rows * m, cols * m)
            else:
                projected = self.multi_modal_projector(features)
            table = torch.cat([projected.to(dtype), ends])
            out.append(table[self.span_index(rows, cols, device)])
        return out


def Mistral3ForConditionalGeneration(cfg: ModelConfig, backend: AttentionBackend, max_positions: int):  # noqa: N802
    """The model for a Mistral3 config, or a LLaVA one over a Pixtral tower (models.model_class's entry)."""
    return build(Pixtral, cfg, backend, max_positions)
