"""What is trained: units made of layers made of kernels, all counted per sample.

A ModelSpec is pure data. The cost model prices its kernels, the memory model reads its
parameter and activation counts, and metrics count its matmul FLOPs. Every count here is
for ONE sample (one image, one text sequence, one 8K-token LLM sequence) and one forward
pass; the micro-batch size and the tensor-parallel degree are applied by the consumers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from src.mesh import Sharding

KernelKind = Literal["gemm", "memory"]
TPSplit = Literal["n", "k", "batch", "none"]
Pairing = tuple[Literal["fwd", "bwd"], int]  # a pass and a kernel's index: a GEMM a TP transfer runs beside (LayerSpec.tp_pairs)


PER_IMAGE = "sequence's images"  # the per_sample convention (ModelSpec.extras) of a unit that works per image


@dataclass(frozen=True)
class Kernel:
    """One kernel of a layer's forward pass, for one sample.

    gemm: an (m x k) @ (k x n) product repeated `batch` times (attention heads).
      `m` is rows per sample (tokens); `n_contrastive=True` means n is the contrastive
      batch seen by the loss (a similarity matrix), supplied when the kernel is priced.
    memory: a bandwidth-bound kernel moving `bytes` per sample (normalisation, softmax,
      activations, residual adds), forward.
    tp_split: which dimension tensor parallelism divides ('n' column-parallel, 'k'
      row-parallel, 'batch' heads, 'none' replicated on every TP rank).
    has_weight: the product involves a trainable weight, so backward has a weight-gradient
      GEMM besides the input-gradient GEMM (a frozen unit skips the former).
    attention_core: part of softmax(QK^T)V, whose activations selective recomputation
      drops and whose forward it re-runs in backward.
    attention_scores: computes or normalises the s x s scores (QK^T, softmax), the tensors
      FlashAttention keeps in on-chip memory (src/models/attention.py).
    backward_recompute: backward re-runs this kernel's forward (FlashAttention's QK^T).
    flash_kernel: the FlashAttention version whose measured rate prices this product of its
      core (flash1 | flash2: the preset's attention_measurements); empty: the GEMM curve.
    skip_projection: projects the layer's input onto its output's channels and is added to
      the output (a residual block's 1x1 skip conv): it reads what the layer's first FC
      reads, not the previous kernel's output.
    reads_embedding: reads a per-sample embedding another layer computed (a residual
      block's projection of the timestep embedding), not the layer's feature map.
    norm_width: a normalisation's width: its scale and shift, `norm_width` parameters
      each, are a module of their own (which ZeRO-3 fetches as it fetches a weight).
    backward_moves: a memory-bound kernel's backward bytes over its forward's (2 by default,
      for a backward that reads the saved input and the output gradient and writes the
      input gradient; 1 for a dropout, whose backward moves what its forward did).
    attention_dropout: the dropout of the attention probabilities, its own kernel in eager
      attention; FlashAttention applies it inside its kernel (src/models/attention.py).
    residual: a residual add: it reads the residual stream and a block's output and writes
      the stream (which PyTorch AMP keeps in fp32).
    grad_reduction_bytes: what a kernel of its own reads in backward to reduce this kernel's
      parameter gradients over the rows, per sample: a bias's output gradient (a GEMM's
      m x n), a normalisation's output gradient and input (its scale's and shift's
      gradients); 0 where there are none or the framework folds them into another kernel
      (src/models/grad_kernels.py). Part of the weight gradient.
    cross_entropy: the loss over a vocabulary's logits, computed as this mode says
      (src/models/cross_entropy.py); empty for every other kernel.
    vocab: the loss's row, a token's logits (its vocabulary), which tensor parallelism splits
      as it splits the head's columns: whether PyTorch's softmax keeps a row on chip.
    accumulation: how a weighted product's weight gradient joins the step's accumulated one in a
      pass of its own, every micro-batch: hook (added into it) or cast (cast to fp32 and added
      into an fp32 copy) (src/models/grad_accumulation.py); empty where the GEMM accumulates it.
    table: a lookup's table entries (rows x width, all of the layer's tables): its backward
      writes the table's dense gradient (zero-filled, then the looked-up rows added: PyTorch's
      embedding backward), which the framework adds into the step's accumulated gradient,
      every micro-batch whatever model.grad_accumulation says (no GEMM accumulates it).
    elementwise: an operation that software runs fused or as PyTorch's separate kernels
      (a Llama block's rmsnorm | rope | swiglu, eager attention's softmax:
      src/models/elementwise.py); empty for every other kernel.
    launches: the kernels a memory-bound kernel's forward launches (an unfused operation's;
      its bytes are all of theirs); backward_launches: its backward's where autograd runs
      another count (0: as many).
    batch_transpose: copies tensors between the [s, b] and [b, s] layouts, which moves
      nothing where a micro-batch holds one sample: the transposed tensor is contiguous
      already, and `.contiguous()` returns it (src/models/attention_copies.py).
    """

    name: str
    kind: KernelKind
    m: int = 0
    n: int = 0
    k: int = 0
    batch: int = 1
    bytes: float = 0.0
    tp_split: TPSplit = "none"
    has_weight: bool = False
    n_contrastive: bool = False
    attention_core: bool = False
    attention_scores: bool = False
    backward_recompute: bool = False
    flash_kernel: str = ""
    skip_projection: bool = False
    reads_embedding: bool = False
    norm_width: int = 0
    backward_moves: float = 2.0
    attention_dropout: bool = False
    residual: bool = False
    grad_reduction_bytes: float = 0.0
    cross_entropy: str = ""
    vocab: int = 0
    accumulation: str = ""
    table: float = 0.0
    elementwise: str = ""
    launches: int = 1
    backward_launches: int = 0
    batch_transpose: bool = False

    def flops(self, contrastive_batch: int = 1) -> float:
        """Forward FLOPs for one sample (0 for memory-bound kernels)."""
        if self.kind != "gemm":
            return 0.0
        n = contrastive_batch if self.n_contrastive else self.n
        return 2.0 * self.m * n * self.k * self.batch


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes one sample leaves in memory for the backward pass of one layer.

    Split as in Korthikanti et al. (2022) so TP, sequence parallelism and recomputation can
    be applied: `replicated` is held whole by every TP rank (sharded by sequence
    parallelism), `split` is divided by TP, `attention` is what the attention core keeps
    (divided by TP, dropped by selective recompute) and `checkpoint` is what full
    recompute keeps. `attention` is the s^2 score tensors of eager attention; `flash_attention`
    is what FlashAttention keeps instead (fp32 softmax statistics, O(s)), which
    src/models/attention.py moves into `attention` when a model runs it.
    """

    replicated: float = 0.0
    split: float = 0.0
    attention: float = 0.0
    checkpoint: float = 0.0
    flash_attention: float = 0.0

    def per_device(self, sharding: Sharding, recompute: str) -> float:
        """Bytes one device keeps under `sharding` (Megatron TP: `replicated` is divided
        only under sequence parallelism)."""
        replicated_div, split_div = sharding.activation_divisors()
        if recompute == "full":
            return self.checkpoint / replicated_div
        attention = 0.0 if recompute == "selective" else self.attention / split_div
        return self.replicated / replicated_div + self.split / split_div + attention


