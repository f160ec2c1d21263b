"""Short names for well-known GGUF models on the Hugging Face Hub, as Ollama spells its own
(`gemma3:1b`): each is a repository and a default quantization, `NAME:TAG[:QUANT]` picks another.
`quipu models pull --list` shows them; `quipu models search` finds the rest."""

from __future__ import annotations

import re
from dataclasses import dataclass

from quipu.errors import UsageError


@dataclass(frozen=True)
class KnownModel:
    repo: str  # OWNER/REPO on the Hub
    quant: str  # the quantization pulled by default
    size: int  # bytes of that quantization, about
    about: str


MB = 1_000_000

KNOWN: dict[str, KnownModel] = {
    "gemma3:1b": KnownModel("ggml-org/gemma-3-1b-it-GGUF", "Q4_K_M", 806 * MB, "Google's Gemma 3, 1B: a good first model"),
    "gemma3:4b": KnownModel("ggml-org/gemma-3-4b-it-GGUF", "Q4_K_M", 2_490 * MB, "Gemma 3, 4B"),
    "gemma3:12b": KnownModel("ggml-org/gemma-3-12b-it-GGUF", "Q4_K_M", 7_300 * MB, "Gemma 3, 12B"),
    "qwen3:4b": KnownModel("Qwen/Qwen3-4B-GGUF", "Q4_K_M", 2_500 * MB, "Alibaba's Qwen 3, 4B, thinks before it answers"),
    "qwen3:8b": KnownModel("Qwen/Qwen3-8B-GGUF", "Q4_K_M", 5_030 * MB, "Qwen 3, 8B; tools"),
    "llama3.2:1b": KnownModel("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M", 808 * MB, "Meta's Llama 3.2, 1B"),
    "llama3.2:3b": KnownModel("bartowski/Llama-3.2-3B-Instruct-GGUF", "Q4_K_M", 2_020 * MB, "Llama 3.2, 3B; tools"),
    "smollm3:3b": KnownModel("ggml-org/SmolLM3-3B-GGUF", "Q4_K_M", 1_920 * MB, "Hugging Face's SmolLM3, 3B"),
    "phi4-mini:3.8b": KnownModel("bartowski/microsoft_Phi-4-mini-instruct-GGUF", "Q4_K_M", 2_490 * MB,
                                 "Microsoft's Phi-4 mini, 3.8B"),
    "mistral:7b": KnownModel("bartowski/Mistral-7B-Instruct-v0.3-GGUF", "Q4_K_M", 4_370 * MB, "Mistral 7B v0.3"),
    "gpt-oss:20b": KnownModel("ggml-org/gpt-oss-20b-GGUF", "MXFP4", 12_100 * MB,
                              "OpenAI's gpt-oss, 20B (16 GB of memory); reasons, tools"),
    "qwen3.5:4b": KnownModel("unsloth/Qwen3.5-4B-GGUF", "Q4_K_M", 2_835 * MB,
                             "Alibaba's Qwen 3.5, 4B: a hybrid (Gated DeltaNet and attention); thinks before it answers"),
    "qwen3.5:9b": KnownModel("unsloth/Qwen3.5-9B-GGUF", "Q4_K_M", 6_100 * MB, "Qwen 3.5, 9B; tools"),
    "qwen3.6:27b": KnownModel("unsloth/Qwen3.6-27B-GGUF", "Q4_K_M", 16_547 * MB,
                              "Qwen 3.6, 27B: a hybrid as Qwen 3.5; thinks, tools"),
    "granite4:tiny-h": KnownModel("ibm-granite/granite-4.0-h-tiny-GGUF", "Q4_K_M", 4_231 * MB,
                                  "IBM's Granite 4.0 H tiny: a hybrid (state-space layers and attention), 7B of experts, 1B active"),
    "gemma4:e2b": KnownModel("unsloth/gemma-4-E2B-it-GGUF", "Q4_K_M", 3_340 * MB, "Google's Gemma 4, E2B"),
    "gemma4:e4b": KnownModel("unsloth/gemma-4-E4B-it-GGUF", "Q4_K_M", 5_350 * MB, "Gemma 4, E4B"),
    "lfm2:350m": KnownModel("LiquidAI/LFM2-350M-GGUF", "Q4_K_M", 229 * MB,
                            "Liquid AI's LFM2, 350M: a hybrid (short convolutions and attention), fast on a CPU"),
}

# NAME:TAG, and a quantization after a second colon: no slash, so never a Hub repository.
SHORT = re.compile(r"([a-z0-9][a-z0-9._-]*:[a-z0-9][a-z0-9._-]*)(?::([A-Za-z0-9_]{1,32}))?")


def is_short_name(text: str) -> bool:
    """Whether `text` has the shape of a short name (known or not): `NAME:TAG`, no slash."""
    return "/" not in text and not text.lower().endswith(".gguf") and SHORT.fullmatch(text.strip().lower()) is not None


def sizes_of(bare: str) -> list[str]:
    """The short names of a model named without its size (Ollama's `llama3.2`): `llama3.2:1b`,
    `llama3.2:3b`; none where quipu knows no such model."""
    name = bare.strip().lower()
    return [k for k in KNOWN if k.split(":", 1)[0] == name] if ":" not in name else []


def no_size(bare: str, sizes: list[str], how: str) -> str:
    """What to say of a model named without its size (`sizes`, those quipu knows; `how`, what
    the command does with one, `{}` where the name goes)."""
    return f"'{bare}' names no size: {' or '.join(sizes)} ({how.format(sizes[0])})"


def known_model(text: str) -> tuple[KnownModel, str]:
    """The known model a short name names, and the quantization asked for; a name of that shape
    that is not in the table is refused, naming the ones that are."""
    found = SHORT.fullmatch(text.strip().lower())
    model = KNOWN.get(found.group(1)) if found else None
    if found is None or model is None:
        raise UsageError(f"'{text}' is not a short name quipu knows (known: {', '.join(KNOWN)}; "
                         "`quipu models pull --list` has their sizes); a Hub repository is OWNER/REPO, and "
                         "`quipu models search TEXT` finds one")
    return model, (found.group(2) or model.quant).upper()
