"""Turns the scheduler's chunks into the flat tensors of one paged forward (positions, slots, masks)."""

from __future__ import annotations

import numpy as np
import torch

from psrl.engine.kv_cache import blocks_for_tokens
from psrl.engine.model import DecodeGroup, PagedBatch, PrefillSeq
from psrl.engine.scheduler import ScheduledChunk


def build_paged_batch(
    chunks: list[ScheduledChunk], block_size: int, num_queries_per_kv: int, device: torch.device
) -> PagedBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    prefills: list[PrefillSeq] = []
    # Decode rows grouped by how many blocks their sequence spans: every sequence is attended over
    # exactly its own blocks, so its result does not depend on what else is in the batch.
    decode_by_blocks: dict[int, tuple[list[int], list[list[int]], list[int]]] = {}

    for chunk in chunks:
        req, start, n = chunk.request, chunk.start, chunk.num_tokens
        row = len(input_ids)
        ctx = start + n
        input_ids.extend(req.token_ids[start:ctx])
        nb = blocks_for_tokens(ctx, block_size)
        if n == 1:
            positions.append(start)
            slots.append(req.block_ids[start // block_size] * block_size + start % block_size)
            rows, tables, ctxs = decode_by_blocks.setdefault(nb, ([], [], []))
            rows.append(row)
            tables.append(req.block_ids[:nb])
            ctxs.append(ctx)
        else:
            pos = np.arange(start, ctx)
            table = np.asarray(req.block_ids[:nb], dtype=np.int64)
            positions.extend(pos.tolist())
            slots.extend((table[pos // block_size] * block_size + pos % block_size).tolist())
            keys = torch.arange(ctx, device=device)
            queries = torch.arange(start, ctx, device=device)
            causal = keys.unsqueeze(0) <= queries.unsqueeze(1)  # [n, ctx]
            mask = causal.unsqueeze(0).expand(num_queries_per_kv, n, ctx).reshape(1, num_queries_per_kv * n, ctx)
            prefills.append(
                PrefillSeq(
                    start=row,
                    num_tokens=n,
                    context_len=ctx,
                    block_ids=torch.from_numpy(table).to(device),
                    mask=mask,
                )
            )
        if chunk.samples:
            logits_rows.append(row + n - 1)

    groups = []
    for nb, (rows, tables, ctxs) in decode_by_blocks.items():
        ctx_t = torch.tensor(ctxs, device=device)
        kv_mask = torch.arange(nb * block_size, device=device).unsqueeze(0) < ctx_t.unsqueeze(1)
        groups.append(
            DecodeGroup(
                token_index=torch.tensor(rows, device=device),
                block_table=torch.tensor(tables, device=device),
                kv_mask=kv_mask.view(len(rows), 1, 1, nb * block_size),
            )
        )

    return PagedBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        decode_groups=groups,
        prefills=prefills,
        logits_index=torch.tensor(logits_rows, dtype=torch.long, device=device),
    )
