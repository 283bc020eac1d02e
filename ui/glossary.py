"""Words for everything the studio shows: the columns, the tiers and the paper's diagnostics (Appendix I)."""

GLOSSARY = """
**Tiers** (QEvict keeps the past in contiguous *windows* of Ω tokens):
- **sink** — the first few tokens, always kept in full precision (attention piles up on them).
- **recent** — the newest tokens, always kept in full precision until they are old enough to be routed.
- **full precision** — windows ranked highest by cumulative attention, kept exactly.
- **low-bit** — the next windows, stored in 2 or 4 bits per number. They still take part in attention and keep
  earning score, so a window can be **promoted** back to full precision (▲) when it becomes important again, or
  **demoted** to low-bit (▼) when it fades. Its codes are written once and reused, so moves add no error.
- **evicted** — the lowest-ranked windows, deleted for good.

**QEvict's settings** (the `qevict` lane): windows routed per layer every Ω = 8 tokens; the low-bit tier in INT4
with float16 scales, sized first to hold 70% of the windows (*coverage* κ = 0.7; the bytes left buy full-precision
windows); a window ranks by its score plus a tenth of the score of the window before it (*forward pooling*), so a
kept passage tends to keep its continuation. `qevict_paper` is the paper's configuration taken literally: INT2,
Eq. 3's split (q = 0.70), no pooling.

**Lane cards and the stats table**
- **KV MiB / % of FullKV** — bytes of every tensor the cache keeps right now (keys, values, codes, scales, window
  ids, score tables, buffers, and the room QEvict's buffers hold for the tokens to come), against the uncompressed
  cache of the same tokens. A lane that stops early can show a little more than its budget, which is a share of
  the whole run's FullKV bytes.
- **full / low-bit / evicted tokens** — tokens of one layer in each tier, averaged over layers; the same unit for
  every method. Eviction baselines have no low-bit tier; KIVI keeps everything in low bits plus a recent residual.
- **promotions / demotions** — window moves between the tiers, summed over layers (and over KV heads for
  `qevict_head`, which routes each head on its own: its tier map and scores show the head picked next to the layer).
- **ms per token in this run** — on the lane card and in the table: the lanes share one batched forward; each lane's
  figure is the shared part of it plus its own cache updates and attention, timed inside that forward (on a GPU,
  the shared forward's time), under whatever load the machine had at the time. It is not a speed measurement.
  **Time the lanes alone** (Replay tab) measures one: each lane rebuilt on the run's prompt, its decode steps
  timed one by one, interleaved with the other lanes' in one process — what `bench.tpot` measures — with the
  ratio to FullKV.
- **% same as FullKV** — share of positions where the lane produced FullKV's token; the card says where the two
  texts first differ (the differing part is underlined).
- **budget** — the bytes a method may keep, as a share of FullKV's bytes for the whole run. On short runs some
  methods need more than the chosen share just to exist; such a lane runs at the least it can and says so.

**Diagnostics** (Replay tab; against FullKV attention recomputed over the lane's own tokens)
- **FMM (H = 32)** — Future Missed Mass: of the attention FullKV pays in the next 32 steps to tokens that existed
  at a routing event, the share that falls on tokens the policy made inaccessible. Lower is better.
- **FMM without the low-bit tier** — the same, counting low-bit windows as gone: what the recoverable tier saves.
- **churn** — Selection Churn: Jaccard distance between the historical tokens kept at consecutive routing events
  (the recent region excluded). Lower means steadier decisions.
- **QSA** — Quantized-Score Agreement: cosine between the scores the low-bit windows earn under low-bit attention
  and under FullKV. Near 1 means low bits still rank windows like full precision.
- **R_Q** — total score of the low-bit windows under low-bit attention over the same under FullKV (below 1: the
  low-bit copies draw less attention).
- **μ full / low-bit / evicted** — share of FullKV's cumulative attention over the windows (the sinks are no
  window) held by each tier, per head, then averaged over heads (Eq. 15); the rest is the recent region's.
- **LIR** — Global Lost-Importance Return: of the episodes in which a window stayed out of the full tier for at
  least 3 routing events, the share that came back later. High means decisions are often revised.
"""
