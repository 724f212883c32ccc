"""What the host pays to move the device plan's residency state to the host planner and back, per eviction policy.

Why: in h100-duelconfirm (2026-12-07) a short prompt's TTFT was 11-12 ms longer with `eviction_policy: duel` than with
LRU, in the host's part of the prefill step (`prefill_host_plan_ms`), while a 41-token prompt routes more experts a
layer than K, so the duel's shadows do not play it. Before a host-planned step (a prefill chunk) every paged layer's
device state is read into its host planner (`residency.device.pull_many`), and after it written back (`push_from`);
the duel's state is every expert's count, last use and two shadow flags a layer, converted in Python. This times the
two halves for all layers of a model: on the CPU by default (no device read is waited for: the conversion alone), with
`--device cuda` with the state on a GPU (pinned pushes and their H2D copies, and a device read; the device is idle
when each repeat starts, so the pull waits only for its own read).

    PYTHONPATH=$PWD python benchmarks/residency_roundtrip.py            # Qwen3-30B-A3B's 48 layers, E=128, K=54
    PYTHONPATH=$PWD python benchmarks/residency_roundtrip.py --layers 48 --experts 128 --slots 54 --repeats 20
    PYTHONPATH=$PWD python benchmarks/residency_roundtrip.py --device cuda   # the state on a GPU: pinned pushes
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from paged_experts.residency.device import DeviceResidency, pull_many
from paged_experts.residency.planner import LayerResidency
from paged_experts.residency.policies import AgingLfuPolicy, DuelPolicy, EvictionPolicy, LruPolicy

PERIOD_STEPS, WINDOW_STEPS = 256, 4  # `duel`'s aging LFU and `lfu-aging:256:4`


def layer_pair(
    policy: str, experts: int, slots: int, device: torch.device | None = None
) -> tuple[DeviceResidency, LayerResidency]:
    where = device or torch.device("cpu")  # the device plan's state lives here (cuda: the pushes copy to it)
    host_policy: EvictionPolicy
    if policy == "duel":
        plan = DeviceResidency(experts, slots, where, PERIOD_STEPS, WINDOW_STEPS, duel=True)
        host_policy = DuelPolicy(slots, PERIOD_STEPS, WINDOW_STEPS)
    elif policy == "lfu-aging":
        plan = DeviceResidency(experts, slots, where, PERIOD_STEPS, WINDOW_STEPS)
        host_policy = AgingLfuPolicy(PERIOD_STEPS, WINDOW_STEPS)
    else:
        plan, host_policy = DeviceResidency(experts, slots, where), LruPolicy()
    return plan, LayerResidency(experts, slots, host_policy)


def time_roundtrip(
    policy: str, layers: int, experts: int, slots: int, repeats: int, device: torch.device | None = None
) -> tuple[float, float]:
    """(pull ms, push ms) for all layers, medians over `repeats` after two warm-ups. On CUDA each repeat starts with the
    device idle (a synchronize before the clock), so the pull times its own device read and conversion, and the push
    the host's issue of its copies (not their transfer)."""
    pairs = [layer_pair(policy, experts, slots, device) for _ in range(layers)]
    pulls, pushes = [], []
    for i in range(repeats + 2):
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        pull_many(pairs)
        pulled = time.perf_counter()
        for layer, residency in pairs:
            layer.push_from(residency)
        if i >= 2:
            pulls.append(pulled - started)
            pushes.append(time.perf_counter() - pulled)
    return statistics.median(pulls) * 1e3, statistics.median(pushes) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--slots", type=int, default=54)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu", help="where the device plan's state lives (cuda: a GPU's)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(f"{args.layers} layers, E={args.experts}, K={args.slots}, {device}: ms per host-planned step, medians")
    print(f"{'policy':<10} {'pull_ms':>8} {'push_ms':>8} {'total_ms':>9}")
    for policy in ("lru", "lfu-aging", "duel"):
        pull_ms, push_ms = time_roundtrip(policy, args.layers, args.experts, args.slots, args.repeats, device)
        print(f"{policy:<10} {pull_ms:8.2f} {push_ms:8.2f} {pull_ms + push_ms:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
