"""Training-step benchmark: `python scripts/bench.py --config configs/16b_4layer.toml [--steps 20] [--json]
[--section.key=value ...]` (also under torchrun).

Warm-up steps (compile, allocator), then timed steps on random tokens at train.py's lr schedule: tokens/s per GPU,
MFU, peak memory; then a few steps timed block by block: each transformer layer's forward + backward time and MFU,
dense and MoE, without the embedding, head, loss and optimizer (what a layer costs in a model of any depth, the
61-layer one included); then, after a warm-up step, a few profiled steps whose CUDA kernel time is split by phase from
kernel names, with the GPU's idle time and the exposed communication; then as many again with the CPU recorded too,
for the host's busy time and waits. At ep > 1 it prints each EP
rank's share of the routed tokens: at a constant full lr from step 1, random tokens collapse the routing within a few
steps (one rank got every token), which is not a throughput anyone trains at: `--balanced-routing` measures what a
balanced router gives (train.py on real data, where the bias balancing works, measures natural routing).
`--one-rank-exchange` measures, on one GPU, what EP's code path costs without the network; `--simulated-link-ms`
adds a link as slow as a real one (scripts/simulated_link.py) and reports how much of it the step hides.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from dsv3 import dispatch, parallel  # noqa: E402
from dsv3.config import UserError, load_config, run_main  # noqa: E402
from dsv3.determinism import make_deterministic  # noqa: E402
from dsv3.flops import flops_per_token, layer_flops_per_token, mfu, peak_flops  # noqa: E402
from dsv3.hashing import random_bits  # noqa: E402
from dsv3.metrics import memory_stats  # noqa: E402
from dsv3.model import MLP, Transformer  # noqa: E402
from dsv3.moe import Router, Routing  # noqa: E402
from dsv3.token_copies import pads_groups  # noqa: E402

# First match wins: kernel-name fragments (lower case; a tuple: all of them) → phase.
PHASES = [
    ("optimizer", ("adam", "multi_tensor_apply", "lerp")),  # lerp: dsv3.optim's compiled update (bf16 moments)
    ("attention", ("sdpa", "fmha", "flash", "attention", "cudnn")),
    ("loss", ("softmax", "nll_loss", "cross_entropy", "logsumexp", "chunk_loss")),
    # inductor's kernels that make a scaled GEMM's operands (named after the ops they fuse: the scales, the cast to
    # e4m3, and whatever made the operand, e.g. SwiGLU), before "grouped" would take them for the GEMM
    ("fp8 quantize", tuple((kind, op) for kind in ("triton_poi", "triton_red", "triton_per")
                           for op in ("scaled_", "fp8_block_grouped_mm"))),
    ("expert GEMMs", ("grouped", "group_gemm", "ptrarray", "groupproblem", "deep_gemm")),
    ("dense GEMMs", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "cublas")),
    # Triton scale-and-cast kernels (dsv3.lowp.fp8_kernels' _fp8_weight_*, _fp8_group_*; torchao's _triton_fp8_*), eager
    # casts to e4m3 (FSDP's fp8 all-gather), inductor's fusions of the scales: rowwise amax → exp2(floor(log2)),
    # tensorwise max(abs)
    ("fp8 quantize", ("fp8", "e4m3", "amax", "abs_max", "exp2_floor_log2")),
    ("communication", ("nccl", "all_gather", "reduce_scatter", "alltoall", "deep_ep", "simulated_link")),
    # dsv3.token_copies_kernels': _gather_rows_kernel, _combine_rows_backward_kernel, _sum_rows_kernel
    ("routing + permutation", ("sort", "topk", "radix", "scatter", "gather", "index", "cumsum", "bmm",
                               "combine_rows", "sum_rows")),
    # inductor names a kernel from its sorted aten ops: a cast is x·scale clamped to e4m3 (..._to_copy_abs_clamp_max_
    # mul... for tensorwise, maybe fused into the norm or SwiGLU that made x), _scaled_mm takes 1/scale; after routing,
    # whose combine also clamps
    ("fp8 quantize", (("_to_copy", "clamp"), "reciprocal")),
]


def phase_of(kernel: str) -> str:
    name = kernel.lower()
    for phase, fragments in PHASES:
        if any(f in name if isinstance(f, str) else all(part in name for part in f) for f in fragments):
            return phase
    return "other"


def uniform_topk(seed: torch.Tensor, n_tokens: int, n_experts: int, topk: int) -> torch.Tensor:
    """[T, K] expert ids, each token's a uniform random K-subset: the K largest of E random keys, a hash of (seed,
    token, expert). What balanced routing looks like to the exchange and the experts (every expert and EP rank gets
    its share, a token fans out over ranks as a learned router's would); a recompute routes as the forward did."""
    keys = random_bits(torch.empty(n_tokens, n_experts, device=seed.device), seed)  # [T, E]
    return keys.topk(topk, dim=-1).indices


def install_balanced_routing(model: Transformer) -> None:
    """--balanced-routing: every router picks each token's experts by `uniform_topk` instead of its scores, while its
    gate weights stay its own (it still learns them). A new draw per forward of the model (per micro-batch, rank and
    layer); a recompute reads the same seed. Checkpoints are unchanged: the seeds are not saved."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    routers = model.routers()
    for router in routers:
        router.register_buffer("uniform_seed", torch.zeros((), dtype=torch.int64, device=router.weight.device),
                               persistent=False)
        router.register_forward_hook(_route_uniformly)
    draws = itertools.count()

    @torch.no_grad()
    def reseed(*_) -> None:
        draw = next(draws)
        for layer, router in enumerate(routers):
            router.uniform_seed.fill_((draw * 2**16 + rank) * 2**8 + layer)

    model.register_forward_pre_hook(reseed)


def _route_uniformly(router: Router, args: tuple, routing: Routing) -> Routing:
    topk_idx = uniform_topk(router.uniform_seed, args[0].size(0), router.n_experts, router.topk)
    return Routing(topk_idx, router.gate_weights(routing.scores, topk_idx), routing.scores)


def install_one_rank_exchange(model: Transformer, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    """--one-rank-exchange: every MoE exchanges its tokens through the all_to_all dispatcher over the group of one
    rank, EP's code path (the split sizes' host sync, the exchange, the received rows' unbacked count) without the
    network (`group`: another group of one, e.g. a simulated link). At world 1 `parallel.apply_compile` compiles it as
    it does the local dispatcher (around the checkpoint), except where the all_to_all path pads its groups (low
    precision, B200): refused there."""
    if any(pads_groups(m.dispatcher.align, device) for m in parallel.moe_layers(model)):
        raise UserError("--one-rank-exchange measures the bf16 exchange on Hopper: here the experts' groups are "
                        "padded (a low precision, or a B200), which the one-rank path does not compile as EP does")
    for moe in parallel.moe_layers(model):
        moe.dispatcher = dispatch.AllToAllDispatcher(group or dist.group.WORLD, model.cfg.n_routed_experts)


def _clock(device: torch.device) -> torch.cuda.Event | float:
    """Now, in the device's order of work: a CUDA event recorded on the current stream, or the CPU's clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _ms(start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
    return start.elapsed_time(end) if isinstance(start, torch.cuda.Event) else 1e3 * (end - start)


class _TimedBlock(nn.Module):
    """Stands in for a block while layers are timed; the block itself (compiled, checkpointed, sharded) runs
    unchanged. Its forward is timed from entry to return; its backward from the moment its output's gradient is
    complete (a hook on the output) to the moment its input's is (a hook on the input)."""

    def __init__(self, block: nn.Module, device: torch.device):
        super().__init__()
        self.block, self.device = block, device
        self.forward_marks: list = []  # (start, end) per forward
        self.backward_starts: list = []
        self.backward_ends: list = []

    @property
    def ffn(self) -> nn.Module:  # Transformer.routers() looks for the block's MoE here
        return self.block.ffn

    def forward(self, x: torch.Tensor, *args):
        start = _clock(self.device)
        if x.requires_grad:
            x.register_hook(lambda _: self.backward_ends.append(_clock(self.device)))
        out = self.block(x, *args)
        self.forward_marks.append((start, _clock(self.device)))
        if out[0].requires_grad:
            out[0].register_hook(lambda _: self.backward_starts.append(_clock(self.device)))
        return out

    def milliseconds(self) -> tuple[float, float]:
        """(forward, backward) ms summed over every call so far."""
        forward = sum(_ms(a, b) for a, b in self.forward_marks)
        return forward, sum(_ms(a, b) for a, b in zip(self.backward_starts, self.backward_ends, strict=True))


@contextlib.contextmanager
def timed_blocks(model: Transformer, device: torch.device) -> list[_TimedBlock]:
    """Within: each block of `model` (main layers, then MTP) wrapped in a _TimedBlock, the wrappers yielded."""
    slots = [(model.layers, key) for key in model.layers] + [(m, "block") for m in model.mtp]
    originals = [getattr(owner, key) for owner, key in slots]
    timed = [_TimedBlock(block, device) for block in originals]
    for (owner, key), wrapper in zip(slots, timed):
        setattr(owner, key, wrapper)
    try:
        yield timed
    finally:
        for (owner, key), block in zip(slots, originals):
            setattr(owner, key, block)


def layer_times(model: Transformer, step, steps: int, device: torch.device, tokens: int, seq_len: int,
                peak: float | None) -> dict:
    """Run `step` (i → None) `steps` times with every block timed: per main-layer kind (dense, MoE), its mean
    forward and backward ms per step and its MFU at `tokens` per step (`peak` FLOP/s; None: no MFU)."""
    with timed_blocks(model, device) as timed:
        for i in range(steps):
            step(i + 1)
        _synchronize(device)
    per_kind: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for wrapper in timed[:len(model.layers)]:
        forward, backward = wrapper.milliseconds()
        per_kind["dense" if isinstance(wrapper.ffn, MLP) else "moe"].append((forward / steps, backward / steps))
    result = {}
    for kind, times in per_kind.items():
        forward, backward = (sum(t) / len(times) for t in zip(*times))
        flops = layer_flops_per_token(model.cfg, seq_len, moe=kind == "moe") * tokens
        result[kind] = {"layers": len(times), "forward_ms": forward, "backward_ms": backward,
                        "ms": forward + backward,
                        "mfu": flops / ((forward + backward) / 1e3) / peak if peak else None}
    return result


def expert_rows_vs_mean(loads: list[torch.Tensor]) -> list[float] | None:
    """Routed rows per expert against the layer's mean, [lowest, highest] over the steps' loads ([L, E] each):
    uneven groups slow the grouped GEMMs. None for a model without MoE layers, which routes nothing."""
    rows = torch.stack(loads).float()  # [steps, L, E]
    if not rows.numel():
        return None
    ratio = rows / rows.mean(-1, keepdim=True)
    return [ratio.min().item(), ratio.max().item()]


# CUDA runtime calls in which the host waits for the GPU: syncs, and copies, which wait for the work queued before
# them (EP's split sizes reach the host by one; the copies to the GPU, from pinned memory, take microseconds)
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
              "cudaMemcpy")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def gpu_times(kernels, steps: int) -> dict[str, float]:
    """Per profiled step, in ms: the GPU's idle time (no kernel on any stream) and the exposed communication (time in
    which only exchange and collective kernels ran: nothing hid them)."""
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    compute = [(e.time_range.start, e.time_range.end) for e in kernels if phase_of(e.name) != "communication"]
    span = max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0
    union = _union_us(spans)
    exposed = union - _union_us(compute)
    return {"gpu_idle": (span - union) / 1e3 / steps, "exposed_communication": exposed / 1e3 / steps}


def host_times(events, steps: int) -> dict[str, float]:
    """Per profiled step, in ms: the host's waits for the GPU (CUDA syncs and copies; DeepEP's wait for its receive
    counts is a spin inside its dispatch, not counted here) and the rest of the host's time from its first op to its
    last: busy."""
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    waits = sum(e.time_range.end - e.time_range.start for e in host if e.name in HOST_WAITS)
    host_span = max(e.time_range.end for e in host) - min(e.time_range.start for e in host) if host else 0.0
    return {"host_sync_wait": waits / 1e3 / steps, "host_busy": (host_span - waits) / 1e3 / steps}


def profile_steps(step, steps: int, activities: list, device: torch.device, trace: str | None = None) -> list:
    """The profiler's events of `steps` calls of `step` (i → None), after one warm-up call that it does not record
    (its own start-up, and a late peer, stay out of the figures); `trace`: a Chrome trace of them written there."""
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        for i in range(1 + steps):
            step(i + 1)
            if i == steps:
                _synchronize(device)
            prof.step()
    if trace:
        prof.export_chrome_trace(trace)
    return list(prof.events())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layer-steps", type=int, default=3, help="steps timed block by block (0: none)")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--balanced-routing", action="store_true",
                        help="each token's experts a uniform random K-subset (install_balanced_routing): every EP rank "
                             "gets its share, as with a trained router; random tokens otherwise collapse the routing")
    parser.add_argument("--one-rank-exchange", action="store_true",
                        help="one GPU: every MoE exchanges through all_to_all over the group of one, EP's code path "
                             "(graph breaks, host syncs, dynamic row counts) without the network")
    parser.add_argument("--simulated-link-ms", type=float,
                        help="with --one-rank-exchange: each exchange of token rows takes this long on its own stream "
                             "(scripts/simulated_link.py), and the profile reports the part of it no compute hid")
    parser.add_argument("--simulated-link-sms", type=int, default=24, help="the SMs the simulated link holds")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--kernels", help="write every profiled CUDA kernel (ms per step, phase) to this TSV file")
    parser.add_argument("--trace", help="write a Chrome trace (CPU ops and CUDA kernels) of the profiled steps here")
    args, overrides = parser.parse_known_args()
    cfg = load_config(args.config, overrides)
    mcfg, t = cfg.model_config(), cfg.train
    if t.deterministic:  # what --train.deterministic=true costs (before CUDA, cuBLAS and NCCL start, as in train.py)
        make_deterministic()
    rank, world, device = parallel.init_distributed(t.device)
    train.check_setup(cfg, world, device)
    if args.one_rank_exchange and (world > 1 or device.type != "cuda"):  # before the model is built
        raise UserError("--one-rank-exchange measures EP's code path on one GPU: run it without torchrun, on CUDA")
    if args.simulated_link_ms is not None and not args.one_rank_exchange:
        raise UserError("--simulated-link-ms simulates EP's link under --one-rank-exchange: add it")
    model, copies = train.build_model(cfg, world, device)
    link = None
    if args.simulated_link_ms:
        from scripts.simulated_link import simulated_link

        link = simulated_link(args.simulated_link_ms, args.simulated_link_sms, device)
    if args.one_rank_exchange:
        install_one_rank_exchange(model, device, link)
    if args.balanced_routing:
        install_balanced_routing(model)
    optimizer = train.build_optimizer(model, t, device, copies)
    local_batch = t.global_batch // world
    generator = torch.Generator(device="cpu").manual_seed(rank)

    losses, loads = [], []  # main loss, global tokens_per_expert [L, E] of every step

    def step(i: int) -> None:
        for group in optimizer.param_groups:  # train.py's schedule (see the module docstring)
            group["lr"] = train.lr_at(i, t)
        batch = torch.randint(0, mcfg.vocab_size, (local_batch, t.seq_len + 1), generator=generator)
        values, tokens_per_expert = train.train_step(model, optimizer, parallel.to_device(batch, device), t, i,
                                                     cfg.parallel.accumulate_unsharded_grads)
        losses.append(values[0])
        loads.append(tokens_per_expert)

    for i in range(args.warmup):
        step(i + 1)
    _synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def timed(first: int) -> float:
        """Seconds a step over `args.steps` steps from step `first`."""
        start = time.perf_counter()
        for i in range(args.steps):
            step(first + i)
        _synchronize(device)
        return (time.perf_counter() - start) / args.steps

    step_s = timed(args.warmup + 1)
    if link:  # alternating with the link at no delay, which tells the part of the link that the step shows
        link_calls, delayed_s, free_s = link.calls, [step_s], []
        for block in range(3):
            link.ns = 0 if block % 2 == 0 else int(args.simulated_link_ms * 1e6)
            (free_s if block % 2 == 0 else delayed_s).append(timed(args.warmup + (block + 1) * args.steps + 1))
        exchanges = (link.calls - link_calls) / (3 * args.steps)
        step_s, free_s = sum(delayed_s) / len(delayed_s), sum(free_s) / len(free_s)
        link.ns = int(args.simulated_link_ms * 1e6)  # the profiled steps' link
    tokens_per_s_per_gpu = local_batch * t.seq_len / step_s
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    flops = flops_per_token(mcfg, t.seq_len)
    peak_memory_gib = memory_stats().get("memory/peak_allocated_gib")
    if peak_memory_gib is not None and torch.distributed.is_initialized():  # the fullest GPU's (EP loads unevenly)
        fullest = torch.tensor(peak_memory_gib, device=device)
        torch.distributed.all_reduce(fullest, op=torch.distributed.ReduceOp.MAX)
        peak_memory_gib = fullest.item()
    result = {
        "config": args.config, "overrides": overrides, "world": world,
        "balanced_routing": args.balanced_routing, "one_rank_exchange": args.one_rank_exchange,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "step_ms": 1e3 * step_s, "tokens_per_s_per_gpu": tokens_per_s_per_gpu,
        "mfu": mfu(flops, tokens_per_s_per_gpu, 1, peak) if peak else None,
        "peak_memory_gib": peak_memory_gib,
        "gflop_per_token": flops / 1e9,
        "loss_first_last": [losses[0].item(), losses[-1].item()],  # a broken run shows here, not in the speed
    }
    if link:
        result["simulated_link"] = {"ms": args.simulated_link_ms, "sms": args.simulated_link_sms,
                                    "exchanges_per_step": exchanges, "ms_per_step": exchanges * args.simulated_link_ms,
                                    "step_ms_without_delay": 1e3 * free_s, "exposed_ms": 1e3 * (step_s - free_s)}
    rows_vs_mean = expert_rows_vs_mean(loads[args.warmup:args.warmup + args.steps])  # the timed steps
    if rows_vs_mean is not None:
        result["expert_rows_vs_mean_min_max"] = rows_vs_mean
    if cfg.parallel.ep > 1 and rows_vs_mean is not None:  # the share of routed token copies each EP rank received,
        ep, timed = cfg.parallel.ep, loads[args.warmup:args.warmup + args.steps]  # extremes over layers, timed steps
        per_rank = torch.stack(timed).view(len(timed), -1, ep, mcfg.n_routed_experts // ep).sum(-1).float()
        share = per_rank / per_rank.sum(-1, keepdim=True)  # [steps, L, ep]
        result["ep_rank_share_min_max"] = [share.min().item(), share.max().item()]

    if args.layer_steps:
        result["layer"] = layer_times(model, step, args.layer_steps, device, local_batch * t.seq_len, t.seq_len, peak)

    if args.profile_steps and device.type == "cuda":
        # The kernels from a pass that records only the GPU's activity: recording every CPU op slows the host about
        # 2× (busy 1.3-1.6 s in an 0.9 s step of the full 16B at EP 4), ranks then wait for each other in the
        # exchange, and idle and exposed communication grow far beyond the timed steps'. The host's figures from a
        # second pass, which records the CPU too (and which --trace writes).
        cuda = torch.profiler.ProfilerActivity.CUDA
        events = profile_steps(step, args.profile_steps, [cuda], device)
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
        ms: dict[str, float] = defaultdict(float)  # kernel name → ms per step
        for event in kernels:
            ms[event.name] += event.device_time_total / 1e3 / args.profile_steps
        ms = dict(sorted(ms.items(), key=lambda kv: -kv[1]))
        per_phase: dict[str, float] = defaultdict(float)
        for key, kernel_ms in ms.items():
            per_phase[phase_of(key)] += kernel_ms
        # NCCL kernels run on streams of their own, beside the compute: counted, they would be counted twice
        busy = sum(kernel_ms for phase, kernel_ms in per_phase.items() if phase != "communication")
        # the timed steps' time beyond the profiled steps' kernels: the GPU waiting (host, syncs), or the same kernels
        # running slower in the timed steps (as they do when a GPU's clocks fall under sustained load)
        per_phase["timed − kernels"] = max(1e3 * step_s - busy, 0.0)
        result["phase_ms"] = dict(sorted(per_phase.items(), key=lambda kv: -kv[1]))
        result["top_kernels_ms"] = [[ms[key], key[:100]] for key in list(ms)[:15]]  # names may share 100 chars
        cpu = torch.profiler.ProfilerActivity.CPU
        trace = args.trace if rank == 0 else None
        host_events = profile_steps(step, args.profile_steps, [cpu, cuda], device, trace)
        result["profiled_ms"] = gpu_times(kernels, args.profile_steps) | host_times(host_events, args.profile_steps)
        if link:  # the spin kernels' own time, a little over the asked-for delay
            result["simulated_link"]["ms_per_step"] = per_phase["communication"]
        if args.kernels and rank == 0:
            with open(args.kernels, "w") as f:
                f.writelines(f"{t:.3f}\t{phase_of(key)}\t{key}\n" for key, t in ms.items())

    if link:
        shown = result["simulated_link"]
        shown["hidden"] = 1 - shown["exposed_ms"] / shown["ms_per_step"]
    if rank == 0:
        if args.json:
            print(json.dumps(result))
        else:
            mfu_text = f"{100 * result['mfu']:.1f}%" if result["mfu"] else "n/a"
            mem = f"{result['peak_memory_gib']:.1f} GiB" if result["peak_memory_gib"] is not None else "n/a"
            print(f"\n{result['device']} × {world} | {args.config} {' '.join(overrides)}")
            print(f"{'tokens/s/GPU':>14} {'MFU':>7} {'step ms':>9} {'peak mem':>10}")
            print(f"{tokens_per_s_per_gpu:>14,.0f} {mfu_text:>7} {result['step_ms']:>9.1f} {mem:>10}")
            print(f"  loss: {result['loss_first_last'][0]:.3f} at the first step, {result['loss_first_last'][1]:.3f} "
                  "at the last")
            if "expert_rows_vs_mean_min_max" in result:
                low, high = result["expert_rows_vs_mean_min_max"]
                print(f"  routed rows per expert: {low:.2f}× to {high:.2f}× the mean")
            if "ep_rank_share_min_max" in result:
                low, high = result["ep_rank_share_min_max"]
                print(f"  routed tokens per EP rank: {100 * low:.1f}% to {100 * high:.1f}% of each layer's")
            for kind, layer in result.get("layer", {}).items():
                layer_mfu = f"{100 * layer['mfu']:.1f}%" if layer["mfu"] else "n/a"
                print(f"  {'dense' if kind == 'dense' else 'MoE'} layer (×{layer['layers']}): {layer['ms']:.1f} ms "
                      f"(forward {layer['forward_ms']:.1f}, backward {layer['backward_ms']:.1f}), MFU {layer_mfu}")
            if "profiled_ms" in result:
                times = result["profiled_ms"]
                print(f"  profiled step: GPU idle {times['gpu_idle']:.1f} ms, exposed communication "
                      f"{times['exposed_communication']:.1f} ms; host (under the CPU profiler, slower) busy "
                      f"{times['host_busy']:.1f} ms, waiting in CUDA syncs and copies {times['host_sync_wait']:.1f} ms")
            if "simulated_link" in result:
                link = result["simulated_link"]
                print(f"  simulated link: {link['ms_per_step']:.1f} ms a step ({link['exchanges_per_step']:.0f} "
                      f"exchanges), of which the step shows {link['exposed_ms']:.1f} ms (at no delay "
                      f"{link['step_ms_without_delay']:.1f} ms): {100 * link['hidden']:.0f}% hidden")
            for phase, ms in result.get("phase_ms", {}).items():
                print(f"  {phase:<24} {ms:8.1f} ms  {100 * ms / result['step_ms']:5.1f}%")
            for ms, kernel in result.get("top_kernels_ms", []):
                print(f"    {ms:8.2f} ms  {kernel}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # no rank tears the group down while another still talks to it
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
