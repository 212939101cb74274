"""Per-shape FP8 micro-benchmark on one GPU: `python scripts/bench_fp8.py --config configs/671b_3layer.toml
[--recipes bf16,rowwise,...] [--iters 20] [--bandwidth TB/s] [--json PATH] [--section.key=value ...]`.

For each distinct (in_features, out_features) of the dense linears dsv3.lowp.quant may convert at this config (at any
width: this table is what train.fp8_min_features is set from), one linear's forward + backward over the tokens of a
micro-batch, compiled, between two elementwise ops as in the model (a norm or SwiGLU makes its input, another op
takes its output), so that inductor can fuse the activation and gradient quantization into them: bf16 beside each
fp8 recipe. torch.profiler splits the time into GEMM kernels and the rest; "quant" is the rest less bf16's rest
(the two elementwise ops), beside its bandwidth floor (FLOOR). Then the routed experts (both grouped GEMMs and
SwiGLU, tokens × top-k / n_routed_experts rows per expert aligned to 16): bf16 beside quant.fp8_rowwise_grouped_mm.
Every recipe runs guarded: one that fails prints its error and the others still run; --json is rewritten after
every shape, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv3.config import UserError, load_config, run_main  # noqa: E402
from dsv3.lowp import quant  # noqa: E402
from dsv3.model import Transformer  # noqa: E402
from dsv3.moe import GroupedExperts  # noqa: E402
from scripts.bench import phase_of  # noqa: E402  (the training benchmark's kernel → phase names)

RECIPES = ("bf16", "tensorwise", "rowwise")
# Quantization's bandwidth floor for y = x Wᵀ, x [T, in], W [out, in], g = grad_out [T, out]: per operand
# (bf16 reads, e4m3 writes), 2 B and 1 B an element each.
#   tensorwise  one scale per tensor: an amax pass, then one read that writes both layouts the GEMMs take (forward
#               GEMM, one backward GEMM)
#   rowwise     x along in (y) and T (dW); W along in (y) and out (dx); g along out (dx) and T (dW): per axis an amax
#               pass and a cast
FLOOR = {
    "tensorwise": {"x": (2, 2), "w": (2, 2), "g": (2, 2)},
    "rowwise": {"x": (4, 2), "w": (4, 2), "g": (4, 2)},
}
GEMM_PHASES = ("dense GEMMs", "expert GEMMs")


def floor_bytes(recipe: str, tokens: int, in_features: int, out_features: int) -> float:
    sizes = {"x": tokens * in_features, "w": out_features * in_features, "g": tokens * out_features}
    return sum(sizes[op] * (2 * reads + writes) for op, (reads, writes) in FLOOR[recipe].items())


def fp8_linear(recipe: str, linear: nn.Linear) -> nn.Module:
    """`linear` as dsv3.lowp.quant converts it for `recipe` (without FSDP: no fp8 all-gather)."""
    holder = nn.Sequential(linear)
    quant.convert_to_fp8_training(holder, ["0"], recipe, fp8_all_gather=False)
    return holder[0]


def measure(module: nn.Module, inputs: tuple, iters: int, profile_iters: int) -> dict:
    """Median ms of a compiled silu → module → silu forward + backward, and its CUDA kernel ms split by phase."""
    torch._dynamo.reset()  # a fresh compile per module: the same code object would hit dynamo's recompile limit
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda h, *rest: F.silu(module(F.silu(h), *rest)))
    started = time.perf_counter()
    grad = torch.randn_like(compiled(*inputs))
    compile_s = time.perf_counter() - started

    def step() -> None:
        for p in (inputs[0], *module.parameters()):
            p.grad = None
        compiled(*inputs).backward(grad)

    for _ in range(3):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(profile_iters):
            step()
        torch.cuda.synchronize()
    kernels = {e.key: e.self_device_time_total / 1e3 / profile_iters for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA}
    gemm = sum(ms for name, ms in kernels.items() if phase_of(name) in GEMM_PHASES)
    table = {}  # names cut to 120 characters: kernels that share the prefix (CUTLASS variants) are summed, not lost
    for name, ms in kernels.items():
        total, phase = table.get(name[:120], (0.0, phase_of(name)))
        table[name[:120]] = (total + ms, phase)
    return {"ms": statistics.median(times), "gemm_ms": gemm, "other_ms": sum(kernels.values()) - gemm,
            "compile_s": compile_s, "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
            "kernels": {name: [round(ms, 4), phase] for name, (ms, phase) in table.items()}}


def guarded(label: str, run) -> dict:
    try:
        return run()
    except Exception as e:  # noqa: BLE001  (one recipe failing must not stop the others)
        message = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        print(f"  {label}: FAILED {message}", flush=True)
        return {"error": message}


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {', '.join(RECIPES)}")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--profile-iters", type=int, default=3)
    parser.add_argument("--bandwidth", type=float, help="HBM TB/s for the floor (default: H200 4.8, else 3.35)")
    parser.add_argument("--json", help="write the results here")
    args, overrides = parser.parse_known_args()
    recipes = args.recipes.split(",")
    if unknown := set(recipes) - set(RECIPES):
        raise UserError(f"unknown --recipes {sorted(unknown)}: choose from {', '.join(RECIPES)}")
    if not torch.cuda.is_available():
        raise UserError("scripts/bench_fp8.py times CUDA kernels: run it on a GPU (compute capability >= 8.9)")
    cfg = load_config(args.config, overrides)
    mcfg = cfg.model_config()
    tokens = cfg.train.micro_batch * cfg.train.seq_len
    device_name = torch.cuda.get_device_name()
    bandwidth = args.bandwidth or (4.8 if "H200" in device_name else 3.35)
    with torch.device("meta"):
        model = Transformer(mcfg)
    shapes = Counter((m.in_features, m.out_features) for m in
                     map(model.get_submodule, quant.convertible_linears(model, "fp8")))
    result = {"config": args.config, "overrides": overrides, "device": device_name, "torch": torch.__version__,
              "tokens": tokens, "bandwidth_tb_s": bandwidth, "fp8_min_features": cfg.train.fp8_min_features,
              "dense": [], "experts": {}}
    print(f"{device_name} | {args.config} {' '.join(overrides)} | {tokens} tokens per micro-batch | floor at "
          f"{bandwidth} TB/s | train.fp8_min_features {cfg.train.fp8_min_features}", flush=True)
    header = f"{'in→out':>13} {'×n':>3} {'recipe':<19} {'ms':>7} {'vs bf16':>7} {'gemm':>7} {'quant':>7} " \
             f"{'floor GB':>8} {'floor ms':>8}"
    for recipe in (r for r in recipes if r != "bf16"):
        print(f"  floor {recipe}: " + ", ".join(f"{op} {reads} bf16 reads + {writes} e4m3 writes"
                                                for op, (reads, writes) in FLOOR[recipe].items()), flush=True)
    print(header, flush=True)
    started = time.perf_counter()
    for (in_features, out_features), count in sorted(shapes.items()):
        row = {"in": in_features, "out": out_features, "count": count,
               "converted_by_default": min(in_features, out_features) >= cfg.train.fp8_min_features, "recipes": {}}
        h = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for recipe in recipes:
            def run(recipe: str = recipe) -> dict:
                torch.manual_seed(0)
                linear = nn.Linear(in_features, out_features, bias=False, device="cuda", dtype=torch.bfloat16)
                return measure(linear if recipe == "bf16" else fp8_linear(recipe, linear), (h,), args.iters,
                               args.profile_iters)

            row["recipes"][recipe] = guarded(f"{in_features}→{out_features} {recipe}", run)
        base = row["recipes"].get("bf16", {})
        for recipe, r in row["recipes"].items():
            if "error" in r:
                continue
            if recipe != "bf16":
                r["floor_gb"] = floor_bytes(recipe, tokens, in_features, out_features) / 1e9
                r["floor_ms"] = r["floor_gb"] / bandwidth
                if "other_ms" in base:
                    r["quant_ms"] = r["other_ms"] - base["other_ms"]
            speedup = f"{base['ms'] / r['ms']:.3f}×" if "ms" in base else "-"
            floor = f"{r['floor_gb']:8.3f} {r['floor_ms']:8.3f}" if "floor_gb" in r else f"{'-':>8} {'-':>8}"
            quant_ms = f"{r['quant_ms']:7.3f}" if "quant_ms" in r else f"{'-':>7}"
            breaks = f"  {r['graph_breaks']} graph breaks" if r["graph_breaks"] else ""
            print(f"{f'{in_features}→{out_features}':>13} {count:>3} {recipe:<19} {r['ms']:7.3f} {speedup:>7} "
                  f"{r['gemm_ms']:7.3f} {quant_ms} {floor}{breaks}", flush=True)
        result["dense"].append(row)
        write_json(args.json, result)
        del h
    # the dense linears of one micro-batch, summed (×n), for the recipes that ran at every shape
    complete = [recipe for recipe in recipes if all("ms" in row["recipes"][recipe] for row in result["dense"])]
    totals = {recipe: {key: sum(row["count"] * row["recipes"][recipe].get(key, 0.0) for row in result["dense"])
                       for key in ("ms", "gemm_ms", "quant_ms", "floor_ms")} for recipe in complete}
    if totals:
        result["dense_total"] = totals
        print("  Σ over the linears above, ×n:")
        for recipe, total in totals.items():
            print(f"    {recipe:<19} {total['ms']:8.2f} ms, GEMMs {total['gemm_ms']:8.2f} ms, quantization "
                  f"{total['quant_ms']:7.2f} ms (floor {total['floor_ms']:.2f} ms)", flush=True)

    # routed experts: one GroupedExperts (w13 and w2 grouped GEMMs, SwiGLU between) at balanced, aligned groups
    group = quant.GROUP_ALIGN["fp8"]
    rows = -(-tokens * mcfg.n_activated_experts // mcfg.n_routed_experts // group) * group
    counts = torch.full((mcfg.n_routed_experts,), rows, device="cuda")
    h = torch.randn(rows * mcfg.n_routed_experts, mcfg.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    print(f"routed experts: {mcfg.n_routed_experts} × [{mcfg.dim}→2×{mcfg.moe_inter_dim}→{mcfg.dim}], {rows} rows "
          f"each", flush=True)
    for recipe in ("bf16", "rowwise"):
        def run(recipe: str = recipe) -> dict:
            torch.manual_seed(0)
            experts_class = quant.Fp8RowwiseExperts if recipe == "rowwise" else GroupedExperts
            experts = experts_class(mcfg.n_routed_experts, mcfg.dim, mcfg.moe_inter_dim).to("cuda", torch.bfloat16)
            nn.init.normal_(experts.w13, std=0.02)
            nn.init.normal_(experts.w2, std=0.02)
            return measure(experts, (h, counts), args.iters, args.profile_iters)

        r = result["experts"][recipe] = guarded(f"experts {recipe}", run)
        if "ms" in r:
            base = result["experts"].get("bf16", {})
            speedup = f"{base['ms'] / r['ms']:.3f}×" if "ms" in base else "-"
            print(f"  {recipe:<8} {r['ms']:8.3f} ms {speedup:>7}  gemm {r['gemm_ms']:.3f} ms, other "
                  f"{r['other_ms']:.3f} ms", flush=True)
    write_json(args.json, result)
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    run_main(main)
