"""Where the time of the one-launch decoder layer goes: per phase, from every block's entry and
end times (%globaltimer, ns) on MLX's CUDA backend.

    python3 benchmarks/cuda_layer_phases.py [--models qwen3-0.6b,qwen3-8b] [--layers 1,4]
        [--prompt 512] [--reps 20] [--batch 1,4,8] [--attn-blocks 264,132] [--resident 528,396]
        [--disable '' --disable NAMES] [--flush-l2 MB] [--kv-bits 8] [--stamps]
        [--out benchmarks/results/cuda_layer_phases]

Builds each synthetic model (4-bit, as many layers as the largest --layers), patches it, and
launches its first n fused layers (n per --layers) as one layer launch with stamps, for --batch rows,
(layer.layers_launch(stamps=True), read by backends/cuda/phases.py) over a KV cache of --prompt
positions (--kv-bits 4 / 8: mlx-lm's QuantizedKVCache layout in groups of 64, as kv_bits makes it),
--reps times after 3 warm-up launches. Per group of blocks (layer j, phase p), medians
over the reps, in us from the launch's first block entry:
  late:     (most over the reps) blocks that entered only after one of the group's own blocks had
            ended: they were not resident beside the rest (a second wave)
  first in: the group's first block entry (blocks are dispatched in index order)
  ready:    the previous group's last block end (this group's blocks may proceed from here on)
  p90 end / end: when 90% / all of the group's blocks had ended
  time:     end - ready, the group's share of the critical path; GB/s = its bytes (weights,
            scales and biases; attention: the K/V rows) / time, and as % of the copy bandwidth
            measured at the start of the run (cuda_kernels.copy_bandwidth: 1 GiB read and written)
  set tail: the QKV and attention phases complete in ticketed sets (a head's blocks; the splits
            of a row, kv head and head subgroup) whose last block then runs the head epilogue / the
            split merge: per set, its last block end minus its second-last (phases.set_tails),
            median over the sets / the set that ended last
Then, per phase, where its blocks' time goes (the marks: thread 0's times; phases.MARKS says what each
is in each kernel): when the median / p90 block had waited for its inputs, done its first step (x
staged; attention: its chunk read), written its own outputs, and ended (after a ticketed set's work,
if it was the set's last). Then, per phase, by how many of its blocks an SM ran (phases.sm_load, in
the median rep): how many SMs ran that many and when those blocks ended (the median).
Before each launch, --flush-l2 MB (default 128, 0: none) of another buffer are read (summed), so that
the launch finds other, clean data in the 50 MB L2, as a decode step's layer does (the previous
layer's rows); without it a launch of one layer re-runs the same layer every rep, and weights that fit
the L2 may still be there from the previous rep. Not written: a written buffer leaves the L2 dirty, and
the launch then pays for its write-back (Qwen3-8B after 8192 tokens: 4-5 us more attention in the
layer after such a flush than in a 36-layer launch's others; docs/cuda-design.md, "What limits decode").
The stamps add a barrier and three stores per block: these are timings of an instrumented kernel,
whose registers (hence blocks per SM) must be the plain launch's (tests/cuda_compile_check.py);
the summary's resident blocks seen show it.
One set of tables per --attn-blocks (attention.ATTN_TARGET_BLOCKS, hence the splits of the
sequence), --resident (gemv.RESIDENT_BLOCKS, the block slots the GEMV phases' blockings assume) and
--disable set (fusions of mlx_fastops.FUSIONS patched off); a summary comes last, with the most
blocks seen resident at once (in the launch, on one SM, and how many SMs ran blocks).
Writes OUT.md and OUT.json; with --stamps the JSON also holds, per table, the rep whose launch ended at
the median: every block's stamps in launch order (phases.relative_stamps), with the groups' sizes.
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("qkv", "attention", "o_proj", "gate_up", "down")
KV_GROUP = 64   # a quantised cache's group size (mlx-lm's QuantizedKVCache default)


def median_rows(runs):
    """Element-wise median over the runs' per-group tuples (phase_rows, set_tails; None stays None)."""
    return [None if row is None else tuple(statistics.median(r[i][k] for r in runs) for k in range(len(row)))
            for i, row in enumerate(runs[0])]


