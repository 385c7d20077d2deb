"""The 1B model's GPTQ twin for speed: its *_proj weights as random 4-bit GPTQ tensors (groups of 128,
symmetric, AutoGPTQ's format), everything else copied. Random words make noise, not text: this times the
int4 kernel's path (`--quantization auto` on CUDA) against the bfloat16 model, nothing more."""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
group = 128
state = {}
for path in sorted(src.glob("*.safetensors")):
    for key, w in load_file(path).items():
        if not key.endswith("_proj.weight"):
            state[key] = w
            continue
        module, (rows, cols) = key.removesuffix(".weight"), w.shape
        state[module + ".qweight"] = torch.randint(-2 ** 31, 2 ** 31 - 1, (cols // 8, rows), dtype=torch.int32)
        state[module + ".qzeros"] = torch.full((cols // group, rows // 8), 0x77777777, dtype=torch.int32)
        state[module + ".scales"] = (torch.rand(cols // group, rows) * 0.002 + 0.001).half()
        state[module + ".g_idx"] = torch.arange(cols, dtype=torch.int32) // group
save_file(state, out / "model.safetensors")
config = json.loads((src / "config.json").read_text())
config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                 "sym": True, "checkpoint_format": "gptq"}
(out / "config.json").write_text(json.dumps(config))
for f in src.iterdir():
    if f.suffix not in (".safetensors",) and f.name != "config.json" and f.is_file():
        shutil.copy(f, out / f.name)
print("GPTQ twin at", out)
