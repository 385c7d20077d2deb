"""A tiny random-weight Gemma3ForConditionalGeneration, built and saved by the tests (transformers' own model
and config), and transformers' greedy answer on it with the bidirectional image mask (token_type_ids).

Shape: a Gemma 3 text model of hidden 64 (layers sliding, full: a local layer and a global one; sliding window
16, so prompts past it lose keys), a SigLIP tower over 56x56 images in 14x14 patches (4x4 patches), pooled to
mm_tokens_per_image 4 rows; the image, begin-of-image and end-of-image tokens inside the 256-token vocabulary.
Weights are sharpened (tiny_models.sharpen) so greedy choices are well separated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

IMAGE_TOKEN, BOI, EOI = 255, 253, 254
IMAGE_SIZE, MM_TOKENS = 56, 4
WINDOW = 16


def build_tiny_gemma3_vl(folder: Path, seed: int = 0, layer_types=("sliding_attention", "full_attention"),
                         renames: tuple[tuple[str, str], ...] = (), vision_overrides: dict | None = None,
                         mm_tokens: int = MM_TOKENS, head_dim: int = 16) -> Path:
    """Save the model (config.json, model.safetensors) into folder; renames: (prefix, new prefix) applied to
    the saved tensor names (another checkpoint layout of the same weights); head_dim 32 or more: one the CPU's
    compiled attention kernels take (16 goes through the torch ops)."""
    import transformers

    from tiny_models import sharpen

    torch.manual_seed(seed)
    text = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, query_pre_attn_scalar=head_dim,
        sliding_window=WINDOW, layer_types=list(layer_types), max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=2, eos_token_id=1, pad_token_id=0)
    vision = transformers.SiglipVisionConfig(**{**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                       num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=14),
                                                **(vision_overrides or {})})
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens,
                                    image_token_index=IMAGE_TOKEN, boi_token_index=BOI, eoi_token_index=EOI)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    sharpen(model, norm_mean=0.0, norm_std=0.5)  # Gemma's norms are (1 + w): spread around 1
    model.save_pretrained(folder, safe_serialization=True)
    if renames:
        from safetensors.torch import load_file, save_file
        tensors = load_file(folder / "model.safetensors")
        out = {}
        for name, tensor in tensors.items():
            for old, new in renames:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            out[name] = tensor
        save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def image(seed: int) -> np.ndarray:
    """A random 56x56 RGB image, uint8 [H, W, 3]."""
    return np.random.default_rng(seed).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)


def pixel_values(images: list[np.ndarray]) -> torch.Tensor | None:
    """Gemma3ImageProcessor's normalization of images already 56x56: x / 255, then (x - 0.5) / 0.5."""
    if not images:
        return None
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() * (1 / 255)
    return (x - 0.5) / 0.5


class Reference:
    """transformers' Gemma3ForConditionalGeneration on the folder, float32 (or dtype)."""

    def __init__(self, folder: Path, dtype=torch.float32) -> None:
        import transformers
        self.model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()

    @torch.no_grad()
    def logits(self, ids: list[int], images: list[np.ndarray], bidirectional: bool = True) -> torch.Tensor:
        """Every position's logits [len(ids), vocab] by one full forward; bidirectional=False: without
        token_type_ids (transformers then masks images causally, as a text model)."""
        input_ids = torch.tensor([ids])
        types = (input_ids == IMAGE_TOKEN).long() if bidirectional else None
        values = pixel_values(images)
        values = None if values is None else values.to(self.model.dtype)
        return self.model(input_ids=input_ids, pixel_values=values, token_type_ids=types).logits[0].float()

    def greedy(self, ids: list[int], images: list[np.ndarray], steps: int,
               bidirectional: bool = True) -> tuple[list[int], list[float]]:
        """Greedy tokens and their logprobs by full forwards."""
        ids, tokens, logprobs = list(ids), [], []
        for _ in range(steps):
            lp = torch.log_softmax(self.logits(ids, images, bidirectional)[-1], dim=-1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(lp[token].item())
            ids.append(token)
        return tokens, logprobs

    @torch.no_grad()
    def generate(self, ids: list[int], images: list[np.ndarray], steps: int) -> list[int]:
        """transformers' own generate (KV cache; token_type_ids on the prompt, as its processor gives them)."""
        input_ids = torch.tensor([ids])
        out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                  token_type_ids=(input_ids == IMAGE_TOKEN).long(), pixel_values=pixel_values(images),
                                  max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
        return out[0, len(ids):].tolist()


# google/gemma-3-4b-it's chat template (image parts render as <start_of_image>)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- else -%}{{ raise_exception(\"Invalid content type\") }}"
    "{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{'<start_of_turn>model\n'}}{%- endif -%}")
