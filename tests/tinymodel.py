"""A tiny random llama GGUF, written in milliseconds, for fast exact tests on the real engine."""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Sequence

import numpy as np

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WORDS = ["the", "a", "of", "and", "to", "in", "is", "it", "that", "sky", "blue", "Paris", "hello", "world"]
# Control tokens of common chat templates, so that their text parses as it does in real models.
SPECIALS = [
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
    "<start_of_turn>", "<end_of_turn>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>",
    "<|endoftext|>", "[INST]", "[/INST]", "<|start|>", "<|message|>", "<|channel|>", "<|return|>",
    "<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<｜begin▁of▁sentence｜>", "<｜User｜>",
    "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
    "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>",
]
TOOL_SPECIALS = [
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<|constrain|>", "<|call|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|START_ACTION|>", "<|END_ACTION|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|python_tag|>", "<|tool_call|>",
    "<|tool_call_start|>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>", "</think>",
]
# Reasoning markup that is one token in its family's vocabulary.
REASONING_SPECIALS = [
    "<|START_THINKING|>", "<|END_THINKING|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>",
    "<|END_TEXT|>", "<seed:think>", "</seed:think>", "[THINK]", "[/THINK]", "<|channel>", "<channel|>",
    "<|inner_prefix|>", "<|inner_suffix|>", "<mm:think>", "</mm:think>", "<|think|>", "<|content|>", "<|begin|>",
    "<|turn>", "<turn|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
    "<seed:bos>", "<seed:eos>",
]
CONTROL, USER_DEFINED = 3, 4


def vocab(tool_specials: bool = False) -> tuple[list[str], list[float], list[int]]:
    tokens, scores, types = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"], [0.0] * 5, [2, 3, 3, 3, 3]
    tokens += SPECIALS
    scores += [0.0] * len(SPECIALS)
    types += [CONTROL] * len(SPECIALS)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(6)
    normal = ["\u2581"] + list(string.ascii_letters + string.digits + string.punctuation)
    normal += ["\u2581" + w for w in WORDS] + WORDS + ["\n", "user", "assistant", "system"]
    seen = set()
    for i, text in enumerate(normal):
        if text in seen:
            continue
        seen.add(text)
        tokens.append(text)
        scores.append(-float(i) if len(text) == 1 else float(len(text)))
        types.append(1)
    if tool_specials:  # tool-call markup that is one token in its family's vocabulary
        tokens += TOOL_SPECIALS
        scores += [0.0] * len(TOOL_SPECIALS)
        types += [CONTROL] * len(TOOL_SPECIALS)
    return tokens, scores, types


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


BPE_CORPUS = ("hello world the sky is blue and the world is hello. Paris is the sky of the world; "
              "user assistant system: Shorter, please. \n\n  Hi there!  ")


def bpe_vocab(n_merges: int = 60, tool_specials: bool = False,
              extra_specials: Sequence[str] = ()) -> tuple[list[str], list[int], list[str]]:
    """A GPT-2 style byte-level BPE vocabulary: the special tokens, the 256 byte symbols, and
    merges learned from a small corpus."""
    chars = _byte_chars()
    tokens = ["<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"] + [t for t in SPECIALS if t != "<|endoftext|>"]
    tokens += TOOL_SPECIALS if tool_specials else []
    tokens += [t for t in extra_specials if t not in tokens]
    types = [CONTROL] * len(tokens)
    tokens += chars
    types += [1] * 256
    pieces = re.findall(r" ?[A-Za-z]+| ?[^\sA-Za-z]+|\s+", BPE_CORPUS)
    words = [[chars[b] for b in piece.encode()] for piece in pieces]
    merges: list[str] = []
    for _ in range(n_merges):
        pairs: dict[tuple[str, str], int] = {}
        for w in words:
            for a, b in zip(w, w[1:], strict=False):
                pairs[(a, b)] = pairs.get((a, b), 0) + 1
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(f"{best[0]} {best[1]}")
        tokens.append(best[0] + best[1])
        types.append(1)
        merged = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged.append(out)
        words = merged
    return tokens, types, merges


