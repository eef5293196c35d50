"""Reading the phase stamps of a layer launch (layer.layers_launch(..., stamps=True)).

The stamps are int64 [blocks, 6], one row per block in launch order: its entry and end time
(%globaltimer, ns), its SM id, then its marks (0 where the block exited before them: an attention
split past the valid length): MARKS, as thread 0 passed them. `groups` gives the blocks of each
group (layer j, phase p), in the same order. benchmarks/cuda_layer_phases.py turns these into
per-phase tables.
Some phases complete in sets (last_block.cuh): the block that takes a set's last ticket then does
the set's remaining work (the QKV phase's head epilogue over a head's blocks, the attention merge over
a row's splits); set_tails times that work from the stamps.
"""

import numpy as np

# The marks (cuda/layer.cuh's layer_mark, columns 3-5), thread 0's times: its wait for the previous
# group over (the launch's first group has none: its prologue's loads issued); its first step done (a
# GEMV: x staged with the input norm, or, sliced, the first slice; unstaged, the norm's pass over x, or
# nothing; attention: thread 0's rows of its chunk read); its own outputs written (gemv.cu: warp 0's
# rows; gemv_mma.cu: the block's, after a barrier; attention: its split's partial), before a ticketed
# set's last block goes on to the set's work.
MARKS = ("waited", "first step", "written")
STAMP_COLS = 3 + len(MARKS)   # entry, end, SM, the marks


def by_group(stamps, groups):
    """(the launch's first entry, each group's rows of the stamps, in launch order)."""
    st = np.asarray(stamps, dtype=np.int64)
    bounds = np.cumsum([0, *groups])
    return st[:, 0].min(), [st[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def phase_rows(stamps, groups):
    """Per group: (first entry, ready, p90 end, end) in us from the launch's first entry; ready is
    the previous group's last end, from which this group's blocks may proceed."""
    t0, parts = by_group(stamps, groups)
    rows, ready = [], 0.0
    for part in parts:
        g = (part[:, :2] - t0) / 1e3
        end = float(g[:, 1].max())
        rows.append((float(g[:, 0].min()), ready, float(np.percentile(g[:, 1], 90)), end))
        ready = end
    return rows


def relative_stamps(stamps):
    """The stamps with every time in ns from the launch's first entry (a mark of 0, not reached,
    stays 0; the SM column as it is): one launch's blocks as plain lists, for reading offline."""
    st = np.asarray(stamps, dtype=np.int64).copy()
    t0 = st[:, 0].min()
    times = [c for c in range(STAMP_COLS) if c != 2]
    st[:, times] = np.where(st[:, times] != 0, st[:, times] - t0, 0)
    return st.tolist()


def late_blocks(stamps, groups):
    """Per group: blocks that entered only after one of the group's own blocks had ended, i.e. in
    a slot that the group itself freed: they did not fit beside the rest (a second wave)."""
    return [int((g[:, 0] > g[:, 1].min()).sum()) for g in by_group(stamps, groups)[1]]


def residency(stamps):
    """(most blocks resident at once in the launch, most on one SM, SMs that ran blocks)."""
    st = np.asarray(stamps, dtype=np.int64)

    def most(rows):   # an end sorts before an entry at the same time: a slot handed on is not two
        events = sorted([(t, 1) for t in rows[:, 0]] + [(t, -1) for t in rows[:, 1]])
        return int(np.max(np.cumsum([d for _, d in events])))

    sms = np.unique(st[:, 2])
    return most(st), max(most(st[st[:, 2] == sm]) for sm in sms), len(sms)


def layer_sets(groups, heads, nsplit, phases):
    """Blocks per ticketed set of each group of a layer launch (`phases` groups a layer): the QKV
    phase's are a head's blocks (`heads` q, k and v heads), the attention phase's the `nsplit` splits
    of one (row, kv head, head subgroup); 0 for the other phases."""
    return [{0: groups[i] // heads, 1: nsplit}.get(i % phases, 0) for i in range(len(groups))]


def set_tails(stamps, groups, sets):
    """Per group, with sets[i] its blocks per ticketed set (consecutive in launch order; 0: the group
    has none): (median over its sets, and for the set that ended last) of the set's last block end
    minus its second-last, in us: the work of the block that completed the set after the others had
    taken their tickets, plus how much later than them it took its own (an attention row short enough
    for one split has no merge: its set's tail is then a split's time). None for a group without sets;
    a set size that does not tile its group is an error."""
    out = []
    for g, n in zip(by_group(stamps, groups)[1], sets):
        if n < 2:
            out.append(None)
            continue
        if len(g) % n:
            raise ValueError(f"sets of {n} blocks do not tile a group of {len(g)}")
        ends = np.sort(g[:, 1].reshape(-1, n), axis=1)
        tails = (ends[:, -1] - ends[:, -2]) / 1e3
        out.append((float(np.median(tails)), float(tails[np.argmax(ends[:, -1])])))
    return out


def mark_rows(stamps, groups, q=50):
    """Per group: the q-th percentile over its marked blocks of each mark, then of the end, in us from
    the launch's first entry. Every group has marked blocks (an attention row's first split always
    waits); one without is an error."""
    t0, parts = by_group(stamps, groups)
    rows = []
    for g in parts:
        marked = g[(g[:, 3:] != 0).all(axis=1)]
        if not len(marked):
            raise ValueError(f"group {len(rows)}: no block marked")
        cols = np.concatenate([marked[:, 3:], marked[:, 1:2]], axis=1)
        rows.append(tuple(float(v) for v in np.percentile((cols - t0) / 1e3, q, axis=0)))
    return rows


def sm_load(stamps, groups):
    """Per group: {k: (SMs that ran k of the group's blocks, median end of those blocks in us from
    the launch's first entry)}. Where an SM's blocks share its memory throughput, the blocks of SMs
    that ran more of the group end later, and the group's end waits for them."""
    t0, parts = by_group(stamps, groups)
    out = []
    for g in parts:
        sms, per_sm = np.unique(g[:, 2], return_counts=True)
        count = dict(zip(sms.tolist(), per_sm.tolist()))
        k_of = np.array([count[s] for s in g[:, 2].tolist()])
        out.append({int(k): (int((per_sm == k).sum()), float(np.median(g[k_of == k, 1] - t0) / 1e3))
                    for k in np.unique(per_sm)})
    return out

