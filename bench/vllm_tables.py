"""Tables of the vLLM plugin's rows (bench.vllm_needle, bench.vllm_serve), for the markers in docs/vllm.md."""

from __future__ import annotations

from statistics import median

from .stats import paired, paired_cell


def needle_table(rows: list[dict]) -> str:
    lines = ["| budget | answer found (transformers / vLLM) | greedy tokens alike | layers routed alike | "
             "moves (promoted / demoted / evicted) | KV blocks vLLM got back | bytes QEvict holds / FullKV's |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["budget"]):
        moves = r["vllm_moves"]
        same = "same" if moves == r["engine_moves"] else f"transformers {r['engine_moves']}"
        lines.append(f"| {r['budget']:.0%} | {'yes' if r['engine_found'] else 'no'} / "
                     f"{'yes' if r['vllm_found'] else 'no'} | {r['tokens_agreeing']} of "
                     f"{max(r['engine_tokens'], r['vllm_tokens'])} | {r['layers_same_tiers']} of {r['layers']} | "
                     f"{moves['promotions']} / {moves['demotions']} / {moves['evictions']} ({same}) | "
                     f"{r['blocks_freed']} of {r['prompt_blocks']} prompt blocks | "
                     f"{r['qevict_bytes'] / r['fullkv_bytes']:.3f} |")
    first = rows[0]
    return (f"The studio's needle example ({first['prompt_tokens']:,} tokens), Ω = 32, vLLM {first['vllm']}, "
            f"commit {', '.join(sorted({r['commit'] for r in rows}))}.\n\n" + "\n".join(lines) + "\n")


def serve_table(rows: list[dict]) -> str:
    """Per setting: retrieval paired with vLLM alone over the prompts, and medians over rounds of speed and of the
    KV memory at its peak (vLLM's blocks in use at once x their bytes, plus what QEvict's caches held at most)."""
    alone = [r for r in rows if r["method"] == "vllm"]
    if not alone:
        return "No vLLM-alone rows to compare with.\n"
    base_scores = alone[0]["scores"]
    base_speed = median(r["tokens_per_second"] for r in alone)
    base_memory = median(r["peak_blocks"] * r["block_bytes"] for r in alone)
    lines = ["| setting | string_match_all × 100 | − vLLM alone | tokens/s (median [range]) | × vLLM alone | "
             "peak blocks in use | peak KV MB (blocks + QEvict) | × vLLM alone | blocks handed back |",
             "|---|---|---|---|---|---|---|---|---|"]
    settings = sorted({r["budget"] for r in rows if r["budget"] is not None})
    for budget in [None] + settings:
        mine = [r for r in rows if r["budget"] == budget]
        scores = mine[0]["scores"]
        diff = "—" if budget is None else paired_cell(paired(scores, base_scores), 100, 1, "higher")
        speed = median(r["tokens_per_second"] for r in mine)
        memory = median(r["peak_blocks"] * r["block_bytes"] + r["qevict_peak_bytes"] for r in mine)
        name = "vLLM alone" if budget is None else f"vLLM + QEvict @{budget:.0%}"
        speeds = [r["tokens_per_second"] for r in mine]
        lines.append(f"| {name} | {100 * sum(scores) / len(scores):.1f} | {diff} | {speed:.1f} "
                     f"[{min(speeds):.1f}–{max(speeds):.1f}] | "
                     f"{speed / base_speed:.2f} | {median(r['peak_blocks'] for r in mine):.0f} of "
                     f"{mine[0]['pool_blocks']} | {memory / 2**20:.0f} | {memory / base_memory:.2f} | "
                     f"{median(r['blocks_freed'] for r in mine):.0f} |")
    first = rows[0]
    return (f"{first['requests']} RULER-style prompts of {first['length']:,} tokens (seed {first['seed']}) served "
            f"together, {len(alone)} rounds per setting, vLLM {first['vllm']}, commit "
            f"{', '.join(sorted({r['commit'] for r in rows}))}, "
            f"{first['cores']} cores shared with other benchmarks.\n\n" + "\n".join(lines) + "\n")
