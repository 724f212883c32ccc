"""CUDA checks of the split-KV decode attention (attn_triton.decode_attention_split):
- compiled in bf16, equal to the unsplit kernel and to torch within bf16 rounding (the interpreter
  test's cases: contexts of one position to several chunks, batch 1..8, uneven lengths, GQA 8:1);
- captured in a CUDA graph once per batch size 1..8 at the Qwen3-30B-A3B head shape (32 query
  heads, 4 KV heads x 128) over a pool of 10,240 tokens, then replayed at contexts from one
  position to 8,192 (uneven in one batch): each replay equals the eager kernels and torch;
- a graphed Qwen3-30B-A3B-shaped decode step (triton backend) equals eager decode past several
  chunks of context.

Plain functions, so the module also runs as a script: `python tests/cuda/test_attn_split_cuda.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from paged_experts.attention import attend
from paged_experts.kernels.attn_triton import decode_attention, decode_attention_split, split_plan
from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.runtime import RuntimeConfig

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass

QWEN2 = "synth:qwen3-30b-a3b-shape?layers=2&seed=0"


def test_split_attention_bf16_matches_torch_and_unsplit() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_attn_split import check_split

    check_split(device="cuda", dtype=torch.bfloat16, tol=2e-2)


def _reference(q, kv_k, kv_v, blocks, positions, bs) -> torch.Tensor:
    b = q.shape[0]
    cols = torch.arange(int(positions.max()) + 1, device=q.device)[None, :]  # [1, L]
    rows = blocks.gather(1, (cols // bs).expand(b, -1)) * bs + cols % bs  # [B, L]
    mask = torch.where(cols <= positions[:, None], 0.0, torch.finfo(torch.float32).min)  # [B, L]
    return attend(q.float()[:, None], kv_k.float(), kv_v.float(), rows, mask[:, None, :])[:, 0]


def test_split_attention_graph_replays_every_length_and_batch_size() -> None:
    nh, kvh, d, bs, capacity = 32, 4, 128, 16, 10240
    num_blocks = capacity // bs
    gen = torch.Generator(device="cuda").manual_seed(3)
    kv_k = torch.randn(capacity, kvh, d, device="cuda", generator=gen, dtype=torch.bfloat16)  # [slots, kvh, D]
    kv_v = torch.randn(capacity, kvh, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    plan = split_plan(capacity)
    lengths = (1, 2, 63, 64, 65, 130, 2047, 2048, 4100, 8192)
    for b in range(1, 9):
        q = torch.zeros(b, nh, d, device="cuda", dtype=torch.bfloat16)
        blocks = torch.zeros(b, num_blocks, device="cuda", dtype=torch.long)  # [B, W] the pool's width
        positions = torch.zeros(b, device="cuda", dtype=torch.long)
        out = decode_attention_split(q, kv_k, kv_v, blocks, positions, bs, plan)  # warm-up (compiles)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_attention_split(q, kv_k, kv_v, blocks, positions, bs, plan)
        for trial in range(3):
            pos = [lengths[(trial * 3 + i * 7 + b) % len(lengths)] - 1 for i in range(b)]
            positions.copy_(torch.tensor(pos))
            q.copy_(torch.randn(b, nh, d, device="cuda", generator=gen))
            # each sequence's blocks scattered over the pool in its own order
            blocks.copy_(torch.stack([torch.randperm(num_blocks, device="cuda", generator=gen) for _ in range(b)]))
            graph.replay()
            got = out.float()
            want = _reference(q, kv_k, kv_v, blocks, positions, bs)
            eager_split = decode_attention_split(q, kv_k, kv_v, blocks, positions, bs, plan).float()
            one = decode_attention(q, kv_k, kv_v, blocks, positions, bs).float()
            assert torch.equal(got, eager_split), f"B={b} {pos}: replay differs from the eager split kernel"
            for name, ref in (("torch", want), ("the unsplit kernel", one)):
                err = (got - ref).abs().max().item()
                assert err < 2e-2 * max(1.0, ref.abs().max().item()), f"B={b} {pos}: {err:.3e} from {name}"
    print(f"split attention graphs B=1..8 replayed at contexts {lengths}: chunk {plan.chunk_tokens}")


def test_graphed_decode_with_split_attention_equals_eager_past_several_chunks() -> None:
    """Qwen3-30B-A3B shape (2 layers), triton backend: a graph per batch size decodes prompts of
    1, 150 and 333 tokens (past five 64-token chunks) as eager decode does, within bf16 rounding."""
    prompts = [[7], list(range(3, 153)), list(range(500, 833))]
    rt = RuntimeConfig(device="cuda", dtype="bfloat16", mode="resident", kernel_backend="triton")
    outs = []
    for graphed in (True, False):
        model = MoeCausalLM.from_pretrained(QWEN2, rt)
        if graphed:
            model.enable_cuda_graphs([1, 2, 3])
        pool = KvPool.for_model(model, capacity_tokens=2048)
        seqs = [pool.new_sequence() for _ in prompts]
        last = model.forward([SeqChunk(s, p, 0) for s, p in zip(seqs, prompts)])
        got = []
        for _ in range(4):
            last = model.forward(
                [SeqChunk(s, [int(lg[-1].argmax()) % 1000], s.num_tokens) for s, lg in zip(seqs, last)]
            )
            got += [lg.float() for lg in last]
        assert (model.graph_replays == 4) == graphed
        outs.append(got)
    for i, (a, b) in enumerate(zip(*outs)):
        rel = ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()
        assert rel < 5e-2, f"output {i}: graphed vs eager relative difference {rel:.2e}"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _script import run_tests

    raise SystemExit(run_tests(globals()))
