"""Eager twins of the gated delta rule: a chunked form (prefill on the CPU) and a recurrent form
(decode, and the oracle of every other path). Plain torch, float32 throughout.

Per value head, with q and k l2-normalised (``x * rsqrt(sum x^2 + 1e-6)``, transformers' and fla's
l2norm) and q scaled by Dk**-0.5, each token updates the state S [Dk, Dv]:

    S <- S * exp(g);   delta = beta * (v - S^T k);   S <- S + k delta^T;   o = S^T q

Key head h // (Hv // Hk) serves value head h. Layouts are those of ``gated_delta.py``.
"""
from __future__ import annotations

import torch

from worker.linear_attention.varlen import to_device

CHUNK = 64
L2_EPS = 1e-6


def prepare_qk(q: torch.Tensor, k: torch.Tensor, heads_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., Hk, Dk]`` -> float32 ``[..., Hv, Dk]``: normalised, q scaled, key heads repeated."""
    group = heads_v // q.shape[-2]
    q, k = (x.float() * torch.rsqrt(x.float().square().sum(-1, keepdim=True) + L2_EPS) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    return q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)


def delta_rule_token(s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for N states at once: ``s [N, Hv, Dk, Dv]``, prepared ``q, k [N, Hv, Dk]``,
    ``v [N, Hv, Dv]``, ``g, beta [N, Hv]``. Returns ``(o [N, Hv, Dv], new s)``, float32."""
    s = s * g.float().exp()[..., None, None]
    remembered = (s * k[..., None]).sum(-2)
    delta = (v.float() - remembered) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2), s


def gated_delta_step_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Decode twin, one token per sequence; fixed-shape and sync-free (gather, update, scatter)."""
    q, k = prepare_qk(q, k, v.shape[1])
    o, s = delta_rule_token(state.index_select(0, slots), q, k, v, g, beta)
    state.index_copy_(0, slots, s)
    return o.to(v.dtype)


def gated_delta_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, slots: torch.Tensor, cu_seqlens_host: list[int]) -> torch.Tensor:
    """Oracle twin of the packed prefill: token by token, sequence by sequence."""
    q, k = prepare_qk(q, k, v.shape[1])
    start = state.index_select(0, slots)
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    final = []
    for b, (bos, eos) in enumerate(zip(cu_seqlens_host, cu_seqlens_host[1:])):
        s = start[b:b + 1]
        for t in range(bos, eos):
            o[t:t + 1], s = delta_rule_token(s, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
        final.append(s)
    state.index_copy_(0, slots, torch.cat(final))
    return o.to(v.dtype)


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, slots: torch.Tensor, cu_seqlens_host: list[int],
                        chunk: int = CHUNK) -> torch.Tensor:
    """Prefill twin: the sequences padded at their ends to one length (a multiple of ``chunk``) and
    scanned together chunk by chunk. Padding is q = k = v = g = beta = 0: it leaves the state as is."""
    q, k = prepare_qk(q, k, v.shape[1])
    lengths = [b - a for a, b in zip(cu_seqlens_host, cu_seqlens_host[1:])]
    padded_len = -(-max(lengths) // chunk) * chunk
    T = v.shape[0]
    # row index of each padded position in the packed tensors, T (an appended zero row) past the end
    rows = [[bos + i if i < n else T for i in range(padded_len)] for bos, n in zip(cu_seqlens_host, lengths)]
    rows = to_device(rows, torch.int64, v.device)

    def pad(x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x.float(), x.new_zeros((1, *x.shape[1:]), dtype=torch.float32)])
        return x[rows]  # [B, padded_len, ...]

    o, final = chunk_scan(*(pad(x) for x in (q, k, v, g, beta)), state.index_select(0, slots), chunk)
    state.index_copy_(0, slots, final)
    back = [b * padded_len + i for b, n in enumerate(lengths) for i in range(n)]
    return o.flatten(0, 1)[to_device(back, torch.int64, v.device)].to(v.dtype)


def chunk_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               s: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal-length float32 batches ``[B, L, Hv, D]`` (``g, beta [B, L, Hv]``; L a multiple of chunk)
    from states ``s [B, Hv, Dk, Dv]``. Returns ``(o [B, L, Hv, Dv], final s)``.

    Inside a chunk, with G the cumulative log decay from its start and D[i, j] = exp(G_i - G_j)
    (j <= i), the corrections u that the tokens write satisfy the lower unitriangular system
    ``(I + strict_lower(beta_i D_ij k_i.k_j)) u = beta v - beta exp(G) (K S0)``: one solve for the
    part from the chunk (``new_v``) and one for the part read from the entering state (``read``).
    Then ``o = exp(G) (Q S0) + (D * Q K^T) u`` and ``S = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T``.
    """
    B, L, H, _ = q.shape
    n = L // chunk
    q, k, v = (x.transpose(1, 2).reshape(B, H, n, chunk, -1) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).reshape(B, H, n, chunk) for x in (g, beta))
    cum = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = torch.eye(chunk, device=q.device) + ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    new_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    read = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_from_start = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    o = torch.empty_like(new_v)
    for i in range(n):
        u = new_v[:, :, i] - read[:, :, i] @ s
        o[:, :, i] = q_from_start[:, :, i] @ s + scores[:, :, i] @ u
        s = s * cum[:, :, i, -1].exp()[..., None, None] + k_to_end[:, :, i].transpose(-1, -2) @ u
    return o.reshape(B, H, L, -1).transpose(1, 2), s
