"""GPT and Llama language models: Par4D's Table I presets, GPT-175B, Llama 3, custom sizes. Unit `llm`.

Par4D trains GPT-3-style transformers with Megatron-LM's code on Perlmutter, so the
architecture is Megatron's GPT: 4h GELU MLP with biases, learned absolute position
embeddings (one per token of the sequence), and the output layer tied to the input
embedding. Vocabulary 51200: GPT-2's 50257 BPE tokens padded to a multiple of 1024 as
Megatron does. Sequence length 2048 (Par4D §V-A: batches of 4M tokens of 2048).

model.style=llama switches to Llama's block (blocks.DecoderPreset): RMSNorm, no biases,
SwiGLU MLP of width model.ffn, RoPE, untied output, grouped-query attention with
model.kv_heads. The Llama 3 presets default to its 8192-token pre-training sequences.
"""

from __future__ import annotations

from src.bounds import MAX_LAYERS, MAX_SIZE
from src.errors import ConfigError
from src.models.blocks import DecoderPreset, decoder_unit
from src.models.options import Options, divisible
from src.models.spec import ModelSpec

GPT_VOCAB = 51200
GPT_SEQ_LEN = 2048
LLAMA3_VOCAB = 128256

GPT_PRESETS: dict[str, DecoderPreset] = {
    # Par4D Table I: layers, hidden, heads
    "gpt_5b": DecoderPreset(24, 4096, 32, GPT_VOCAB),
    "gpt_10b": DecoderPreset(32, 5120, 40, GPT_VOCAB),
    "gpt_20b": DecoderPreset(32, 7168, 56, GPT_VOCAB),
    "gpt_40b": DecoderPreset(38, 9216, 72, GPT_VOCAB),
    "gpt_80b": DecoderPreset(42, 12288, 96, GPT_VOCAB),
    # GPT-3 175B (Brown et al. 2020, Table 2.1), also Optimus Table 9
    "gpt_175b": DecoderPreset(96, 12288, 96, GPT_VOCAB),
    # Llama 3 (Grattafiori et al., "The Llama 3 Herd of Models", 2024, Table 3; Meta's
    # model cards): layers, hidden, heads, 8 KV heads, FFN width, vocabulary 128256.
    # Parameters: 8.03B, 70.6B, 405.9B (tests/models/test_llm_models.py checks our counts).
    "llama3_8b": DecoderPreset(32, 4096, 32, LLAMA3_VOCAB, "llama", ffn=14336, kv_heads=8),
    "llama3_70b": DecoderPreset(80, 8192, 64, LLAMA3_VOCAB, "llama", ffn=28672, kv_heads=8),
    "llama3_405b": DecoderPreset(126, 16384, 128, LLAMA3_VOCAB, "llama", ffn=53248, kv_heads=8),
}
# Llama 3 pre-trains on 8192-token sequences (same paper, §3.4.1).
PRESET_SEQ_LEN = {"llama3_8b": 8192, "llama3_70b": 8192, "llama3_405b": 8192}
STYLES = ("gpt", "llama")
DEFAULT_PRESET = "gpt_5b"
GPT_DEFAULT_BATCH = 2048  # Par4D §VI: batches of 4M tokens = 2048 sequences of 2048
CUSTOM_KEYS = ("layers", "hidden", "heads", "vocab")


def build_gpt(opts: Options, seq_len: int | None) -> ModelSpec:
    name = opts.preset("preset", GPT_PRESETS, DEFAULT_PRESET)
    base = None if name is None else GPT_PRESETS[name]
    missing = [key for key in CUSTOM_KEYS if base is None and opts.raw(key) is None]
    if missing:
        raise ConfigError(
            f"model.preset=null needs a custom size: set model.{', model.'.join(missing)} (or a preset: {', '.join(GPT_PRESETS)})"
        )
    # Each key overrides the preset's value.
    layers, hidden, heads, vocab = (
        opts.positive_int(key, None if base is None else getattr(base, key), MAX_LAYERS if key == "layers" else MAX_SIZE)
        for key in CUSTOM_KEYS
    )
    style = opts.choice("style", STYLES, "gpt" if base is None else base.style)
    ffn = opts.positive_int("ffn", 4 * hidden if base is None or base.ffn is None else base.ffn)
    kv_heads = opts.positive_int("kv_heads", heads if base is None or base.kv_heads is None else base.kv_heads)
    divisible(opts, "hidden", hidden, opts.key("heads"), heads)
    divisible(opts, "heads", heads, opts.key("kv_heads"), kv_heads)
    preset = DecoderPreset(layers, hidden, heads, vocab, "llama" if style == "llama" else "gpt", ffn, kv_heads)
    seq = seq_len or PRESET_SEQ_LEN.get(name or "", GPT_SEQ_LEN)
    unit = decoder_unit(preset, seq, output_elems=0, dropout=opts.optional_flag("dropout"))
    return ModelSpec(
        name="gpt",
        units=(unit,),
        default_global_batch=GPT_DEFAULT_BATCH,
        description=f"{style} ({name or 'custom'}): {preset.layers} layers, hidden {preset.hidden}, "
        f"{preset.heads} heads ({kv_heads} KV), FFN {ffn}, vocab {preset.vocab}, seq {seq}",
        extras={"preset": name},
    )
