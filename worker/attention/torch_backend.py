"""Reference attention in plain torch, on CPU and GPU.

Decode (one new token per sequence) gathers each sequence's pages into a padded batch and runs one
masked scaled-dot-product attention. gpt-oss's sinks and windows take an explicit float32 softmax
(``attend_eager``) instead of SDPA, which has no sink. Prefill runs each sequence on its own with a bottom-right
aligned causal mask over its real keys only (no padded pages), which lets SDPA use its fused
kernels and skip the masked half; the loop is over host-known lengths, so nothing is read back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from worker.attention.registry import register
from worker.batch import ForwardBatch
from worker.kv.gpu_pool import KVPool
from worker.models.rotary import RopeInputs


@register("torch")
class TorchAttention:
    def __init__(self, pool: KVPool, scale: float):
        self.pool = pool
        self.scale = scale

    def warm_plans(self, heads: int, max_q: int, max_context: int) -> int:
        return 0  # nothing is planned per shape

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, *,
                sinks: torch.Tensor | None = None, window: int = 0, rope: RopeInputs | None = None) -> torch.Tensor:
        if rope is not None:
            q, k = rope.apply(q, k)
        heads = q.shape[1]
        keys = self._gather(self.pool.k[layer], batch, heads).to(q.dtype)  # [B, heads, S, D], as stored
        values = self._gather(self.pool.v[layer], batch, heads).to(q.dtype)
        if batch.is_decode:
            return self._decode(q, keys, values, batch, sinks, window)
        out = torch.empty_like(q)
        start = 0
        for b, (n, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens_host)):
            q_b = q[start:start + n].transpose(0, 1)[None]  # [1, heads, n, D]
            k_b, v_b = keys[b:b + 1, :, :seq_len], values[b:b + 1, :, :seq_len]
            if sinks is None and not window:
                o = F.scaled_dot_product_attention(q_b, k_b, v_b, attn_mask=causal_lower_right(n, seq_len),
                                                   scale=self.scale)
            else:
                query_pos = torch.arange(seq_len - n, seq_len, device=q.device)
                o = attend_eager(q_b, k_b, v_b, _mask(query_pos[:, None], seq_len, window), self.scale, sinks)
            out[start:start + n] = o[0].transpose(0, 1)
            start += n
        return out

    def _decode(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: ForwardBatch,
                sinks: torch.Tensor | None, window: int) -> torch.Tensor:
        mask = _mask(batch.seq_lens[:, None, None, None] - 1, keys.shape[2], window)  # [B, 1, 1, S]
        if sinks is None:
            return F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, scale=self.scale)[:, :, 0]
        return attend_eager(q[:, :, None], keys, values, mask, self.scale, sinks)[:, :, 0]

    @staticmethod
    def _gather(cache: torch.Tensor, batch: ForwardBatch, heads: int) -> torch.Tensor:
        B, kv_heads = batch.page_table.shape[0], cache.shape[-2]
        pages = cache[batch.page_table]  # [B, max_pages, P, kvh, D]
        seq = pages.reshape(B, -1, kv_heads, pages.shape[-1]).transpose(1, 2)  # [B, kvh, S, D]
        group = heads // kv_heads
        S, D = seq.shape[2], seq.shape[3]
        return seq[:, :, None].expand(B, kv_heads, group, S, D).reshape(B, heads, S, D)


def _mask(query_pos: torch.Tensor, num_keys: int, window: int) -> torch.Tensor:
    """Which keys each query sees: causal, and within the last ``window`` positions when > 0."""
    key_pos = torch.arange(num_keys, device=query_pos.device)
    mask = key_pos <= query_pos
    return mask & (key_pos > query_pos - window) if window else mask


def attend_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                 sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention in float32 over ``[..., heads, n, D]`` with a boolean ``mask`` broadcast
    to the scores; a head's sink logit (gpt-oss) joins the denominator and adds no value."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(v.dtype)