@dataclass(frozen=True)
class LayerSpec:
    """One layer: its kernels, parameters, activations and TP communication.

    tp_allreduces: how many activation all-reduces Megatron-style TP needs in the forward
    pass (2 for a transformer block: after attention and after the MLP), each of
    `tp_comm_elems` elements per sample; backward has as many (`tp_collectives`).
    forward_only: a frozen feature extractor of the unit's raw input (SD's VAE encoder
    inside the generator): no backward at all, no gradients or optimizer state, no
    activations kept.
    frozen: its weights do not train (no weight gradient, no optimizer state) while other
    layers of its unit do (a frozen ViT under a trained projector); an input gradient
    still flows through it to any trained layer before it.
    block: a transformer or residual block, what full recomputation checkpoints: it keeps
    its input only and re-runs its forward in backward. The layers around a model's blocks
    (an embedding, a projector, a U-Net's first and last convolutions, a head and its loss)
    keep their activations and run once, as the frameworks checkpoint (Megatron-LM's
    checkpointed forward covers its transformer layers, the embedding, final norm, output
    layer and loss outside it; DeepSpeed's GPT2ModelPipe checkpoints its
    ParallelTransformerLayerPipe layers only; improved-diffusion its ResBlocks and
    AttentionBlocks; PyTorch users wrap blocks in torch.utils.checkpoint).
    """

    name: str
    kernels: tuple[Kernel, ...]
    params: int
    activations: ActivationBytes
    tp_allreduces: int = 0
    tp_comm_elems: int = 0
    forward_only: bool = False
    frozen: bool = False
    block: bool = False

    def matmul_flops(self, contrastive_batch: int = 1) -> float:
        return sum(kern.flops(contrastive_batch) for kern in self.kernels)

    def recompute_mode(self, mode: str) -> str:
        """The unit's recomputation `mode` as it applies to this layer: full recomputation
        re-runs the blocks only (`block`)."""
        return "none" if mode == "full" and not self.block else mode

    def kept_activations(self, sharding: Sharding, recompute: str) -> float:
        """Bytes of one sample this layer keeps for its backward on one device under the
        unit's recomputation mode."""
        return self.activations.per_device(sharding, self.recompute_mode(recompute))

    def tp_collectives(self, backward: bool, recompute: str) -> int:
        """The TP activation all-reduces of one pass of this layer. A backward under full
        recompute runs the forward again first, its all-reduces included (Megatron-LM's
        tensor_parallel.checkpoint and torch.utils.checkpoint re-run the layer's whole
        forward, collectives and all), then its own; selective recompute re-runs only
        the attention core, which holds none."""
        if backward and self.recompute_mode(recompute) == "full":
            return 2 * self.tp_allreduces
        return self.tp_allreduces

    def tp_pairs(self, backward: bool, recompute: str, sequence_parallel: bool) -> tuple[tuple[Pairing, ...], ...] | None:
        """StepCCL's pairs (DistTrain §7: each collective cut into chunks beside the GEMM it
        feeds or follows) of one pass: for each TP collective `tp_collectives` counts, in
        order, the (pass, kernel index) of the weighted GEMMs its transfer runs beside,
        the transfer split evenly among them. An all-reduce follows a row-parallel product
        in forward and a column-parallel one's input gradient in backward; under sequence
        parallelism it is a reduce-scatter after the row-parallel product and an all-gather
        before the next column-parallel one (forward), an all-gather before the row-parallel
        product's backward and a reduce-scatter after the column-parallel one's (backward).
        A fully recomputed backward runs its forward's pairs first. None where the layer's
        row- and column-parallel products are not one each per collective (cross-attention's
        memory projection, a convolution)."""
        rows = [i for i, kern in enumerate(self.kernels) if kern.kind == "gemm" and kern.has_weight and kern.tp_split == "k"]
        cols = [i for i, kern in enumerate(self.kernels) if kern.kind == "gemm" and kern.has_weight and kern.tp_split == "n"]
        count = self.tp_allreduces
        if not count or len(rows) != count or len(cols) != count:
            return None
        forward: tuple[tuple[Pairing, ...], ...]
        own: tuple[tuple[Pairing, ...], ...]
        if sequence_parallel:
            forward = tuple((("fwd", rows[i]), ("fwd", cols[(i + 1) % count])) for i in range(count))
            own = tuple((("bwd", rows[i]), ("bwd", cols[i])) for i in range(count))
        else:
            forward = tuple((("fwd", rows[i]),) for i in range(count))
            own = tuple((("bwd", cols[i]),) for i in range(count))
        if not backward:
            return forward
        return (forward + own) if self.recompute_mode(recompute) == "full" else own

    def fetched_modules(self, persistence_threshold: float) -> tuple[int, ...]:
        """Parameters of each module ZeRO-3 fetches to run this layer, in forward order:
        a weight (its bias rides with it) or a normalisation whose tensors exceed
        `persistence_threshold` elements (DeepSpeed's stage3_param_persistence_threshold:
        smaller ones stay whole on every rank). A layer of no weighted product (a lookup
        table) is one module."""
        if not any(kern.has_weight for kern in self.kernels):
            return (self.params,) if self.params > persistence_threshold else ()
        modules = []
        for kern in self.kernels:
            if kern.has_weight and kern.k * kern.n > persistence_threshold:
                modules.append(kern.k * kern.n)
            elif kern.norm_width > persistence_threshold:
                modules.append(2 * kern.norm_width)
        return tuple(modules)