def phase_bytes(fb, batch, ctx, kv_bits=0):
    """Bytes each phase of one layer must read: packed weights + scales + biases; attention: the
    K and V rows of ctx positions (kv_bits: packed, with a bf16 scale and bias per group of 64)."""
    wb = lambda w: w.weight.nbytes + w.scales.nbytes + w.biases.nbytes
    row = fb.D * kv_bits // 8 + 4 * (fb.D // KV_GROUP) if kv_bits else fb.D * 2
    kv = 2 * batch * fb.HKV * ctx * row   # K and V
    return [wb(fb.qkv), kv, wb(fb.o), wb(fb.gate_up), wb(fb.down)]


def measure(name, nlayers, prompt, reps, attn_blocks, disable, residents=(None,), batch=1, flush_mb=128, kv_bits=0,
            keep_stamps=False):
    import mlx.core as mx
    import numpy as np

    import mlx_fastops
    from mlx_fastops import kernels, synthetic_model
    from mlx_fastops.backends.cuda import attention, cache, gemv, layer, source
    from mlx_fastops.backends.cuda.phases import (late_blocks, mark_rows, phase_rows, relative_stamps, residency,
                                                   set_tails, sm_load)

    os.environ["MLX_FASTOPS_BACKEND"] = "cuda"
    model = synthetic_model(name, bits=4, layers=max(nlayers))
    mlx_fastops.patch(model, disable=disable, tune="off")   # the kernels themselves, untuned
    fbs = [b.fast_fn for b in model.model.layers]
    fb = fbs[0]
    S = -(-(prompt + 1) // cache.StaticKVCache.step) * cache.StaticKVCache.step
    caches = [[mx.random.normal((batch, fb.HKV, S, fb.D)).astype(mx.bfloat16) for _ in range(2)] for _ in fbs]
    if kv_bits:   # packed words, scales, biases of k, then of v (head.cache_inputs)
        caches = [[a for c in pair for a in mx.quantize(c, group_size=KV_GROUP, bits=kv_bits)] for pair in caches]
    x = mx.random.normal((batch, 1, model.args.hidden_size)).astype(mx.bfloat16)
    mx.eval(caches, x)
    off = source.offset_array(prompt)
    nbytes = phase_bytes(fb, batch, prompt + 1, kv_bits)
    out = []
    default_target, default_resident = attention.ATTN_TARGET_BLOCKS, gemv.RESIDENT_BLOCKS
    try:
        for target, resident, n in [(t, r, n) for t in attn_blocks for r in residents for n in nlayers]:
            attention.ATTN_TARGET_BLOCKS = target   # attention splits: floor(target / (batch * kv heads * head subgroups))
            if (resident or default_resident) != gemv.RESIDENT_BLOCKS:
                gemv.RESIDENT_BLOCKS = resident or default_resident   # the GEMV phases' blockings
                kernels.clear_builders()
            nsplit = layer.attention_splits(fb, batch)[0]
            bufs = [(*c, c[1] if kv_bits else c[0]) for c in caches[:n]]   # the cache, then a last reader (a T array)
            # Every launch's stamps stay on the GPU until the last has run: a buffer the host has read
            # is managed memory on the host's side, and MLX reuses freed buffers for the next launch's
            # outputs, whose first writes would then fault (phases many times their length).
            mx.clear_cache()
            stamped = []
            junk = mx.zeros(((flush_mb << 20) // 2,), dtype=mx.float16) if flush_mb else None
            for r in range(reps + 3):   # 3 warm-up launches
                if junk is not None:   # the L2 holds other, clean lines when the launch starts
                    mx.eval(junk.sum())
                _, _, st, groups = layer.layers_launch(fbs[:n], x, off, bufs, stamps=True)
                mx.eval(st)
                stamped.append(st)
            stamped = [np.array(st) for st in stamped[3:]]
            per_rep = [phase_rows(st, groups) for st in stamped]
            rows = median_rows(per_rep)
            late = [max(c) for c in zip(*(late_blocks(st, groups) for st in stamped))]
            res = [max(c) for c in zip(*(residency(st) for st in stamped))]
            sets = layer.ticketed_sets(fb, groups, batch)
            tails = median_rows([set_tails(st, groups, sets) for st in stamped])
            marks = [median_rows([mark_rows(st, groups, q) for st in stamped]) for q in (50, 90)]
            ends = [r[-1][3] for r in per_rep]
            median_rep = stamped[sorted(range(len(ends)), key=ends.__getitem__)[len(ends) // 2]]
            per_sm = sm_load(median_rep, groups)
            table = []
            for i, (first, ready, p90, end) in enumerate(rows):
                t = end - ready
                table.append({"layer": i // len(PHASES), "phase": PHASES[i % len(PHASES)], "blocks": groups[i],
                              "late_max": late[i], "first_in_us": first, "ready_us": ready, "p90_end_us": p90,
                              "end_us": end, "time_us": t, "set_tail_us": tails[i],
                              "marks_median_us": marks[0][i], "marks_p90_us": marks[1][i],
                              "per_sm": {str(k): v for k, v in per_sm[i].items()},
                              "GBs": nbytes[i % len(PHASES)] / (t * 1e-6) / 1e9 if t > 0 else None})
            out.append({"model": name, "layers": n, "prompt": prompt, "batch": batch, "reps": reps, "flush_l2_MB": flush_mb,
                        "kv_bits": kv_bits,
                        "attn_target_blocks": target, "attn_splits": nsplit, "disabled": sorted(disable),
                        "resident_blocks_assumed": gemv.RESIDENT_BLOCKS,
                        "resident_max": res[0], "resident_per_sm_max": res[1], "sms": res[2],
                        "total_us": rows[-1][3], "phases": table, "groups": list(groups)}
                       | ({"stamps_median_rep": relative_stamps(median_rep)} if keep_stamps else {}))
    finally:
        attention.ATTN_TARGET_BLOCKS = default_target   # the sweep leaves the modules as it found them
        if gemv.RESIDENT_BLOCKS != default_resident:
            gemv.RESIDENT_BLOCKS = default_resident
            kernels.clear_builders()
    mlx_fastops.unpatch(model)
    return out


def markdown(results, meta):
    lines = ["# One-launch decoder layer: time per phase (instrumented kernel)", "",
             f"device {meta['device']}; mlx {meta['mlx']}; commit {meta.get('commit')} (sources {meta['source']}); "
             f"measured copy bandwidth {meta['copy_GBs']:.0f} GB/s; median of the reps; "
             "us from the launch's first block entry.", ""]
    summary = ["| model | batch | layers per launch | attention splits | disabled | RESIDENT_BLOCKS | instrumented us | "
               "us per layer | resident blocks seen (per SM, SMs) |",
               "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        off = ",".join(r["disabled"]) or "-"
        kv = f" (kv_bits {r['kv_bits']})" if r.get("kv_bits") else ""
        summary.append(f"| {r['model']}{kv} | {r['batch']} | {r['layers']} | {r['attn_splits']} | {off} | "
                       f"{r['resident_blocks_assumed']} | {r['total_us']:.1f} | {r['total_us'] / r['layers']:.1f} | "
                       f"{r['resident_max']} ({r['resident_per_sm_max']}, {r['sms']}) |")
        lines += [f"## {r['model']}, {r['layers']} layer(s) per launch, batch {r['batch']}, "
                  f"{r['prompt']} cached positions{', kv_bits %d' % r['kv_bits'] if r.get('kv_bits') else ''}, "
                  f"{r['attn_splits']} attention splits, "
                  f"disabled {off}, RESIDENT_BLOCKS {r['resident_blocks_assumed']}, "
                  f"L2 flushed with {r['flush_l2_MB']} MB: "
                  f"{r['total_us']:.1f} us", "",
                  "| layer | phase | blocks | late | first in | ready | p90 end | end | time | set tail | GB/s | % of copy |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for p in r["phases"]:
            gbs = f"{p['GBs']:.0f} | {100 * p['GBs'] / meta['copy_GBs']:.0f}%" if p["GBs"] else "- | -"
            tail = "{:.1f} / {:.1f}".format(*p["set_tail_us"]) if p.get("set_tail_us") else "-"
            lines.append(f"| {p['layer']} | {p['phase']} | {p['blocks']} | {p['late_max']} | {p['first_in_us']:.1f} | {p['ready_us']:.1f} | "
                         f"{p['p90_end_us']:.1f} | {p['end_us']:.1f} | {p['time_us']:.1f} | {tail} | {gbs} |")
        lines += ["", "Inside the phases (median / p90 block, us from the launch's first entry):", "",
                  "| layer | phase | ready | waited | first step | written | end |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for p in r["phases"]:
            cells = [f"{a:.1f} / {b:.1f}" for a, b in zip(p["marks_median_us"], p["marks_p90_us"])]
            lines.append(f"| {p['layer']} | {p['phase']} | {p['ready_us']:.1f} | {' | '.join(cells)} |")
        ks = sorted({int(k) for p in r["phases"] for k in p["per_sm"]})
        lines += ["", "Blocks of a phase per SM (the median rep): SMs that ran k of them / those blocks' median end, us:",
                  "", "| layer | phase | " + " | ".join(f"k = {k}" for k in ks) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in ks) + " |"]
        for p in r["phases"]:
            cells = ["{} / {:.1f}".format(*p["per_sm"][str(k)]) if str(k) in p["per_sm"] else "-" for k in ks]
            lines.append(f"| {p['layer']} | {p['phase']} | {' | '.join(cells)} |")
        lines.append("")
    return "\n".join(lines + ["## Summary (instrumented launch, median)", ""] + summary)


def main():
    import mlx.core as mx

    from mlx_fastops.bench import machine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--layers", default="1,4")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--attn-blocks", default="",
                    help="attention blocks to aim for (ATTN_TARGET_BLOCKS), comma-separated: one table each "
                         "(default: the module's)")
    ap.add_argument("--resident", default="",
                    help="block slots the GEMV phases' blockings assume (RESIDENT_BLOCKS), comma-separated: "
                         "one table each (default: the module's)")
    ap.add_argument("--disable", action="append", default=None,
                    help="comma-separated switches (mlx_fastops.FUSIONS) to patch without; repeatable: "
                         "one set of tables each ('' for the defaults)")
    ap.add_argument("--batch", default="1", help="activation rows (sequences) of the decode step, comma-separated")
    ap.add_argument("--flush-l2", type=int, default=128, help="MB of another buffer written before each launch (0: none)")
    ap.add_argument("--kv-bits", type=int, default=0, choices=(0, 4, 8),
                    help="the cache quantised as mlx-lm's QuantizedKVCache with kv_bits (0: the float cache)")
    ap.add_argument("--stamps", action="store_true", help="the median rep's raw stamps in OUT.json (unindented)")
    ap.add_argument("--out", default="benchmarks/results/cuda_layer_phases", help="writes OUT.md and OUT.json")
    a = ap.parse_args()
    if not mx.cuda.is_available():
        sys.exit("cuda_layer_phases: MLX's CUDA backend is not available here")
    from benchmarks.cuda_kernels import copy_bandwidth

    m = machine()
    meta = {"device": m.get("gpu") or m["device"], "mlx": m["mlx"], "commit": m["commit"], "source": m["sources"],
            "copy_GBs": copy_bandwidth()}
    nlayers = [int(n) for n in a.layers.split(",")]
    from mlx_fastops.backends.cuda import attention
    targets = [int(t) for t in a.attn_blocks.split(",") if t] or [attention.ATTN_TARGET_BLOCKS]
    residents = [int(r) for r in a.resident.split(",") if r] or [None]
    results = [r for name in a.models.split(",") for b in a.batch.split(",") for d in (a.disable or [""])
               for r in measure(name, nlayers, a.prompt, a.reps, targets, [n for n in d.split(",") if n], residents,
                                int(b), a.flush_l2, a.kv_bits, a.stamps)]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "results": results},   # OUT may hold dots
                                              indent=None if a.stamps else 1))
    Path(f"{out}.md").write_text(markdown(results, meta))
    print(markdown(results, meta))


if __name__ == "__main__":
    main()
