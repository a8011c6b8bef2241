"""Chunked PyTorch backend of ``attention_stats`` (the CPU path).

Works on blocks of (sequences x query rows) so that one block's logits hold at most
``block_elements`` numbers: memory is O(block x S), never S x S for all heads at once.
Keys beyond the block's last query are never touched (causal crop), and GQA is handled by
viewing the q heads of one kv head as extra rows, so k is never repeated.

Inside a block everything is exact softmax in float32: logits, their log-sum-exp, then
    log p_ij = s_ij - lse_i,   entropy_i = -sum_j p_ij log p_ij,   p on chosen columns.
Learned sink logits join afterwards, exactly, through each row's lse (``contract.fold_sinks``).
"""

from __future__ import annotations

import torch

from .contract import AttentionStats, StatsProblem, empty_outputs, fold_sinks

# Logits per block follow a memory budget (``block_budget``): as many as q has elements, within
# these bounds. Three block-sized float32 temporaries live at once.
MIN_BLOCK_ELEMENTS = 1 << 16  # 256 KiB: below this the Python loop over blocks costs more than the arithmetic
MAX_BLOCK_ELEMENTS = 1 << 21  # 8 MiB: larger blocks run no faster on a CPU (they leave its caches anyway)


def block_budget(q: torch.Tensor) -> int:
    """Logits per block for a pass over ``q``'s rows: q's own element count, clamped to
    [MIN_BLOCK_ELEMENTS, MAX_BLOCK_ELEMENTS]. The pass's temporaries then stay within a few times an
    activation the forward already holds, so a short probe does not pay a long one's workspace."""
    return max(MIN_BLOCK_ELEMENTS, min(MAX_BLOCK_ELEMENTS, q.numel()))


def block_sizes(batch: int, heads: int, queries: int, keys: int, budget: int) -> tuple[int, int]:
    """(seq_block, row_block): sequences and query rows per block, with
    seq_block * heads * row_block * keys <= budget (a block spans several sequences only whole)."""
    per_row = heads * keys
    row_block = max(1, min(queries, budget // max(per_row, 1)))
    seq_block = 1 if row_block < queries else max(1, min(batch, budget // max(per_row * queries, 1)))
    return seq_block, row_block


def attention_stats_torch(problem: StatsProblem, block_elements: int | None = None) -> AttentionStats:
    q, k = problem.q, problem.k
    B, Hq, Hkv, S, D, Q, G = problem.shape
    groups = Hq // Hkv
    out = empty_outputs(problem)
    positions = problem.query_positions()  # (B, Q)
    key_index = torch.arange(S, device=q.device)
    seq_block, row_block = block_sizes(B, Hq, Q, S, block_elements or block_budget(q))

    with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
        for b0 in range(0, B, seq_block):
            b1 = min(B, b0 + seq_block)
            nb = b1 - b0
            for r0 in range(0, Q, row_block):
                r1 = min(Q, r0 + row_block)
                nq = r1 - r0
                pos = positions[b0:b1, r0:r1]  # (nb, nq)
                n_keys = int(pos.max()) + 1  # causal crop: no query here sees a later key
                if problem.rows is None:
                    qc = q[b0:b1, :, r0:r1]  # (nb, Hq, nq, D) view
                else:
                    qc = q[b0:b1].gather(2, pos[:, None, :, None].expand(nb, Hq, nq, D))
                qc = qc.float().reshape(nb, Hkv, groups * nq, D)
                kc = k[b0:b1, :, :n_keys].float()  # (nb, Hkv, n_keys, D)
                logits = torch.matmul(qc, kc.transpose(-1, -2))  # (nb, Hkv, groups*nq, n_keys)
                logits = logits.view(nb, Hq, nq, n_keys).mul_(problem.scaling)
                if problem.softcap is not None:
                    logits = logits.div_(problem.softcap).tanh_().mul_(problem.softcap)
                keys = key_index[:n_keys]
                allowed = keys[None, None, :] <= pos[:, :, None]  # (nb, nq, n_keys)
                if problem.window is not None:
                    allowed &= (pos[:, :, None] - keys[None, None, :]) < problem.window
                allowed = allowed[:, None]  # (nb, 1, nq, n_keys)
                logits.masked_fill_(~allowed, float("-inf"))

                lse = torch.logsumexp(logits, dim=-1)  # (nb, Hq, nq)
                log_p = logits.sub_(lse[..., None])  # in place: logits are not needed again
                p = log_p.exp()
                log_p.masked_fill_(~allowed, 0.0)  # 0 * -inf would be NaN
                entropy = -(p * log_p).sum(-1)

                out.lse[b0:b1, :, r0:r1] = lse
                out.entropy[b0:b1, :, r0:r1] = entropy
                n = min(problem.n_first, n_keys)
                out.first[b0:b1, :, r0:r1, :n] = p[..., :n]
                out.first[b0:b1, :, r0:r1, n:] = 0.0  # keys after every query of the block
                if G:
                    cols = problem.cols[b0:b1, r0:r1]  # (nb, nq, G)
                    invalid = (cols < 0) | (cols > pos[:, :, None])
                    index = cols.clamp(0, n_keys - 1)[:, None].expand(nb, Hq, nq, G)
                    picked = p.gather(-1, index).masked_fill_(invalid[:, None], 0.0)
                    out.gathered[b0:b1, :, r0:r1] = picked
    return fold_sinks(out, problem)  # learned sinks: exact, through each row's lse
