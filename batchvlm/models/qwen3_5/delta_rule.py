"""The gated delta rule of Gated DeltaNet, in plain torch, float32 throughout.

Per value head, a state S [Dk, Dv] is carried along the sequence. At token t, with decay
g_t <= 0 (log space), write strength beta_t in (0, 1), and L2-normalised q_t, k_t:

    S  <- exp(g_t) * S                        forget
    u_t = beta_t * (v_t - S^T k_t)            the part of v_t the state does not predict yet
    S  <- S + k_t u_t^T                       write it
    o_t = S^T (q_t / sqrt(Dk))                read

`recurrent_step` is that, one token for a batch of sequences (decode). `chunked` is the same
recurrence over whole sequences, C tokens at a time (prefill): inside a chunk, with
gamma_t = g_1 + ... + g_t and S_0 the state at the chunk start, the u_t solve a unit lower-
triangular system (I + A) U = beta V - beta exp(gamma) K S_0 with
A[t, s] = beta_t exp(gamma_t - gamma_s) k_t . k_s (s < t); then
    o_t = exp(gamma_t) S_0^T q_t + sum_{s <= t} exp(gamma_t - gamma_s) (q_t . k_s) u_s
    S_C = exp(gamma_C) S_0 + sum_s exp(gamma_C - gamma_s) k_s u_s^T,
so a chunk costs a few matmuls and one triangular solve instead of C sequential steps.

Padding: a token with k = 0, beta = 0 and g = 0 leaves the state exactly as it was (decay 1,
nothing written), so sequences of different lengths run padded in one batch and each still
ends in its own state.
"""

from __future__ import annotations

import torch

CHUNK = 64  # transformers' chunk size: the same summation order as the parity reference


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_step(q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor,
                   beta_BH: torch.Tensor, state_BHKV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence; q, k already normalised and q scaled. -> (o [B, H, V], new state)."""
    S = state_BHKV * g_BH.exp()[..., None, None]
    u = (v_BHV - (S * k_BHK[..., None]).sum(-2)) * beta_BH[..., None]
    S = S + k_BHK[..., None] * u[..., None, :]
    return (S * q_BHK[..., None]).sum(-2), S


def chunked(q_BHTK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor, g_BHT: torch.Tensor,
            beta_BHT: torch.Tensor, state_BHKV: torch.Tensor, chunk: int = CHUNK
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole sequences (T tokens each, padded as the module docstring says); q, k normalised and q
    scaled. -> (o [B, H, T, V], the state after the last token)."""
    B, H, T, K = k_BHTK.shape
    V = v_BHTV.shape[-1]
    pad = -T % chunk
    if pad:
        q_BHTK, k_BHTK, v_BHTV = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q_BHTK, k_BHTK, v_BHTV))
        g_BHT, beta_BHT = (torch.nn.functional.pad(x, (0, pad)) for x in (g_BHT, beta_BHT))
    n = (T + pad) // chunk
    q, k = q_BHTK.view(B, H, n, chunk, K), k_BHTK.view(B, H, n, chunk, K)
    v, beta = v_BHTV.view(B, H, n, chunk, V), beta_BHT.view(B, H, n, chunk)
    gamma = g_BHT.view(B, H, n, chunk).cumsum(-1)  # [B, H, n, C]
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # exp(gamma_t - gamma_s) for s <= t, 0 above the diagonal (masked before exp: no overflow)
    decay_CC = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(future, float("-inf")).exp()
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * decay_CC  # its diagonal is ignored: the solve is unit-triangular
    w_v = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(A, kb * gamma.exp()[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay_CC
    q_read = q * gamma.exp()[..., None]  # reads S_0 decayed to each token
    k_write = k * (gamma[..., -1:] - gamma).exp()[..., None]  # writes decayed to the chunk end
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]
    S = state_BHKV.float()
    out = []
    for i in range(n):
        u = w_v[:, :, i] - w_k[:, :, i] @ S  # [B, H, C, V]
        out.append(q_read[:, :, i] @ S + qk[:, :, i] @ u)
        S = S * chunk_decay[:, :, i] + k_write[:, :, i].transpose(-1, -2) @ u
    return torch.cat(out, dim=2)[:, :, :T], S
