"""The draft model of `--speculative-config {"method": "draft_model", "model": ...}`, checked
against the target before anything loads: found (a folder, a prepared name or a hub id), a
config.json we can serve, the same vocabulary (vocab_size: its token ids are the target's), one KV
group (no sliding-window layers: it writes through the target's first, full-attention block
table), and a context at least the target's max_model_len. Each failure is a ValueError that
names the field. Used by the launcher (serve), the in-process engine and the worker. No torch.
"""

from __future__ import annotations

from pathlib import Path

from pagedserve.common.model_config import ModelConfig
from pagedserve.common.speculative import SpeculativeConfig


def check_draft_model(spec: SpeculativeConfig | None, target: ModelConfig,
                      max_model_len: int | None = None) -> Path | None:
    """The draft's folder (None when the config has no draft model). max_model_len: the target's
    context as served (None: the target's own)."""
    from pagedserve.model_files.default_model import resolve_model
    if spec is None or spec.draft_model is None:
        return None
    where = f"--speculative-config: model {spec.model!r}"
    try:
        folder = Path(resolve_model(spec.model))
        draft = ModelConfig.from_folder(folder)
    except (OSError, ValueError) as exc:  # FileNotFoundError, a hub id that cannot be fetched, a bad config
        raise ValueError(f"{where}: the draft model cannot be used: {exc}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: the draft's vocab_size {draft.vocab_size} differs from the target model's "
                         f"{target.vocab_size}; a draft model must share the target's vocabulary")
    if draft.kv_groups().hybrid:
        raise ValueError(f"{where}: the draft has sliding-window layers (KV groups); such a draft is not "
                         "supported, choose one with full attention only")
    needed = max_model_len or target.max_position_embeddings
    if draft.max_position_embeddings < needed:
        raise ValueError(f"{where}: the draft's max_position_embeddings {draft.max_position_embeddings} is "
                         f"shorter than the target's max_model_len {needed}; lower --max-model-len")
    return folder