@dataclass(frozen=True)
class Architecture:
    """What a unit is, as its model's builder states it: what the real backend builds the
    unit's modules and its data from (its kernels price the same shapes; nothing reads
    these numbers back off them).

    image_size, patch_size: a ViT's input images' side in pixels and its patches' (0: the
      unit reads no images). A U-Net's image_size is the side of the images it learns to
      generate, latent_size the side it denoises at (0: the images themselves).
    images: images per sample (an MLLM's per sequence).
    vocab: the vocabulary of a unit that embeds or predicts tokens (0: none).
    style: its transformer blocks': 'gpt' (LayerNorm, GELU MLP) or 'llama' (RMSNorm, no
      biases, SwiGLU MLP of width `ffn`, rotary positions, `kv_heads` key/value heads).
    image_tokens: a sample's tokens that come from images (an MLLM LLM's, its encoders').
    """

    image_size: int = 0
    patch_size: int = 0
    latent_size: int = 0
    images: int = 1
    vocab: int = 0
    style: Literal["gpt", "llama"] = "gpt"
    ffn: int = 0
    kv_heads: int = 0
    image_tokens: int = 0

    @property
    def reads_images(self) -> bool:
        """A ViT: patches of images (it attends both ways)."""
        return self.patch_size > 0

    @property
    def per_image(self) -> bool:
        """Its work is its images', `images` of them a sample: it reads them (a ViT) or
        generates them (a U-Net). An LLM whose sequence holds image tokens is not: its
        sequence's length is the same whatever they are."""
        return self.image_size > 0


