"""GPT language models: Par4D's Table I presets, GPT-175B, and custom sizes. Unit `llm`.

Par4D trains GPT-3-style transformers with Megatron-LM's code on Perlmutter, so the
architecture is Megatron's GPT: 4h GELU MLP with biases, learned absolute position
embeddings (one per token of the sequence), and the output layer tied to the input
embedding. Vocabulary 51200: GPT-2's 50257 BPE tokens padded to a multiple of 1024 as
Megatron does. Sequence length 2048 (Par4D §V-A: batches of 4M tokens of 2048).
"""
from __future__ import annotations

from src.errors import ConfigError
from src.models.blocks import DecoderPreset, decoder_unit
from src.models.options import Options, divisible
from src.models.spec import ModelSpec

GPT_VOCAB = 51200
GPT_SEQ_LEN = 2048

GPT_PRESETS: dict[str, DecoderPreset] = {
    # Par4D Table I: layers, hidden, heads
    "gpt_5b": DecoderPreset(24, 4096, 32, GPT_VOCAB),
    "gpt_10b": DecoderPreset(32, 5120, 40, GPT_VOCAB),
    "gpt_20b": DecoderPreset(32, 7168, 56, GPT_VOCAB),
    "gpt_40b": DecoderPreset(38, 9216, 72, GPT_VOCAB),
    "gpt_80b": DecoderPreset(42, 12288, 96, GPT_VOCAB),
    # GPT-3 175B (Brown et al. 2020, Table 2.1), also Optimus Table 9
    "gpt_175b": DecoderPreset(96, 12288, 96, GPT_VOCAB),
}
DEFAULT_PRESET = "gpt_5b"
GPT_DEFAULT_BATCH = 2048  # Par4D §VI: batches of 4M tokens = 2048 sequences of 2048
CUSTOM_KEYS = ("layers", "hidden", "heads", "vocab")


def build_gpt(opts: Options, seq_len: int | None) -> ModelSpec:
    name = opts.preset("preset", GPT_PRESETS, DEFAULT_PRESET)
    base = None if name is None else GPT_PRESETS[name]
    missing = [key for key in CUSTOM_KEYS if base is None and opts.raw(key) is None]
    if missing:
        raise ConfigError(f"model.preset=null needs a custom size: set model.{', model.'.join(missing)} "
                          f"(or a preset: {', '.join(GPT_PRESETS)})")
    # Each of the four overrides the preset's value.
    layers, hidden, heads, vocab = (opts.positive_int(key, None if base is None else getattr(base, key))
                                    for key in CUSTOM_KEYS)
    divisible(opts, "hidden", hidden, opts.key("heads"), heads)
    preset = DecoderPreset(layers, hidden, heads, vocab)
    seq = GPT_SEQ_LEN if seq_len is None else seq_len
    unit = decoder_unit(preset, seq, output_elems=0)
    return ModelSpec(
        name="gpt", units=(unit,),
        default_global_batch=GPT_DEFAULT_BATCH,
        description=f"GPT ({name or 'custom'}): {preset.layers} layers, hidden {preset.hidden}, "
                    f"{preset.heads} heads, vocab {preset.vocab}, seq {seq}",
        extras={"preset": name},
    )
