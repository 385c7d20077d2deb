"""A tiny llava-1.5-style model folder for the front end's tests: config.json of
LlavaForConditionalGeneration, CLIP's preprocessor_config.json, LlavaProcessor's
processor_config.json, the default model's tokenizer with an added <image> token and llava-hf's
chat template (images first, then text; content always a list). No weights: the front end never
loads them. And what the vision-language tests share: random weights for a folder, random PNGs,
transformers' answer on a folder (VisionReference), and the offline API's image checks against it."""

from __future__ import annotations

import json
from pathlib import Path

# llava-hf/llava-1.5-7b-hf's template
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")

PREPROCESSOR = {"crop_size": {"height": 30, "width": 30}, "do_center_crop": True, "do_convert_rgb": True,
                "do_normalize": True, "do_rescale": True, "do_resize": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "CLIPImageProcessor",
                "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "rescale_factor": 0.00392156862745098,
                "size": {"shortest_edge": 32}}
PROCESSOR = {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 10,
             "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"}


def build_tiny_llava(folder: Path, tokenizer_folder: Path) -> Path:
    """Write the folder (tokenizer from tokenizer_folder, e.g. the default model's) and return it.
    Its images take (30 // 10) ** 2 + 1 - 1 = 9 tokens each."""
    from pagedserve.model_files.tokenizer_files import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = LLAVA_TEMPLATE
    tokenizer.save_pretrained(folder)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "image_token_index": image_token, "vision_feature_select_strategy": "default",
              "vision_feature_layer": -2, "projector_hidden_act": "gelu",
              "text_config": {"model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128},
              "vision_config": {"model_type": "clip_vision_model", "image_size": 30, "patch_size": 10,
                                "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "intermediate_size": 64, "projection_dim": 32}}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    (folder / "processor_config.json").write_text(json.dumps(PROCESSOR, indent=1))
    return folder


def with_random_weights(folder: Path, seed: int = 0, model_class: str = "LlavaForConditionalGeneration") -> Path:
    """Give a folder of config files (build_tiny_llava's, tiny_idefics3's) random weights (sharpened, so
    greedy tokens are not near ties)."""
    import torch
    import transformers

    from tiny_models import sharpen

    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(transformers.AutoConfig.from_pretrained(folder))
    sharpen(model)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def png(seed: int, size=(45, 37)) -> bytes:
    """A random RGB image of size (width, height), PNG-encoded."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class VisionReference:
    """transformers' answer on the folder: the model's processor (image processor and tokenizer) and its
    model class in float32, greedy, for a one-turn chat of an image and a question."""

    def __init__(self, folder: Path, question: str, max_tokens: int, processor=None,
                 model_class: str = "LlavaForConditionalGeneration") -> None:
        import torch
        import transformers

        self.processor = processor or transformers.AutoProcessor.from_pretrained(folder)
        self.model = getattr(transformers, model_class).from_pretrained(folder, dtype=torch.float32).eval()
        self.nested = model_class != "LlavaForConditionalGeneration"  # Idefics3's processor: a list per prompt
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        self.prompt = self.processor.tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False, chat_template=self.processor.chat_template)
        self.question, self.max_tokens = question, max_tokens

    def __call__(self, image: bytes, ignore_eos: bool = True) -> tuple[str, int]:
        """(the answer's text, the prompt's tokens with the image's placeholders)."""
        import io

        import torch
        from PIL import Image

        pil = Image.open(io.BytesIO(image))
        inputs = self.processor(images=[[pil]] if self.nested else pil, text=self.prompt, return_tensors="pt",
                                add_special_tokens=False)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=self.max_tokens, do_sample=False,
                                      min_new_tokens=self.max_tokens if ignore_eos else 0,
                                      eos_token_id=self.processor.tokenizer.eos_token_id)
        length = inputs["input_ids"].shape[1]
        return self.processor.tokenizer.decode(out[0, length:], skip_special_tokens=True), length

    def chat(self, content: list[dict], images: list[bytes]) -> tuple[str, str, int]:
        """A one-turn chat of content parts, its {"type": "image"} parts taking `images` in order (a processor
        that takes a flat list of images): (the processor's chat template's prompt, the greedy answer of
        max_tokens tokens, the prompt's tokens)."""
        import io

        import torch
        from PIL import Image

        prompt = self.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = self.processor(text=prompt, images=[Image.open(io.BytesIO(d)) for d in images], return_tensors="pt",
                                add_special_tokens=False)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=self.max_tokens, min_new_tokens=self.max_tokens,
                                      do_sample=False)
        length = inputs["input_ids"].shape[1]
        return prompt, self.processor.tokenizer.decode(out[0, length:], skip_special_tokens=True), length


LlavaReference = VisionReference


def check_llm_images(folder: Path, reference: VisionReference, wide: bytes, tall: bytes, tiny: bytes,
                     pair: list[dict]) -> None:
    """LLM.generate with vLLM's multi_modal_data (each image alone with reference.prompt; tall then wide in the
    one-turn chat of `pair`'s parts) and LLM.chat with wide as an image_url part: the answers and prompt lengths
    are transformers' (greedy, ignore_eos)."""
    import base64

    from pagedserve import LLM
    from pagedserve.common.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=reference.max_tokens, ignore_eos=True)
    with LLM(model=str(folder), dtype="float32", kv_cache_memory="64MiB") as llm:
        outs = llm.generate([{"prompt": reference.prompt, "multi_modal_data": {"image": image}}
                             for image in (wide, tall, tiny)], greedy)
        url = "data:image/png;base64," + base64.b64encode(wide).decode()
        [chat] = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                        {"type": "text", "text": reference.question}]}], greedy)
        prompt, want, length = reference.chat(pair, [tall, wide])
        [both] = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [tall, wide]}}, greedy)
    assert [o.outputs[0].text for o in outs] == [reference(image)[0] for image in (wide, tall, tiny)]
    assert [len(o.prompt_token_ids) for o in outs] == [reference(image)[1] for image in (wide, tall, tiny)]
    assert chat.outputs[0].text == reference(wide)[0]
    assert (both.outputs[0].text, len(both.prompt_token_ids)) == (want, length)


def async_llm_answer(folder: Path, reference: VisionReference, image: bytes) -> str:
    """AsyncLLM.generate's greedy text (ignore_eos) for reference.prompt with the image as multi_modal_data."""
    import asyncio

    from pagedserve import AsyncLLM
    from pagedserve.common.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=reference.max_tokens, ignore_eos=True)

    async def main():
        async with AsyncLLM(model=str(folder), dtype="float32", kv_cache_memory="64MiB") as engine:
            outs = [out async for out in engine.generate(
                {"prompt": reference.prompt, "multi_modal_data": {"image": image}}, greedy)]
            return outs[-1].outputs[0].text

    return asyncio.run(main())
