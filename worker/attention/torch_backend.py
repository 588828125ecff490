"""Reference attention in plain torch: gather each sequence's pages into a padded batch and run
one masked scaled-dot-product attention. Works on CPU and GPU with shapes fixed by the batch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention import register
from worker.batch import ForwardBatch
from worker.kv_pool import KVPool


@register("torch")
class TorchAttention:
    def __init__(self, pool: KVPool, scale: float):
        self.pool = pool
        self.scale = scale

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        self.pool.store(layer, batch.out_loc, k, v)
        B, max_q = batch.q_index.shape
        heads, kv_heads, D = q.shape[1], k.shape[1], q.shape[2]
        # [B, max_pages, P, kvh, D] -> [B, kvh, S, D], S = max_pages * P
        keys = self._gather(self.pool.k[layer], batch, kv_heads, heads)
        values = self._gather(self.pool.v[layer], batch, kv_heads, heads)
        q_pad = torch.cat((q, q.new_zeros(1, heads, D)))[batch.q_index]  # [B, max_q, h, D]
        positions = torch.cat((batch.positions, batch.positions.new_zeros(1)))[batch.q_index]
        key_pos = torch.arange(keys.shape[2], device=q.device)
        mask = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < batch.seq_lens[:, None, None])
        out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys, values, attn_mask=mask[:, None],
                                             scale=self.scale)
        return out.transpose(1, 2).reshape(B * max_q, heads, D)[batch.q_flat]

    @staticmethod
    def _gather(cache: torch.Tensor, batch: ForwardBatch, kv_heads: int, heads: int) -> torch.Tensor:
        B = batch.page_table.shape[0]
        pages = cache[batch.page_table]  # [B, max_pages, P, kvh, D]
        seq = pages.reshape(B, -1, kv_heads, pages.shape[-1]).transpose(1, 2)  # [B, kvh, S, D]
        group = heads // kv_heads
        S, D = seq.shape[2], seq.shape[3]
        return seq[:, :, None].expand(B, kv_heads, group, S, D).reshape(B, heads, S, D)
