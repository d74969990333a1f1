"""A ViT on images of different sides, packed along one row (runtime.modules.blocks): each
image attends to itself alone, its patches embedded with its CLS and the learned positions
resized to its side; at the nominal side, packing changes nothing. The LLM's embedding puts a
row's image tokens first and keeps its text's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from src.data.interleaved_mllm import patches_of
from src.models.flows import chain_key
from src.runtime.modules.blocks import Block, PatchEmbedding, TokenEmbedding, packed_attention
from src.runtime.modules.mllm import MultimodalEmbedding
from src.runtime.modules.parallel import TP


def test_packed_attention_is_each_sequence_s_own():
    torch.manual_seed(0)
    lengths = [5, 17, 5, 10]
    q, k, v = (torch.randn(1, 2, sum(lengths), 8) for _ in range(3))
    alone = [F.scaled_dot_product_attention(*(z[:, :, a:b] for z in (q, k, v))) for a, b in _spans(lengths)]
    torch.testing.assert_close(packed_attention(q, k, v, lengths), torch.cat(alone, dim=2))
    assert packed_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], []).shape == (1, 2, 0, 8)


def test_images_at_the_nominal_side_packed_run_as_a_batch_of_images():
    torch.manual_seed(1)
    embed, block = PatchEmbedding(32, 8, 16, TP()), Block(16, 2, TP(), causal=False)
    images = torch.randn(3, 3, 32, 32)
    batched = block(embed({"images": images}))["x"]
    state = {"patches": torch.cat([patches_of(image, 8) for image in images]), "patch_sides": torch.tensor([4, 4, 4])}
    packed = block(embed(state))["x"]
    torch.testing.assert_close(packed, batched.reshape(1, -1, 16))


def test_an_image_at_another_side_takes_the_positions_resized_to_it():
    torch.manual_seed(2)
    embed = PatchEmbedding(32, 8, 16, TP())
    image = torch.randn(3, 48, 48)  # 6 x 6 patches, the nominal 4 x 4
    x = embed({"patches": patches_of(image, 8), "patch_sides": torch.tensor([6])})["x"]
    grid = embed.pos[0, 1:].reshape(4, 4, 16).permute(2, 0, 1)[None]
    resized = F.interpolate(grid, size=(6, 6), mode="bilinear", align_corners=False)[0].permute(1, 2, 0).reshape(36, 16)
    torch.testing.assert_close(x[0, 1:], embed.proj(patches_of(image, 8)) + resized)
    torch.testing.assert_close(x[0, 0], (embed.cls + embed.pos[:, :1])[0, 0])
    x.sum().backward()  # the learned positions train through the resize
    assert embed.pos.grad is not None and embed.pos.grad[0, 1:].abs().sum() > 0


def _spans(lengths: list[int]) -> list[tuple[int, int]]:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [(a, a + n) for a, n in zip(starts, lengths)]


def test_interleaved_rows_keep_their_text_s_token_embeddings_in_either_llm_embedding():
    # Two rows of 8 positions whose images took 3 and 5 tokens: the projector hands each row's
    # image tokens at their places, zeros elsewhere; the text after them keeps its embeddings.
    torch.manual_seed(3)
    ids = torch.randint(0, 32, (2, 8))
    handed = torch.randn(2, 8, 16)
    state = {
        "ids": ids,
        "image_slots": torch.ones(2, 1, dtype=torch.bool),
        "image_tokens": torch.tensor([3, 5]),
        chain_key("encoder"): handed,
    }
    mask = torch.arange(8)[None, :] < torch.tensor([3, 5])[:, None]
    gpt = TokenEmbedding(32, 16, 8, TP(), ("encoder",))
    x = gpt(state)["x"] - gpt.pos
    torch.testing.assert_close(x[mask], handed[mask])
    torch.testing.assert_close(x[~mask], gpt.tokens(ids)[~mask])
    llama = MultimodalEmbedding(32, 16, ("encoder",), TP())
    y = llama(state)["x"]
    torch.testing.assert_close(y[mask], handed[mask])
    torch.testing.assert_close(y[~mask], llama.tokens(ids)[~mask])
