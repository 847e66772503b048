"""Text partitions deal out a play's speeches: IID at random, Dirichlet by speaking character, or each
character on one client; the contiguous shards stay available."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlmc.data.partition import partition
from fedlmc.data.text import load_text, speeches

PLAY = Path(__file__).resolve().parents[1] / "fedlmc" / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="module")
def train():
    return load_text(PLAY, block_size=32).train


def test_speeches_tile_the_text_and_carry_their_speaker():
    text = "First Citizen:\nSpeak, speak.\n\nAll:\nSpeak.\n\nSome narration here.\n"
    u = speeches(text)
    assert u.labels == ["FIRST CITIZEN", "ALL", ""]
    assert u.starts[0] == 0 and list(u.starts[1:]) == list(u.ends[:-1]) and u.ends[-1] == len(text)
    assert text[u.starts[1] : u.ends[1]] == "All:\nSpeak.\n\n"


def _speakers(parts):
    return [Counter(p.units.labels) for p in parts]


def test_every_scheme_keeps_every_speech_once(train):
    n = len(train.units)
    for scheme in ("iid", "dirichlet", "speaker"):
        parts = partition(train, 4, scheme, alpha=0.5, seed=1)
        assert sum(len(p.units) for p in parts) == n
        assert sum(len(p.tokens) for p in parts) == int(train.units.ends[-1] - train.units.starts[0])
        for p in parts:  # each client's stream is its speeches, unit boundaries intact
            assert list(p.units.starts[1:]) == list(p.units.ends[:-1]) and p.units.ends[-1] == len(p.tokens)


def test_speaker_scheme_puts_each_character_on_one_client(train):
    sets = [set(c) for c in _speakers(partition(train, 4, "speaker", seed=0))]
    assert all(len(s) > 10 for s in sets)
    assert all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1 :])
    assert (
        partition(train, 4, "speaker", seed=1)[0].tokens.shape != partition(train, 4, "speaker", seed=0)[0].tokens.shape
    )


def test_speaker_groups_are_not_sorted_by_how_much_a_speaker_says(train):
    """Grouping speakers in their order of first appearance put the chatty ones together (one client
    held ~70 % of the text); a random grouping of ~70 speakers per client keeps every share near 1/4."""
    for seed in range(3):
        sizes = [len(p.tokens) for p in partition(train, 4, "speaker", seed=seed)]
        assert max(sizes) / sum(sizes) < 0.45, sizes


def test_dirichlet_is_more_skewed_than_iid(train):
    """Skew = mean over clients of the total-variation distance between a client's speaker mix and the
    whole text's; Dirichlet(0.5) by speaker must be far above IID's sampling noise."""
    total = Counter(train.units.labels)
    n = sum(total.values())

    def skew(parts):
        tv = []
        for c in _speakers(parts):
            m = sum(c.values())
            tv.append(0.5 * sum(abs(c[k] / m - total[k] / n) for k in total))
        return float(np.mean(tv))

    iid, dirichlet = skew(partition(train, 4, "iid", seed=0)), skew(partition(train, 4, "dirichlet", alpha=0.5, seed=0))
    assert dirichlet > 2 * iid and dirichlet > 0.2, (iid, dirichlet)


def test_contiguous_shards_and_clear_errors(train):
    parts = partition(train, 3, "contiguous")
    assert torch.equal(torch.cat([p.tokens for p in parts]), train.tokens)
    bare = type(train)(train.tokens, train.block_size)  # no speeches known
    with pytest.raises(ValueError, match="contiguous"):
        partition(bare, 2, "iid")
    prose = load_text_from("Plain prose, no headings.\n\n" * 400)
    with pytest.raises(ValueError, match="speaker labels"):
        partition(prose, 2, "speaker")
    assert len(partition(prose, 2, "iid")) == 2


def load_text_from(text: str):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.txt"
        p.write_text(text)
        return load_text(p, block_size=8).train