@dataclass(frozen=True)
class UnitSpec:
    """A separately parallelisable part of a model: a tower, a backbone, a generator.

    `layers` may repeat the same LayerSpec object; consumers cache by identity.
    `output_elems` is the per-sample size of what the unit hands to the next unit (or to
    the interaction); `seq_len` its tokens per sample; `heads` bounds its TP degree;
    `arch` what the real backend builds its modules and data from.
    """

    name: str
    layers: tuple[LayerSpec, ...]
    hidden: int
    heads: int
    seq_len: int
    output_elems: int
    frozen: bool = False
    kind: str = "transformer"
    arch: Architecture = Architecture()

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    def trainable_params(self, start: int = 0, end: int | None = None) -> int:
        """Parameters of layers [start, end) that receive gradients."""
        if self.frozen:
            return 0
        return sum(layer.params for layer in self.layers[start:end] if self.trains(layer))

    def trains(self, layer: LayerSpec) -> bool:
        """Whether a layer of this unit computes weight gradients."""
        return not (self.frozen or layer.forward_only or layer.frozen)

    def first_trained_layer(self) -> int:
        """Index of the unit's first layer whose weights train (num_layers if none)."""
        return next((i for i, layer in enumerate(self.layers) if self.trains(layer)), self.num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def matmul_flops(self, contrastive_batch: int = 1) -> float:
        return sum(layer.matmul_flops(contrastive_batch) for layer in self.layers)


@dataclass(frozen=True)
class ModelSpec:
    """A whole model: its units and which unit feeds which.

    `flows` lists (producer, consumer) pairs. `interaction` names the unit that sees every
    modality at once (a contrastive loss), if any: it needs the contrastive batch.
    `default_global_batch`: the batch a run uses when train.global_batch is null; each
    family says where its value comes from.
    """

    name: str
    units: tuple[UnitSpec, ...]
    flows: tuple[tuple[str, str], ...] = ()
    interaction: str | None = None
    description: str = ""
    default_global_batch: int | None = None
    extras: dict = field(default_factory=dict, compare=False, hash=False)

    def map_layers(self, change: Callable[[LayerSpec], LayerSpec]) -> ModelSpec:
        """The model with `change` applied to every layer; a layer repeated in it (one
        object in several places) stays one object, as consumers cache by identity."""
        made: dict[int, LayerSpec] = {}
        units = tuple(
            replace(unit, layers=tuple(made.setdefault(id(layer), change(layer)) for layer in unit.layers)) for unit in self.units
        )
        return replace(self, units=units)

    def map_kernels(self, change: Callable[[Kernel], Kernel]) -> ModelSpec:
        """The model with `change` applied to every layer's kernels; a layer none of whose
        kernels it changes stays the same object (map_layers keeps repeated layers one)."""

        def changed(layer: LayerSpec) -> LayerSpec:
            kernels = tuple(change(kernel) for kernel in layer.kernels)
            return layer if all(a is b for a, b in zip(kernels, layer.kernels)) else replace(layer, kernels=kernels)

        return self.map_layers(changed)

    def unit(self, name: str) -> UnitSpec:
        for unit in self.units:
            if unit.name == name:
                return unit
        raise KeyError(f"model {self.name} has no unit {name!r}; units: {[u.name for u in self.units]}")

    def per_image_units(self) -> list[str]:
        """The units whose work is a sequence's images (extras' per_sample says PER_IMAGE):
        an MLLM's encoder and generator, an Optimus MLLM's encoders, in the model's order."""
        per_sample = self.extras.get("per_sample", {})
        return [u.name for u in self.units if per_sample.get(u.name) == PER_IMAGE]

    @property
    def params(self) -> int:
        return sum(unit.params for unit in self.units)

    def upstream(self, name: str) -> list[str]:
        """Every unit whose output reaches `name`, directly or not."""
        seen: list[str] = []
        frontier = [name]
        while frontier:
            current = frontier.pop()
            for producer, consumer in self.flows:
                if consumer == current and producer not in seen:
                    seen.append(producer)
                    frontier.append(producer)
        return seen

    def needs_backward(self, name: str) -> bool:
        """A unit runs backward if it trains, or if a trainable unit feeds it."""
        if not self.unit(name).frozen:
            return True
        return any(not self.unit(up).frozen for up in self.upstream(name))

    def needs_input_grad(self, name: str, layer: int) -> bool:
        """Whether layer `layer` of unit `name` runs its input-gradient pass: an upstream
        unit trains, or the layer is at or after its unit's first trained layer (the
        layers of a frozen ViT under a trained projector run no backward at all)."""
        if not self.needs_backward(name):
            return False
        if any(not self.unit(up).frozen for up in self.upstream(name)):
            return True
        return layer >= self.unit(name).first_trained_layer()
