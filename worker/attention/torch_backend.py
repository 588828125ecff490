"""Reference attention in plain torch, on CPU and GPU.

Decode (one new token per sequence) gathers each sequence's pages into a padded batch and runs one
masked scaled-dot-product attention. Prefill runs each sequence on its own with a bottom-right
aligned causal mask over its real keys only (no padded pages), which lets SDPA use its fused
kernels and skip the masked half; the loop is over host-known lengths, so nothing is read back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from worker.attention import register
from worker.batch import ForwardBatch
from worker.kv.gpu_pool import KVPool


@register("torch")
class TorchAttention:
    def __init__(self, pool: KVPool, scale: float):
        self.pool = pool
        self.scale = scale

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        heads = q.shape[1]
        keys = self._gather(self.pool.k[layer], batch, heads)  # [B, heads, S, D]
        values = self._gather(self.pool.v[layer], batch, heads)
        if batch.is_decode:
            return self._decode(q, keys, values, batch)
        out = torch.empty_like(q)
        start = 0
        for b, (n, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens_host)):
            q_b = q[start:start + n].transpose(0, 1)[None]  # [1, heads, n, D]
            o = F.scaled_dot_product_attention(q_b, keys[b:b + 1, :, :seq_len], values[b:b + 1, :, :seq_len],
                                               attn_mask=causal_lower_right(n, seq_len), scale=self.scale)
            out[start:start + n] = o[0].transpose(0, 1)
            start += n
        return out

    def _decode(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        key_pos = torch.arange(keys.shape[2], device=q.device)
        mask = key_pos[None, None, None, :] < batch.seq_lens[:, None, None, None]  # [B, 1, 1, S]
        out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, scale=self.scale)
        return out[:, :, 0]

    @staticmethod
    def _gather(cache: torch.Tensor, batch: ForwardBatch, heads: int) -> torch.Tensor:
        B, kv_heads = batch.page_table.shape[0], cache.shape[-2]
        pages = cache[batch.page_table]  # [B, max_pages, P, kvh, D]
        seq = pages.reshape(B, -1, kv_heads, pages.shape[-1]).transpose(1, 2)  # [B, kvh, S, D]
        group = heads // kv_heads
        S, D = seq.shape[2], seq.shape[3]
        return seq[:, :, None].expand(B, kv_heads, group, S, D).reshape(B, heads, S, D)