SPECIAL = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
PREPROCESSOR = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                "image_mean": [0.5, 0.4, 0.3], "image_processor_type": "Gemma3ImageProcessor",
                "image_std": [0.2, 0.25, 0.3], "resample": 2, "rescale_factor": 0.00392156862745098,
                "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "do_pan_and_scan": None}
PROCESSOR = {"image_seq_length": MM_TOKENS, "processor_class": "Gemma3Processor"}


def build_tiny_gemma3_folder(folder: Path, tokenizer_folder: Path, preprocessor: dict | None = None) -> Path:
    """A Gemma3ForConditionalGeneration folder without weights (tiny_llava.with_random_weights gives it some):
    the tokenizer from tokenizer_folder (the default model's) with Gemma 3's image and turn tokens added (and
    named as Gemma3Processor reads them), its chat template, config.json of the tiny shape above,
    Gemma3ImageProcessor's preprocessor_config.json (a mean and std other than 0.5), processor_config.json."""
    import json

    from pagedserve.model_files.tokenizer_files import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": [*SPECIAL.values(), "<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = GEMMA3_TEMPLATE
    tokenizer.save_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["extra_special_tokens"] = SPECIAL
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in SPECIAL.items()}
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "boi_token_index": ids["boi_token"], "eoi_token_index": ids["eoi_token"],
              "image_token_index": ids["image_token"], "mm_tokens_per_image": MM_TOKENS,
              "text_config": {"model_type": "gemma3_text", "vocab_size": len(tokenizer), "hidden_size": 64,
                              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
                              "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                              "max_position_embeddings": 512, "bos_token_id": tokenizer.bos_token_id,
                              "eos_token_id": tokenizer.eos_token_id},
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": IMAGE_SIZE,
                                "patch_size": 14, "vision_use_head": False}}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor or PREPROCESSOR, indent=1))
    (folder / "processor_config.json").write_text(json.dumps(PROCESSOR, indent=1))
    return folder


def reference_processor(folder: Path, preprocessor: dict | None = None):
    """transformers' Gemma3Processor on the folder, with the PIL image processor (no torchvision)."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from pagedserve.model_files.tokenizer_files import load_tokenizer

    pre = {k: v for k, v in (preprocessor or PREPROCESSOR).items() if k != "image_processor_type"}
    return Gemma3Processor(Gemma3ImageProcessorPil(**pre), load_tokenizer(folder), image_seq_length=MM_TOKENS,
                           chat_template=GEMMA3_TEMPLATE)


def with_random_weights(folder: Path, seed: int = 0) -> Path:
    """Give build_tiny_gemma3_folder's folder random weights, sharpened as build_tiny_gemma3_vl's (Gemma's (1 + w)
    norms spread around 1: answers that depend on the image)."""
    import transformers

    from tiny_models import sharpen

    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(transformers.AutoConfig.from_pretrained(folder))
    sharpen(model, norm_mean=0.0, norm_std=0.5)
    with torch.no_grad():  # image rows as large as the scaled text embeddings: answers that differ by image
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def solid(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    """A PNG of one color (width, height): the tiny model's answers differ by color (random noise pools to
    much the same rows)."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()
