"""Builders for the layers every model family is made of, counted per sample.

Activations are 16-bit (2 bytes); memory-bound kernels are charged the bytes they read and
write. Activation bytes follow Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models" (2022): 34·s·h + 5·a·s² bytes per layer for a GPT block, of which
10·s·h are replicated across TP ranks, 24·s·h are split, 5·a·s² are attention scores.
Under FlashAttention (src/models/attention.py) the scores are never stored: a block keeps
fp32 softmax statistics (a log-sum-exp per head and query, FLASH_STATS_BYTES each) instead.
"""

from __future__ import annotations

from dataclasses import replace

from src.models.cross_entropy import SAVED_BYTES, eager_loss
from src.models.spec import ActivationBytes, Kernel, LayerSpec, TPSplit

ACT_BYTES = 2  # bf16/fp16 activations
FLASH_STATS_BYTES = 4  # FlashAttention's fp32 log-sum-exp per head and query row


def gemm(
    name: str,
    m: int,
    k: int,
    n: int,
    split: TPSplit,
    weight: bool = True,
    batch: int = 1,
    core: bool = False,
    scores: bool = False,
    bias: bool = False,
) -> Kernel:
    """An (m x k) @ (k x n) product, `batch` times; `weight` = a trainable weight operand,
    `bias` = one added to its output (its gradient: the output's gradient summed over the
    m rows, a reduction kernel of its own in eager PyTorch)."""
    return Kernel(
        name,
        "gemm",
        m=m,
        n=n,
        k=k,
        batch=batch,
        tp_split=split,
        has_weight=weight,
        attention_core=core,
        attention_scores=scores,
        grad_reduction_bytes=ACT_BYTES * m * n * batch if bias and weight else 0.0,
    )


def memory(
    name: str,
    elems: float,
    split: TPSplit = "none",
    passes: int = 2,
    core: bool = False,
    scores: bool = False,
    norm: int = 0,
    op: str = "",
) -> Kernel:
    """A bandwidth-bound kernel reading and writing `elems` 16-bit values (`passes` moves);
    `norm`: a normalisation of that width (its parameters a module of their own, whose
    gradients a second backward kernel reduces from the output's gradient and the input);
    `op`: the operation it fuses, which software may run unfused (Kernel.elementwise)."""
    return Kernel(
        name,
        "memory",
        bytes=elems * ACT_BYTES * passes,
        tp_split=split,
        attention_core=core,
        attention_scores=scores,
        norm_width=norm,
        grad_reduction_bytes=2 * ACT_BYTES * elems if norm else 0.0,
        elementwise=op,
    )


def residual(name: str, elems: float) -> Kernel:
    """A residual add of `elems` values: reads the stream and a block's output, writes the stream."""
    return replace(memory(name, 1.5 * elems), residual=True)


def _attention(
    prefix: str,
    seq: int,
    kv_seq: int,
    hidden: int,
    heads: int,
    kv_dim: int,
    kv_hidden: int,
    self_attention: bool,
    dropout: bool,
    bias: bool,
    rotary: bool = False,
) -> list[Kernel]:
    head_dim = hidden // heads
    scores = heads * seq * kv_seq
    if self_attention:
        projections = [gemm(f"{prefix}qkv", seq, hidden, hidden + 2 * kv_dim, "n", bias=bias)]
        if rotary:
            projections += [_rotary(f"{prefix}rope_q", seq * hidden), _rotary(f"{prefix}rope_k", seq * kv_dim)]
    else:
        projections = [
            gemm(f"{prefix}q", seq, hidden, hidden, "n", bias=bias),
            gemm(f"{prefix}kv", kv_seq, kv_hidden, 2 * kv_dim, "n", bias=bias),
        ]
    return projections + [
        gemm(f"{prefix}scores", seq, head_dim, kv_seq, "batch", weight=False, batch=heads, core=True, scores=True),
        memory(f"{prefix}softmax", scores, "batch", core=True, scores=True, op="softmax"),
        *([_attention_dropout(prefix, scores)] if dropout else []),
        gemm(f"{prefix}context", seq, kv_seq, head_dim, "batch", weight=False, batch=heads, core=True),
        gemm(f"{prefix}proj", seq, hidden, hidden, "k", bias=bias),
        residual(f"{prefix}residual", seq * hidden),
    ]


