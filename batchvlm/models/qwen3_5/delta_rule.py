"""The gated delta rule of Gated DeltaNet, in plain torch, float32 throughout.

Per value head, a state S [Dk, Dv] is carried along the sequence. At token t, with decay
g_t <= 0 (log space), write strength beta_t in (0, 1), and L2-normalised q_t, k_t:

    S  <- exp(g_t) * S                        forget
    u_t = beta_t * (v_t - S^T k_t)            the part of v_t the state does not predict yet
    S  <- S + k_t u_t^T                       write it
    o_t = S^T (q_t / sqrt(Dk))                read

`recurrent_step_` is that, one token for a batch of sequences (decode), in place. `chunked` is
the same recurrence over whole sequences, C tokens at a time (prefill): inside a chunk, with
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


def recurrent_step_(q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor,
                    beta_BH: torch.Tensor, S_BHKV: torch.Tensor) -> torch.Tensor:
    """One token per sequence; q, k already normalised and q scaled; `S_BHKV` (float32,
    contiguous) updated in place. -> o [B, H, V].

    The state is the big operand (Hv * Dk * Dv floats per sequence and layer): it is read once for
    both k and q and then scaled and written in place. With a = exp(g) and S the old state,
        (a S)^T k = a S^T k,   u = beta (v - a S^T k),   S <- a S + k u^T,
        o = S_new^T q = a S^T q + (k . q) u,
    so S^T [k q] is one batched matmul, and the update is `mul_` then a rank-one `baddbmm_`."""
    B, H, K, V = S_BHKV.shape
    a_BH11 = g_BH.exp()[..., None, None]
    read_BH2V = torch.stack([k_BHK, q_BHK], dim=-2) @ S_BHKV * a_BH11
    u_BHV = (v_BHV - read_BH2V[..., 0, :]) * beta_BH[..., None]
    S_BHKV.mul_(a_BH11)
    S_BHKV.view(B * H, K, V).baddbmm_(k_BHK.reshape(B * H, K, 1), u_BHV.reshape(B * H, 1, V))
    return read_BH2V[..., 1, :] + (k_BHK * q_BHK).sum(-1, keepdim=True) * u_BHV


def chunked(q_BHTK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor, g_BHT: torch.Tensor,
            beta_BHT: torch.Tensor, state_BHKV: torch.Tensor, chunk: int = CHUNK
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole sequences (T tokens each, padded as the module docstring says); q, k normalised and q
    scaled. -> (o [B, H, T, V], the state after the last token; `state_BHKV` is not written)."""
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
    # one solve for both right-hand sides (each column is solved on its own)
    w = torch.linalg.solve_triangular(A, torch.cat([v * beta[..., None], kb * gamma.exp()[..., None]], dim=-1),
                                      upper=False, unitriangular=True)
    w_v, w_k = w.split([V, K], dim=-1)
    qk = (q @ k.transpose(-1, -2)) * decay_CC
    q_read = q * gamma.exp()[..., None]  # reads S_0 decayed to each token
    reads = torch.cat([w_k, q_read], dim=-2).view(B * H, n, 2 * chunk, K)  # both read the chunk's S_0
    k_write = (k * (gamma[..., -1:] - gamma).exp()[..., None]).transpose(-1, -2).reshape(B * H, n, K, chunk)
    chunk_decay = gamma[..., -1].exp().view(B * H, n, 1, 1)  # writes above: decayed to the chunk end
    w_v, qk = w_v.reshape(B * H, n, chunk, V), qk.reshape(B * H, n, chunk, chunk)
    S = state_BHKV.to(torch.float32, copy=True).view(B * H, K, V)
    out = S.new_empty(n, B * H, chunk, V)
    for i in range(n):
        kS, qS = (reads[:, i] @ S).split(chunk, dim=1)  # [BH, C, V] each: S read once
        u = w_v[:, i] - kS
        torch.baddbmm(qS, qk[:, i], u, out=out[i])
        S.mul_(chunk_decay[:, i]).baddbmm_(k_write[:, i], u)
    return out.transpose(0, 1).reshape(B, H, n * chunk, V)[:, :, :T], S.view(B, H, K, V)
