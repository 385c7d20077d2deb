"""The worker's adapters: a host pool of loaded adapters and the step's slots.

  - host pool: up to --max-cpu-loras adapters read from their folders (weights.load_adapter),
    least recently used evicted first; an adapter is keyed by (name, folder), so a name loaded
    again from another folder is read again.
  - slots: --max-loras adapters resident in every LoraLayer's stacks. A step's adapters (the
    scheduler admits at most max_loras distinct ones among its running requests) keep the slots
    they hold; a new one takes a free slot, else the least recently used slot of an adapter the
    step does not use. Slots are numbered from 0 and the lowest free one is taken, so a step with
    few adapters multiplies by few slots (LoraBatch.slots).

`prepare(order, counts)` runs before each forward (model_runner) and sets the shared LoraBatch;
a step without adapter rows sets mask None, and the layers add nothing.

Torch thread only (the model runner's).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagedserve.common.lora import AdapterSpec, LoraError, read_adapter
from pagedserve.worker.lora.layers import LoraBatch, LoraLayer
from pagedserve.worker.lora.weights import AdapterWeights, load_adapter, lora_targets

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (name, folder)


class LoraManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if max_loras < 1 or max_lora_rank < 1 or max_cpu_loras < max_loras:
            raise ValueError(f"LoRA needs --max-loras >= 1 ({max_loras}), --max-lora-rank >= 1 ({max_lora_rank}) "
                             f"and --max-cpu-loras >= --max-loras ({max_cpu_loras})")
        self.model, self.dtype, self.device = model, dtype, device
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.batch = LoraBatch()
        self.layers: dict[str, LoraLayer] = {}
        for name, parts in lora_targets(model).items():
            layer = model.get_submodule(name)
            self.layers[name] = layer.lora = LoraLayer(layer, parts, layer.weight.shape[1], max_loras, max_lora_rank,
                                                        self.batch, dtype, device)
        self.host: OrderedDict[Key, AdapterWeights] = OrderedDict()
        self.slots: list[Key | None] = [None] * max_loras
        self.slot_used = [0] * max_loras  # the step each slot last served
        self.steps = 0

    # ---- the host pool -------------------------------------------------------------------------
    def add(self, name: str, path: str) -> AdapterWeights:
        """The adapter's weights, read now unless the pool has them (then most recently used)."""
        key = (name, path)
        weights = self.host.get(key)
        if weights is not None:
            self.host.move_to_end(key)
            return weights
        spec: AdapterSpec = read_adapter(name, path, self.max_rank)
        weights = load_adapter(self.model, spec, self.dtype)
        while len(self.host) >= self.max_cpu_loras:
            evicted = next((k for k in self.host if k not in self.slots), None) or next(iter(self.host))
            del self.host[evicted]
            log.info("LoRA adapter %r left the host pool (--max-cpu-loras %d)", evicted[0], self.max_cpu_loras)
        self.host[key] = weights
        log.info("LoRA adapter %r loaded from %s (rank %d, %d layers)", name, path, spec.rank, len(weights))
        return weights

    def remove(self, name: str) -> bool:
        """Forget every copy of the adapter (host pool and slots); False if none was here."""
        keys = [k for k in self.host if k[0] == name]
        for key in keys:
            del self.host[key]
        for slot, key in enumerate(self.slots):
            if key is not None and key[0] == name:
                self._fill(slot, None)
        return bool(keys)

    def resident(self) -> list[str]:
        return [k[0] for k in self.host]

    # ---- a step ----------------------------------------------------------------------------------
    def unloadable(self, scheduled: dict[str, int], states) -> dict[str, str]:
        """The step's requests whose adapter cannot be loaded (req_id -> why), after loading the
        others' into the host pool: they are left out of the step and fail alone."""
        failed, errors = {}, {}
        for req_id in scheduled:
            params = states.state(req_id).params
            if not params.lora_name:
                continue
            key = (params.lora_name, params.lora_path)
            if key not in errors:
                try:
                    self.add(*key)
                    errors[key] = None
                except (LoraError, OSError, ValueError, KeyError) as exc:
                    log.error("LoRA adapter %r from %s did not load: %s", key[0], key[1], exc)
                    errors[key] = f"LoRA adapter {key[0]!r} did not load: {exc}"
            if errors[key] is not None:
                failed[req_id] = errors[key]
        return failed

    def prepare(self, states, counts) -> None:
        """Slots for this step's adapters and the rows' mask (states: the batch's request states
        in row order, counts: their rows)."""
        self.steps += 1
        keys = [(s.params.lora_name, s.params.lora_path) if s.params.lora_name else None for s in states]
        wanted = list(dict.fromkeys(k for k in keys if k is not None))
        batch = self.batch
        if not wanted:
            batch.mask = batch.row_slots = None
            batch.slots = 0
            return
        if len(wanted) > self.max_loras:
            raise LoraError(f"a step holds {len(wanted)} LoRA adapters: more than --max-loras {self.max_loras}")
        slot_of = {key: self._slot_for(key, wanted) for key in wanted}
        per_state = np.array([slot_of[k] if k is not None else -1 for k in keys], dtype=np.int64)
        row_slots = np.repeat(per_state, counts)
        k = int(per_state.max()) + 1
        mask = np.zeros((len(row_slots), k), dtype=np.float32)
        used = row_slots >= 0
        mask[np.nonzero(used)[0], row_slots[used]] = 1.0
        batch.mask = torch.from_numpy(mask).to(self.device, self.dtype)
        batch.row_slots = torch.from_numpy(row_slots.astype(np.int32)).to(self.device)
        batch.slots = k

    def _slot_for(self, key: Key, wanted: list[Key]) -> int:
        if key in self.slots:
            slot = self.slots.index(key)
        else:
            free = [i for i, k in enumerate(self.slots) if k is None]
            if free:
                slot = free[0]
            else:
                idle = [i for i, k in enumerate(self.slots) if k not in wanted]
                slot = min(idle, key=lambda i: self.slot_used[i])
            self._fill(slot, key)
        self.slot_used[slot] = self.steps
        return slot

    def _fill(self, slot: int, key: Key | None) -> None:
        weights = self.add(*key) if key is not None else {}
        for name, layer in self.layers.items():
            part_weights = weights.get(name)
            layer.set_slot(slot, None if part_weights is None else
                           {p: (a.to(self.device), b.to(self.device)) for p, (a, b) in part_weights.items()})
        self.slots[slot] = key
