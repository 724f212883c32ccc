"""The step's host tensors on their way to the device (paged_experts/upload.py) and the causal mask built where
the step runs (attention.causal_mask): the same values as before, whichever device builds them. The CUDA side
(pinned, no copy from pageable memory in a paged prefill step) is tests/cuda/test_step_uploads_cuda.py."""

from __future__ import annotations

import torch

from paged_experts.attention import causal_mask
from paged_experts.upload import to_device


def test_to_device_on_the_cpu_hands_back_the_tensor_itself() -> None:
    t = torch.arange(12, dtype=torch.long).reshape(3, 4)
    assert to_device(t, torch.device("cpu")) is t  # as `t.to("cpu")`: no copy where nothing travels


def test_the_causal_mask_hides_each_querys_later_keys_and_nothing_else() -> None:
    for start, n in ((0, 1), (0, 7), (5, 3), (64, 64)):
        for dtype in (torch.bfloat16, torch.float32):
            mask = causal_mask(start, n, dtype, torch.device("cpu"))  # [n, start + n]
            assert mask.shape == (n, start + n) and mask.dtype == dtype
            q = torch.arange(start, start + n)[:, None]  # each query's position
            k = torch.arange(start + n)[None, :]
            hidden = torch.full_like(mask, torch.finfo(dtype).min)
            assert torch.equal(mask, torch.where(k > q, hidden, torch.zeros_like(mask)))
            assert torch.equal(mask, causal_mask(start, n, dtype))  # the default device is the CPU