def write_tiny_gguf(
    path: Path,
    *,
    n_embd: int = 128,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 256,
    n_ctx_train: int = 2048,
    seed: int = 0,
    chat_template: str | None = CHATML,
    architecture: str = "llama",
    tokenizer: str = "spm",
    split_max_tensors: int = 0,
    tool_specials: bool = False,
    extra_specials: Sequence[str] = (),
    rope_sections: Sequence[int] = (),
    weights: str = "f32",
) -> Path:
    """`tokenizer`: "spm" (SentencePiece with byte fallback, as Llama 2 and Gemma) or "bpe"
    (GPT-2 style byte-level BPE, as Llama 3, Qwen and most recent models). With
    `split_max_tensors`, the model is written in parts (`STEM-00001-of-0000N.gguf` beside `path`).
    `weights`: the matrices' type (`_quantizing`)."""
    import gguf

    if tokenizer == "bpe":
        tokens, types, merges = bpe_vocab(tool_specials=tool_specials, extra_specials=extra_specials)
        scores = None
    else:
        tokens, scores, types = vocab(tool_specials)
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    writer = _quantizing(gguf.GGUFWriter(str(path), architecture, split_max_tensors=split_max_tensors), weights)
    writer.add_name("tiny-test")
    writer.add_file_type(0)  # all F32
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    if rope_sections:  # (M-RoPE: the rotary dimensions of time, height, width and the rest)
        writer.add_rope_dimension_sections(list(rope_sections))
    if tokenizer == "bpe":
        _add_bpe(writer, tokens, types, merges, chat_template)
    else:
        _add_spm(writer, tokens, scores, types, chat_template)

    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", w(n_vocab, n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(p + "attn_q.weight", w(n_head * head_dim, n_embd))
        writer.add_tensor(p + "attn_k.weight", w(n_head_kv * head_dim, n_embd))
        writer.add_tensor(p + "attn_v.weight", w(n_head_kv * head_dim, n_embd))
        writer.add_tensor(p + "attn_output.weight", w(n_embd, n_head * head_dim))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(p + "ffn_gate.weight", w(n_ff, n_embd))
        writer.add_tensor(p + "ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor(p + "ffn_down.weight", w(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _add_specials(writer, chat_template: str | None, add_bos: bool = True) -> None:
    """The special tokens' keys every tiny model has (BOS 1, EOS 4: `<|im_end|>` in a BPE
    vocabulary), and its chat template."""
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(4)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def _add_bpe(writer, tokens: list[str], types: list[int], merges: list[str], chat_template: str | None,
             add_bos: bool = True) -> None:
    """A byte-level BPE vocabulary (`bpe_vocab`) and its special tokens."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    _add_specials(writer, chat_template, add_bos)


def _add_spm(writer, tokens: list[str], scores: list[float], types: list[int], chat_template: str | None) -> None:
    """A SentencePiece vocabulary (`vocab`) and its special tokens."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    _add_specials(writer, chat_template)


def _encoder_blocks(writer, prefix: str, w, n_layer: int, n_embd: int, n_ff: int, key_bias: bool = True) -> None:
    """A projector's transformer blocks as clip.cpp names them (`v.blk.N.` for vision, `a.blk.N.`
    for audio: attention with biases, two layer norms, a feed-forward), and its last layer norm;
    `w` draws the random weights."""
    for i in range(n_layer):
        p = f"{prefix}.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(p + name + ".weight", w(n_embd, n_embd))
            if key_bias or name != "attn_k":
                writer.add_tensor(p + name + ".bias", w(n_embd))
        for name in ("ln1", "ln2"):
            writer.add_tensor(p + name + ".weight", np.ones(n_embd, dtype=np.float32))
            writer.add_tensor(p + name + ".bias", np.zeros(n_embd, dtype=np.float32))
        writer.add_tensor(p + "ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor(p + "ffn_up.bias", w(n_ff))
        writer.add_tensor(p + "ffn_down.weight", w(n_embd, n_ff))
        writer.add_tensor(p + "ffn_down.bias", w(n_embd))
    writer.add_tensor(f"{prefix}.post_ln.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor(f"{prefix}.post_ln.bias", np.zeros(n_embd, dtype=np.float32))


def _clip_writer(path: Path, drop: Sequence[str] = (), retype: dict | None = None):
    """A GGUF writer for a projector that leaves out the tensors named in `drop`, and writes each
    key of `retype` (key: (value, gguf value type)) in place of the value it is given."""
    import gguf

    retype = retype or {}

    class Writer(gguf.GGUFWriter):
        def add_tensor(self, name, tensor, *args, **kwargs):
            if name not in drop:
                super().add_tensor(name, tensor, *args, **kwargs)

        def add_key_value(self, key, val, vtype, *args, **kwargs):
            if key in retype:
                val, vtype = retype[key]
            super().add_key_value(key, val, vtype, *args, **kwargs)

    return Writer(str(path), "clip")


def write_tiny_projector(path: Path, *, n_embd_text: int = 128, n_embd: int = 32, n_ff: int = 64, n_layer: int = 1,
                         n_head: int = 2, image_size: int = 32, patch: int = 8, merge: int = 2, seed: int = 1,
                         drop: Sequence[str] = (), retype: dict | None = None) -> Path:
    """A tiny random vision projector (an mmproj GGUF) of the kind llama.cpp's clip.cpp reads as
    Gemma 3's: a SigLIP encoder, its patches averaged `merge` by `merge`, projected to the text
    model's width (`n_embd_text`, the tiny model's by default). An image is (image_size / patch
    / merge)^2 positions in the context: 4 by default."""

    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = _clip_writer(path, drop, retype)
    writer.add_name("tiny-projector")
    writer.add_file_type(0)
    writer.add_string("clip.projector_type", "gemma3")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_audio_encoder", False)
    writer.add_bool("clip.use_gelu", True)
    for key, value in (("embedding_length", n_embd), ("feed_forward_length", n_ff), ("block_count", n_layer),
                       ("projection_dim", n_embd_text), ("attention.head_count", n_head), ("image_size", image_size),
                       ("patch_size", patch), ("projector.scale_factor", merge)):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_tensor("v.patch_embd.weight", w(n_embd, 3, patch, patch))
    writer.add_tensor("v.patch_embd.bias", w(n_embd))
    writer.add_tensor("v.position_embd.weight", w((image_size // patch) ** 2, n_embd))
    _encoder_blocks(writer, "v", w, n_layer, n_embd, n_ff)
    writer.add_tensor("mm.input_projection.weight", w(n_embd, n_embd_text))
    writer.add_tensor("mm.soft_emb_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_audio_projector(path: Path, *, n_embd_text: int = 128, n_embd: int = 32, n_ff: int = 64,
                               n_layer: int = 1, n_head: int = 2, n_mel: int = 128, seed: int = 2,
                               drop: Sequence[str] = (), retype: dict | None = None) -> Path:
    """A tiny random audio projector of the kind clip.cpp reads as Qwen2-Audio's: a Whisper
    encoder (two convolutions over the log-mel frames, then blocks) and a linear projection to
    the text model's width. A recording is cut in 30-second pieces of 750 positions each."""

    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = _clip_writer(path, drop, retype)
    writer.add_name("tiny-audio-projector")
    writer.add_file_type(0)
    writer.add_string("clip.projector_type", "qwen2a")
    writer.add_bool("clip.has_vision_encoder", False)
    writer.add_bool("clip.has_audio_encoder", True)
    for key, value in (("embedding_length", n_embd), ("feed_forward_length", n_ff), ("block_count", n_layer),
                       ("projection_dim", n_embd_text), ("attention.head_count", n_head), ("num_mel_bins", n_mel)):
        writer.add_uint32(f"clip.audio.{key}", value)
    writer.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
    writer.add_tensor("a.conv1d.1.weight", w(n_embd, n_mel, 3))
    writer.add_tensor("a.conv1d.1.bias", w(n_embd, 1))
    writer.add_tensor("a.conv1d.2.weight", w(n_embd, n_embd, 3))
    writer.add_tensor("a.conv1d.2.bias", w(n_embd, 1))
    writer.add_tensor("a.position_embd.weight", w(1500, n_embd))
    _encoder_blocks(writer, "a", w, n_layer, n_embd, n_ff, key_bias=False)  # (Whisper's keys have no bias)
    writer.add_tensor("mm.a.fc.weight", w(n_embd_text, n_embd))
    writer.add_tensor("mm.a.fc.bias", w(n_embd_text))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_mrope_projector(path: Path, *, n_embd_text: int = 128, n_embd: int = 32, n_ff: int = 64,
                               n_layer: int = 1, n_head: int = 2, patch: int = 14, seed: int = 3) -> Path:
    """A tiny random vision projector of the kind clip.cpp reads as Qwen2-VL's: patches of two
    frames, M-RoPE in the encoder, four patches merged into one position, whose positions in
    the text model's context are M-RoPE ones too (a text model of architecture qwen2vl)."""
    import gguf

    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_name("tiny-mrope-projector")
    writer.add_file_type(0)
    writer.add_string("clip.projector_type", "qwen2vl_merger")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_audio_encoder", False)
    writer.add_bool("clip.use_gelu", True)
    for key, value in (("embedding_length", n_embd), ("feed_forward_length", n_ff), ("block_count", n_layer),
                       ("projection_dim", n_embd_text), ("attention.head_count", n_head), ("image_size", 56),
                       ("patch_size", patch)):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_tensor("v.patch_embd.weight", w(n_embd, 3, patch, patch))
    writer.add_tensor("v.patch_embd.weight.1", w(n_embd, 3, patch, patch))
    _encoder_blocks(writer, "v", w, n_layer, n_embd, n_ff)
    writer.add_tensor("mm.0.weight", w(4 * n_embd, 4 * n_embd))
    writer.add_tensor("mm.0.bias", w(4 * n_embd))
    writer.add_tensor("mm.2.weight", w(n_embd_text, 4 * n_embd))
    writer.add_tensor("mm.2.bias", w(n_embd_text))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hybrid_writer(path: Path, architecture: str, *, n_embd: int, n_layer: int, n_head: int, n_ff: int,
                   n_ctx_train: int, chat_template: str | None, extra_specials: Sequence[str]):
    """A GGUF writer with a hybrid model's common keys and a byte-level BPE vocabulary (as Qwen's
    and LFM2's), and the vocabulary's size."""
    import gguf

    tokens, types, merges = bpe_vocab(tool_specials=True, extra_specials=extra_specials)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_file_type(0)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_layer_norm_rms_eps(1e-6)
    _add_bpe(writer, tokens, types, merges, chat_template, add_bos=False)
    return writer, len(tokens)


def _quantizing(writer, weights: str):
    """`writer`, whose matrices (2-D weights whose rows are whole blocks of 32) are written in
    `weights`' type: "f32", as given; "q4_1", llama.cpp's 4-bit type whose product with a step's
    tokens is one dot product a token on the CPU, as for a lone token (no kernel of its own for
    several tokens at once, unlike F32's), so that a step's tokens are computed as alone."""
    if weights == "f32":
        return writer
    import gguf
    from gguf.quants import quantize

    kind = {"q4_1": gguf.GGMLQuantizationType.Q4_1}[weights]
    add = writer.add_tensor

    def add_tensor(name: str, tensor: np.ndarray, **more) -> None:
        if tensor.ndim == 2 and name.endswith(".weight") and tensor.shape[1] % 32 == 0 and not more:
            add(name, quantize(tensor, kind), raw_dtype=kind)
        else:
            add(name, tensor, **more)

    writer.add_tensor = add_tensor
    return writer


def _draws(seed: int):
    """A generator of random weights, and `w(*shape, scale=0.5)`, which draws a normal tensor of them."""
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.5) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return rng, w


def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def _add_ffn(writer, prefix: str, w, n_embd: int, n_ff: int) -> None:
    """A block's gated feed-forward (`w` draws the random weights)."""
    writer.add_tensor(prefix + "ffn_gate.weight", w(n_ff, n_embd))
    writer.add_tensor(prefix + "ffn_up.weight", w(n_ff, n_embd))
    writer.add_tensor(prefix + "ffn_down.weight", w(n_embd, n_ff))


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_qwen35(path: Path, *, n_embd: int = 128, n_layer: int = 4, n_head: int = 4, n_head_kv: int = 2,
                      n_ff: int = 256, n_ctx_train: int = 4096, seed: int = 0, chat_template: str | None = None,
                      d_state: int = 16, n_group: int = 2, n_v_heads: int = 4, d_conv: int = 4,
                      weights: str = "f32") -> Path:
    """A tiny random model of Qwen 3.5's architecture (`qwen35`, as the vendored
    `src/models/qwen35.cpp` reads it): three of every four layers Gated DeltaNet (a recurrent
    state), every fourth gated attention with M-RoPE (IMROPE) and Q/K norms. The DeltaNet's decay
    is slowed and the attention sharpened, so that the next token depends on the whole history
    (two histories that differ early give different next tokens)."""
    rng, w = _draws(seed)
    head_dim = n_embd // n_head
    key_dim, value_dim = d_state * n_group, d_state * n_v_heads

    writer, n_vocab = _hybrid_writer(path, "qwen35", n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_ff=n_ff,
                                     n_ctx_train=n_ctx_train, chat_template=chat_template,
                                     extra_specials=["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    writer = _quantizing(writer, weights)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    quarter = head_dim // 2 // 4  # (M-RoPE's sections: time, height, width, the rest; their sum times two the rope dims)
    writer.add_rope_dimension_sections([head_dim // 2 - 2 * quarter, quarter, quarter, 0])
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(value_dim)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(n_v_heads)
    writer.add_ssm_group_count(n_group)
    writer.add_uint32("qwen35.full_attention_interval", 4)

    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", _ones(n_embd))
    writer.add_tensor("output.weight", w(n_vocab, n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", _ones(n_embd))
        writer.add_tensor(p + "post_attention_norm.weight", _ones(n_embd))
        if (i + 1) % 4 == 0:  # gated attention: the query and its gate
            writer.add_tensor(p + "attn_q.weight", w(2 * n_head * head_dim, n_embd, scale=1.5))
            writer.add_tensor(p + "attn_k.weight", w(n_head_kv * head_dim, n_embd, scale=1.5))
            writer.add_tensor(p + "attn_v.weight", w(n_head_kv * head_dim, n_embd))
            writer.add_tensor(p + "attn_output.weight", w(n_embd, n_head * head_dim))
            writer.add_tensor(p + "attn_q_norm.weight", _ones(head_dim) * 3)
            writer.add_tensor(p + "attn_k_norm.weight", _ones(head_dim) * 3)
        else:  # Gated DeltaNet
            writer.add_tensor(p + "attn_qkv.weight", w(2 * key_dim + value_dim, n_embd))
            writer.add_tensor(p + "attn_gate.weight", w(value_dim, n_embd))
            writer.add_tensor(p + "ssm_conv1d.weight", w(2 * key_dim + value_dim, d_conv))
            writer.add_tensor(p + "ssm_dt.bias", np.zeros(n_v_heads, dtype=np.float32))
            writer.add_tensor(p + "ssm_a", -np.exp(rng.uniform(-5, -3, n_v_heads)).astype(np.float32))
            writer.add_tensor(p + "ssm_beta.weight", w(n_v_heads, n_embd))
            writer.add_tensor(p + "ssm_alpha.weight", w(n_v_heads, n_embd, scale=0.05))
            writer.add_tensor(p + "ssm_norm.weight", _ones(d_state))
            writer.add_tensor(p + "ssm_out.weight", w(n_embd, value_dim))
        _add_ffn(writer, p, w, n_embd, n_ff)
    _finish(writer)
    return Path(path)


def write_tiny_lfm2(path: Path, *, n_embd: int = 128, n_layer: int = 4, n_head: int = 4, n_head_kv: int = 2,
                    n_ff: int = 256, n_ctx_train: int = 4096, seed: int = 0, chat_template: str | None = None,
                    l_cache: int = 3) -> Path:
    """A tiny random model of LFM2's architecture (`lfm2`, as the vendored `src/models/lfm2.cpp`
    reads it): short gated convolutions (a recurrent state of their last inputs), every other
    layer attention with Q/K norms; a layer whose `head_count_kv` is 0 is a convolution."""
    rng, w = _draws(seed)
    head_dim = n_embd // n_head

    writer, n_vocab = _hybrid_writer(path, "lfm2", n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_ff=n_ff,
                                     n_ctx_train=n_ctx_train, chat_template=chat_template, extra_specials=())
    attention = [i % 2 == 1 for i in range(n_layer)]
    writer.add_head_count_kv([n_head_kv if a else 0 for a in attention])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_uint32("lfm2.shortconv.l_cache", l_cache)

    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd))
    writer.add_tensor("token_embd_norm.weight", _ones(n_embd))
    writer.add_tensor("output.weight", w(n_vocab, n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", _ones(n_embd))
        writer.add_tensor(p + "ffn_norm.weight", _ones(n_embd))
        if attention[i]:
            writer.add_tensor(p + "attn_q.weight", w(n_embd, n_embd, scale=1.5))
            writer.add_tensor(p + "attn_k.weight", w(n_head_kv * head_dim, n_embd, scale=1.5))
            writer.add_tensor(p + "attn_v.weight", w(n_head_kv * head_dim, n_embd, scale=3.0))
            writer.add_tensor(p + "attn_output.weight", w(n_embd, n_embd))
            writer.add_tensor(p + "attn_q_norm.weight", _ones(head_dim) * 3)
            writer.add_tensor(p + "attn_k_norm.weight", _ones(head_dim) * 3)
        else:
            writer.add_tensor(p + "shortconv.conv.weight", w(n_embd, l_cache))
            writer.add_tensor(p + "shortconv.in_proj.weight", w(3 * n_embd, n_embd, scale=0.2))
            writer.add_tensor(p + "shortconv.out_proj.weight", w(n_embd, n_embd))
        _add_ffn(writer, p, w, n_embd, n_ff)
    _finish(writer)
    return Path(path)


def write_tiny_gemma4(path: Path, *, n_embd: int = 128, n_layer: int = 6, n_head: int = 4, n_head_kv: int = 2,
                      n_ff: int = 256, window: int = 64, shared_kv_layers: int = 2, seed: int = 0,
                      chat_template: str | None = CHATML) -> Path:
    """A tiny random model of Gemma 4's small models' architecture (`gemma4`, as the vendored
    `src/models/gemma4.cpp` reads it): sliding-window and full attention layers, and the last
    `shared_kv_layers` reusing an earlier layer's cache (so the context's state holds fewer layers
    than the model has); SentencePiece's vocabulary."""
    import gguf

    tokens, scores, types = vocab()
    rng, w = _draws(seed)
    head_dim = n_embd // n_head

    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_name("tiny-gemma4")
    writer.add_file_type(0)
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_uint32("gemma4.attention.key_length_swa", head_dim)
    writer.add_uint32("gemma4.attention.value_length_swa", head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(window)
    # Window layers but the last before the shared ones and the last of all: a shared layer reads
    # the last own layer of its kind (`llama-model.cpp`'s reuse for gemma4).
    kv_from = n_layer - shared_kv_layers
    swa = [i not in (kv_from - 1, n_layer - 1) for i in range(n_layer)]
    writer.add_array("gemma4.attention.sliding_window_pattern", swa)
    writer.add_uint32("gemma4.attention.shared_kv_layers", shared_kv_layers)
    writer.add_uint32("gemma4.embedding_length_per_layer_input", 0)
    _add_spm(writer, tokens, scores, types, chat_template)

    writer.add_tensor("token_embd.weight", w(len(tokens), n_embd))
    writer.add_tensor("output_norm.weight", _ones(n_embd))
    writer.add_tensor("rope_freqs.weight", _ones(head_dim // 2))
    for i in range(n_layer):
        p = f"blk.{i}."
        own = i < n_layer - shared_kv_layers  # (the last ones read an earlier layer's cache)
        writer.add_tensor(p + "attn_norm.weight", _ones(n_embd))
        writer.add_tensor(p + "attn_q.weight", w(n_head * head_dim, n_embd, scale=1.5))
        if own:
            writer.add_tensor(p + "attn_k.weight", w(n_head_kv * head_dim, n_embd, scale=1.5))
            writer.add_tensor(p + "attn_v.weight", w(n_head_kv * head_dim, n_embd))
            writer.add_tensor(p + "attn_k_norm.weight", _ones(head_dim) * 3)
        writer.add_tensor(p + "attn_output.weight", w(n_embd, n_head * head_dim))
        writer.add_tensor(p + "attn_q_norm.weight", _ones(head_dim) * 3)
        writer.add_tensor(p + "post_attention_norm.weight", _ones(n_embd))
        writer.add_tensor(p + "ffn_norm.weight", _ones(n_embd))
        _add_ffn(writer, p, w, n_embd, n_ff)
        writer.add_tensor(p + "post_ffw_norm.weight", _ones(n_embd))
    _finish(writer)
    return Path(path)


def write_tiny_plamo2(path: Path, *, n_embd: int = 128, n_layer: int = 2, n_head: int = 4, n_head_kv: int = 2,
                      n_ff: int = 256, n_ctx_train: int = 4096, seed: int = 0, chat_template: str | None = None,
                      d_state: int = 16, n_ssm_heads: int = 4, d_conv: int = 4) -> Path:
    """A tiny random model of PLaMo-2's architecture (`plamo2`, as the vendored
    `src/models/plamo2.cpp` reads it): Mamba blocks (no groups) and attention blocks with a joint
    QKV and Q/K norms, every block with norms after its mixer and its feed-forward; a block whose
    `head_count_kv` is 0 is a Mamba block."""
    rng, w = _draws(seed)
    head_dim = n_embd // n_head
    d_inner = 2 * n_embd
    dt_dim = max(64, n_embd // 16)

    writer, n_vocab = _hybrid_writer(path, "plamo2", n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_ff=n_ff,
                                     n_ctx_train=n_ctx_train, chat_template=chat_template, extra_specials=())
    attention = [i % 2 == 1 for i in range(n_layer)]
    writer.add_head_count_kv([n_head_kv if a else 0 for a in attention])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(n_ssm_heads)
    writer.add_ssm_group_count(0)

    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", _ones(n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", _ones(n_embd))
        writer.add_tensor(p + "post_attention_norm", _ones(n_embd))
        writer.add_tensor(p + "ffn_norm.weight", _ones(n_embd))
        writer.add_tensor(p + "post_ffw_norm", _ones(n_embd))
        if attention[i]:
            writer.add_tensor(p + "attn_qkv.weight", w((n_head + 2 * n_head_kv) * head_dim, n_embd, scale=1.5))
            writer.add_tensor(p + "attn_q_norm.weight", _ones(head_dim * n_head).reshape(n_head, head_dim) * 3)
            writer.add_tensor(p + "attn_k_norm.weight", _ones(head_dim * n_head_kv).reshape(n_head_kv, head_dim) * 3)
            writer.add_tensor(p + "attn_output.weight", w(n_embd, n_head * head_dim))
        else:
            writer.add_tensor(p + "ssm_in.weight", w(2 * d_inner, n_embd))
            writer.add_tensor(p + "ssm_conv1d.weight", w(d_inner, d_conv))
            writer.add_tensor(p + "ssm_x.weight", w(dt_dim + 2 * d_state, d_inner))
            writer.add_tensor(p + "ssm_dt.weight", w(n_ssm_heads, dt_dim))
            writer.add_tensor(p + "ssm_dt.bias", np.zeros(n_ssm_heads, dtype=np.float32))
            writer.add_tensor(p + "ssm_a", -np.exp(rng.uniform(-5, -3, n_ssm_heads)).astype(np.float32))
            writer.add_tensor(p + "ssm_d", _ones(n_ssm_heads))
            writer.add_tensor(p + "ssm_out.weight", w(n_embd, d_inner))
            writer.add_tensor(p + "ssm_dt_norm", _ones(dt_dim))
            writer.add_tensor(p + "ssm_b_norm", _ones(d_state))
            writer.add_tensor(p + "ssm_c_norm", _ones(d_state))
        writer.add_tensor(p + "ffn_up.weight", w(2 * n_ff, n_embd))
        writer.add_tensor(p + "ffn_down.weight", w(n_embd, n_ff))
    _finish(writer)
    return Path(path)


def write_tiny_mamba(path: Path, *, n_embd: int = 64, n_layer: int = 2, n_ctx_train: int = 4096, seed: int = 0,
                     chat_template: str | None = None, d_state: int = 16, d_conv: int = 4) -> Path:
    """A tiny random model of Mamba's architecture (`mamba`, as the vendored `src/models/mamba.cpp`
    reads it): a recurrent state in every block and no attention cache at all (a recurrent model,
    not a hybrid)."""
    _, w = _draws(seed)
    d_inner = 2 * n_embd  # (the one expansion llama.cpp reads)
    dt_rank = max(1, n_embd // 16)
    writer, n_vocab = _hybrid_writer(path, "mamba", n_embd=n_embd, n_layer=n_layer, n_head=0, n_ff=0,
                                     n_ctx_train=n_ctx_train, chat_template=chat_template, extra_specials=())
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(dt_rank)
    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", _ones(n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", _ones(n_embd))
        writer.add_tensor(p + "ssm_in.weight", w(2 * d_inner, n_embd))
        writer.add_tensor(p + "ssm_conv1d.weight", w(d_inner, d_conv))
        writer.add_tensor(p + "ssm_conv1d.bias", np.zeros(d_inner, dtype=np.float32))
        writer.add_tensor(p + "ssm_x.weight", w(dt_rank + 2 * d_state, d_inner))
        writer.add_tensor(p + "ssm_dt.weight", w(d_inner, dt_rank))
        writer.add_tensor(p + "ssm_dt.bias", np.zeros(d_inner, dtype=np.float32))
        writer.add_tensor(p + "ssm_a", -np.exp(w(d_inner, d_state, scale=0.3)))
        writer.add_tensor(p + "ssm_d", _ones(d_inner))
        writer.add_tensor(p + "ssm_out.weight", w(n_embd, d_inner))
    _finish(writer)
    return Path(path)
