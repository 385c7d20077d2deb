"""Build a random-weight Llama-3.2-1B-shaped model (bf16 safetensors) with the default model's tokenizer files."""
import shutil
import sys
from pathlib import Path
import torch
import transformers

out, tok = Path(sys.argv[1]), Path(sys.argv[2])
layers = int(sys.argv[3]) if len(sys.argv) > 3 else 16
out.mkdir(parents=True, exist_ok=True)
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                               rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=1, eos_token_id=2,
                               tie_word_embeddings=True, torch_dtype="bfloat16")
torch.manual_seed(0)
with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    if (tok / f).exists():
        shutil.copy(tok / f, out / f)
print("model at", out, sum(p.numel() for p in model.parameters()) / 1e9, "B params")