def _rotary(name: str, elems: float) -> Kernel:
    """Rotary position embedding of the queries' or the keys' `elems` values, one fused
    kernel each (Megatron-Core's and Transformer Engine's, applied to each in turn): forward
    reads and writes them, backward rotates the gradient back (reads and writes as many)."""
    return Kernel(name, "memory", bytes=2 * ACT_BYTES * elems, tp_split="n", backward_moves=1.0, elementwise="rope")


def _attention_dropout(prefix: str, scores: int) -> Kernel:
    """Dropout of the probabilities (eager: its own kernel): forward reads them and writes
    the output and a one-byte mask, backward reads the gradient and the mask and writes the
    gradient, 5 bytes per score each way (Korthikanti et al.'s as² + 2as²)."""
    return Kernel(
        f"{prefix}dropout",
        "memory",
        bytes=(ACT_BYTES + ACT_BYTES + 1) * scores,
        tp_split="batch",
        attention_core=True,
        attention_scores=True,
        backward_moves=1.0,
        attention_dropout=True,
    )


def transformer_layer(
    seq: int,
    hidden: int,
    heads: int,
    ffn: int | None = None,
    *,
    kv_heads: int | None = None,
    gated: bool = False,
    bias: bool = True,
    cross_seq: int | None = None,
    cross_hidden: int | None = None,
    dropout: bool = False,
    rotary: bool = False,
    name: str = "block",
) -> LayerSpec:
    """A pre-norm transformer block: self-attention, optional cross-attention, MLP.

    gated=True is a gated MLP; kv_heads < heads is grouped-query attention; rotary=True
    rotates the self-attention's queries and keys (RoPE). A block without biases normalises
    by RMSNorm, and a gated one is SwiGLU (Llama): kernels that software may run unfused
    (src/models/elementwise.py), built fused here.
    Causal masking does not change the count (the usual MFU convention counts s² fully).
    dropout=True keeps Korthikanti's dropout masks and attention-dropout output (34sh +
    5as² for a GPT block, Megatron's default) and runs the attention dropout as a kernel of
    its own; without dropout (CLIP, ViT, Llama) a block keeps 32sh + 2as² (the softmax
    output only). The hidden dropouts are fused into the residual adds (Megatron's
    bias-dropout-add); their one-byte masks are left out of those kernels' traffic.
    """
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
    ffn = ffn if ffn is not None else 4 * hidden
    kv_heads = kv_heads or heads
    kv_dim = kv_heads * (hidden // heads)
    up = 2 * ffn if gated else ffn
    b = 1 if bias else 0

    norm_op = "" if bias else "rmsnorm"
    kernels: list[Kernel] = [memory("ln1", seq * hidden, norm=hidden, op=norm_op)]
    kernels += _attention("attn_", seq, seq, hidden, heads, kv_dim, hidden, True, dropout, bias, rotary)
    params = hidden * (hidden + 2 * kv_dim) + b * (hidden + 2 * kv_dim) + hidden * hidden + b * hidden
    norms = 2
    # Two dropout masks (after attention, after the MLP) are replicated; attention dropout
    # adds a mask (as²) and its output (2as²) to the softmax output (2as²).
    mask = 1 if dropout else 0
    replicated = (8 + 2 * mask) * seq * hidden
    split = ACT_BYTES * (2 * seq * hidden + 2 * seq * kv_dim)
    attention = (2 + 3 * mask) * heads * seq * seq
    flash = FLASH_STATS_BYTES * heads * seq
    allreduces = 2

    if cross_seq is not None:
        cross_hidden = cross_hidden or hidden
        kernels.append(memory("ln_cross", seq * hidden, norm=hidden, op=norm_op))
        kernels += _attention("xattn_", seq, cross_seq, hidden, heads, hidden, cross_hidden, False, dropout, bias)
        params += hidden * hidden + cross_hidden * 2 * hidden + hidden * hidden + b * 4 * hidden
        norms += 1
        replicated += (4 + mask) * seq * hidden
        split += ACT_BYTES * (2 * seq * hidden + 2 * cross_seq * hidden)
        attention += (2 + 3 * mask) * heads * seq * cross_seq
        flash += FLASH_STATS_BYTES * heads * seq
        allreduces += 1

    kernels += [
        memory("ln2", seq * hidden, norm=hidden, op=norm_op),
        gemm("fc1", seq, hidden, up, "n", bias=bias),
        memory("act", seq * (up + ffn) / 2, "n", op="swiglu" if gated and not bias else ""),
        gemm("fc2", seq, ffn, hidden, "k", bias=bias),
        residual("mlp_residual", seq * hidden),
    ]
    # A norm's scale, and its shift where the block has biases (LayerNorm); RMSNorm has no shift.
    params += hidden * up + b * up + ffn * hidden + b * hidden + norms * (1 + b) * hidden
    split += ACT_BYTES * (seq * up + seq * ffn)

    return LayerSpec(
        name=name,
        kernels=tuple(kernels),
        params=params,
        activations=ActivationBytes(
            replicated=replicated, split=split, attention=attention, checkpoint=ACT_BYTES * seq * hidden, flash_attention=flash
        ),
        tp_allreduces=allreduces,
        tp_comm_elems=seq * hidden,
        block=True,
    )


def embedding_layer(vocab: int, hidden: int, seq: int, positions: int = 0, name: str = "embedding") -> LayerSpec:
    """Token (and learned position) embedding: a lookup, no matmul FLOPs."""
    return LayerSpec(
        name=name,
        kernels=(replace(memory("lookup", seq * hidden, "none", passes=1), table=vocab * hidden + positions * hidden),),
        params=vocab * hidden + positions * hidden,
        activations=ActivationBytes(replicated=ACT_BYTES * seq * hidden, checkpoint=ACT_BYTES * seq * hidden),
    )


def patch_embedding_layer(
    image: int, patch: int, hidden: int, channels: int = 3, cls_token: bool = True, name: str = "patch_embedding"
) -> LayerSpec:
    """ViT patchify: a (patches x c·p²) @ (c·p² x h) GEMM plus position embeddings."""
    patches = (image // patch) ** 2
    tokens = patches + (1 if cls_token else 0)
    return LayerSpec(
        name=name,
        kernels=(gemm("patchify", patches, channels * patch * patch, hidden, "none", bias=True),),
        params=channels * patch * patch * hidden + hidden + tokens * hidden + (hidden if cls_token else 0),
        activations=ActivationBytes(replicated=ACT_BYTES * channels * image * image, checkpoint=ACT_BYTES * tokens * hidden),
    )


def head_layer(
    seq: int,
    hidden: int,
    out: int,
    *,
    tied: bool = False,
    norm: bool = True,
    norm_shift: bool = True,
    loss_elems: int | None = None,
    name: str = "head",
) -> LayerSpec:
    """Final norm and an output projection (LM logits or a feature projection).

    tied=True shares the weight with the embedding: FLOPs count, parameters do not.
    norm_shift=False is a final norm of a scale alone (RMSNorm).
    The loss is PyTorch's cross entropy (src/models/cross_entropy.py sets other software's),
    its saved 16-bit log-probabilities charged as activations split by TP (vocab-parallel).
    """
    loss_elems = seq * out if loss_elems is None else loss_elems
    final_norm = memory("final_norm", seq * hidden, norm=hidden, op="" if norm_shift else "rmsnorm")
    kernels = ([final_norm] if norm else []) + [
        gemm("projection", seq, hidden, out, "n"),
        eager_loss(loss_elems, out),
    ]
    return LayerSpec(
        name=name,
        kernels=tuple(kernels),
        params=(0 if tied else hidden * out) + ((2 if norm_shift else 1) * hidden if norm else 0),
        activations=ActivationBytes(
            replicated=ACT_BYTES * seq * hidden, split=SAVED_BYTES["eager"] * loss_elems, checkpoint=ACT_BYTES * seq * hidden
        ),
    )


def contrastive_layer(embed_dim: int, name: str = "contrastive") -> LayerSpec:
    """The contrastive loss over a batch: similarity of each local sample's embedding with
    every embedding of the other modality in the contrastive batch, then softmax-CE."""
    return LayerSpec(
        name=name,
        kernels=(
            Kernel("similarity", "gemm", m=1, n=0, k=embed_dim, tp_split="none", n_contrastive=True),
            Kernel("softmax_ce", "memory", bytes=0.0),
        ),
        params=1,  # the learned temperature
        activations=ActivationBytes(split=ACT_BYTES * embed_dim, checkpoint=ACT_BYTES * embed_dim),
    )
