"""A small GPT-style language model whose attention call is an argument: the model notebook 09 trains and the
training step ``--mode step`` times.

    model = GPT(vocab=50304, context=4096, d_model=768, heads=12, layers=12, attention=flashlab.flash_attention)
    logits = model(idx)  # idx (B, N) token ids -> (B, N, vocab)

Pre-norm blocks, ``x + attention(ln(x))`` then ``x + mlp(ln(x))``, learned position embeddings, an untied output
head. ``attention(q, k, v, causal=True)`` takes and returns ``(B, H, N, D)`` tensors; whatever computes it --
``flashlab.flash_attention``, PyTorch's SDPA, the materialised ``softmax(Q K^T) V`` -- the rest of the model is
the same code, so a difference in step time is a difference in attention. Weights take PyTorch's default
initialisation, drawn from the global generator in a fixed order: the same seed gives the same model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Block(torch.nn.Module):
    """Pre-norm transformer block: ``x + proj(attention(ln1(x)))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, attention: Callable, d_model: int, heads: int):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.attention, self.heads = attention, heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d_model), torch.nn.LayerNorm(d_model)
        self.qkv, self.proj = torch.nn.Linear(d_model, 3 * d_model), torch.nn.Linear(d_model, d_model)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(), torch.nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x):
        b, n, c = x.shape  # (B, N, C)
        h, d = self.heads, c // self.heads
        q, k, v = (t.view(b, n, h, d).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(c, dim=-1))  # (B, H, N, D)
        a = self.attention(q, k, v, causal=True)  # (B, H, N, D)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, c))  # (B, N, C)
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final LayerNorm and a linear head to ``vocab`` logits."""

    def __init__(self, attention: Callable, vocab: int, context: int, d_model: int, heads: int, layers: int):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d_model), torch.nn.Embedding(context, d_model)
        self.blocks = torch.nn.ModuleList(Block(attention, d_model, heads) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d_model), torch.nn.Linear(d_model, vocab)

    def forward(self, idx):  # (B, N) token ids -> (B, N, vocab) logits
        n = idx.shape[1]
        if n > self.pos.num_embeddings:
            raise ValueError(f"sequence of {n} tokens is longer than the model's context {self.pos.num_embeddings}")
        x = self.tok(idx) + self.pos(torch.arange(n, device=idx.device))  # (B, N, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def set_attention(self, attention: Callable) -> None:
        """Swap the attention call of every block (the weights stay as they are)."""
        for block in self.blocks:
            block.attention = attention


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
