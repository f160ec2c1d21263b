"""A tiny random llama GGUF, written in milliseconds, for fast exact tests on the real engine."""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WORDS = ["the", "a", "of", "and", "to", "in", "is", "it", "that", "sky", "blue", "Paris", "hello", "world"]


def vocab() -> tuple[list[str], list[float], list[int]]:
    tokens, scores, types = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"], [0.0] * 5, [2, 3, 3, 3, 3]
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
    return tokens, scores, types


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
) -> Path:
    import gguf

    tokens, scores, types = vocab()
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), architecture)
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
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(4)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

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
